"""Session state shared by gateway replicas through a real Redis (``state.backend: redis``).

The store on its own (serializer, corrupt values, what a load may overwrite), then real
``specgate serve`` processes over sim workers: a session that one replica drove into
low-acceptance fallback stays there on another, and outlives the first; with the memory
backend it does not (the control); and a replica whose Redis dies keeps serving and writes
again once Redis is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from prometheus_client import CollectorRegistry

from gateway.config.config import GatewayConfig, SessionsConfig, StateConfig
from gateway.observe.ops_metrics import OpsMetrics
from gateway.sessions.store import (
    SCHEMA_VERSION,
    CorruptState,
    MemoryStore,
    RedisStore,
    apply_session,
    create_store,
    dump_session,
    parse_session,
)
from gateway.sessions.table import ModeChange, Session
from policies import Decision, PolicyConfig, SessionState
from tests.e2e.harness import Gateway, sdk_client, start_gateway, write_config
from tests.e2e.redis_harness import RedisServer, start_redis

LOW = "plain; reason=low_acceptance"
PROMPT = "[chat] tell me something"  # the sim's chat category: acceptance 0.3 in these configs
WAIT_S = 60.0  # generous: a loaded 2-core CI machine


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} (last: {value!r})")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


def redis_client(server: RedisServer) -> redis.Redis:
    return redis.Redis(port=server.port, socket_timeout=10)


def a_session(requests: int = 3) -> Session:
    session = Session("sess-1", last_seen=12.5, worker_id="worker-1", history=deque(maxlen=4), scope="k1")
    session.policy_state = SessionState(acceptance_estimate=0.3125, acceptance_weight=40.0, proposals_seen=40,
                                        drafts_proposed=70, drafts_accepted=13, low_acceptance=True,
                                        plain_since_probe=2, auto_k=3)
    session.last_decision = Decision("plain", 0, "low_acceptance")
    session.history.extend([ModeChange(1700000000.25, "speculative", "default", 6),
                            ModeChange(1700000001.5, "plain", "low_acceptance", 0)])
    session.requests = requests
    return session


def controller_fields(session: Session) -> tuple[Any, ...]:
    return session.policy_state, session.last_decision, list(session.history), session.requests, session.worker_id


# -- the stored form -------------------------------------------------------------------------------
def test_a_session_round_trips_through_the_serializer() -> None:
    source = a_session()
    raw = dump_session(source)
    assert orjson.loads(raw)["v"] == SCHEMA_VERSION
    target = Session("sess-1", last_seen=99.0, history=deque(maxlen=4), scope="k1")
    history = target.history
    apply_session(target, raw)
    assert controller_fields(target) == controller_fields(source)
    assert target.history is history and target.history.maxlen == 4  # updated in place, bound kept
    assert target.last_seen == 99.0  # the local clock's, never stored

    fresh = Session("new", last_seen=0.0)
    apply_session(fresh, dump_session(Session("new", last_seen=5.0)))
    assert controller_fields(fresh) == (SessionState(), None, [], 0, None)


def test_a_tree_session_round_trips_and_one_stored_before_trees_still_loads() -> None:
    from policies import StepPath, TreeShape, observe_path
    from policies.speculation import record_decision

    source = a_session()
    tree = TreeShape.parse("2x2+3")
    state = observe_path(source.policy_state, StepPath(tree, (1, 2, 0)), PolicyConfig())
    source.policy_state = record_decision(state, Decision("speculative", 5, "default", tree), auto_k=True)
    source.last_decision = Decision("speculative", 5, "default", tree)
    source.history.append(ModeChange(1700000002.0, "speculative", "default", 5, "2x2+3"))
    target = Session("sess-1", last_seen=99.0, history=deque(maxlen=4), scope="k1")
    apply_session(target, dump_session(source))
    assert controller_fields(target) == controller_fields(source)
    assert target.policy_state.auto_tree == tree and target.policy_state.ranks == source.policy_state.ranks
    # A value written before trees (no "tree", 3-field decisions, 4-field history entries) loads as it did.
    old = orjson.loads(dump_session(a_session()))
    assert "tree" not in old
    target = Session("sess-1", last_seen=99.0, history=deque(maxlen=4), scope="k1")
    apply_session(target, orjson.dumps(old))
    assert controller_fields(target) == controller_fields(a_session())
    for bad in ({**old, "decision": ["speculative", 4, "default", "2x2+3"]},  # k is not the tree's depth
                {**old, "decision": ["speculative", 5, "default", "9x9"]},
                {**old, "tree": {"auto": None, "since": 0, "ranks": [[99, 0.5, 3.0, 3]]}},
                {**old, "tree": {"auto": None, "since": 0, "ranks": [[0, 1.5, 3.0, 3]]}},
                {**old, "tree": {"auto": None, "since": 0, "ranks": [[0, 0.5, -3.0, 3]]}},
                {**old, "tree": {"auto": None, "since": 0, "ranks": [[0, 0.5, 3]]}},  # schema 1's cell
                {**old, "tree": {"auto": None, "since": -1, "ranks": []}}):
        with pytest.raises(CorruptState):
            apply_session(target, orjson.dumps(bad))



def test_a_session_choosing_methods_round_trips_and_one_stored_before_methods_still_loads() -> None:
    from policies import observe_lookup
    from policies.speculation import record_decision

    source = a_session()
    state = observe_lookup(source.policy_state, "ngram", [(4, 3), (0, 0), (6, 6)], PolicyConfig())
    decision = Decision("speculative", 6, "explore", method="suffix")
    source.policy_state = record_decision(state, decision)
    source.last_decision = decision
    target = Session("sess-1", last_seen=99.0, history=deque(maxlen=4), scope="k1")
    apply_session(target, dump_session(source))
    assert controller_fields(target) == controller_fields(source)
    assert target.policy_state.method == "suffix" and target.last_decision == decision
    assert target.policy_state.lookups[0].steps_seen == 3 and target.policy_state.lookups[0].drafts_accepted == 9
    old = orjson.loads(dump_session(a_session()))
    assert "methods" not in old  # nothing chosen: stored exactly as before methods
    stored = orjson.loads(dump_session(source))
    methods = stored["methods"]
    for bad_methods in ({**methods, "method": "eagle"},
                        {**methods, "lookups": [["ngram", 0.5, 1.0, 1, 1, 1, "no", 1.0, 1.0, 1]]},
                        {**methods, "lookups": [["ngram", 1.5, 1.0, 1, 1, 1, False, 1.0, 1.0, 1]]},
                        {**methods, "lookups": [["ngram", 0.5]]}):
        with pytest.raises(CorruptState):
            apply_session(target, orjson.dumps({**stored, "methods": bad_methods}))


GOOD = orjson.loads(dump_session(a_session()))


@pytest.mark.parametrize(("seen", "weight"), [(40, 40.0), (1000, 64 / math.log(2))])
def test_a_session_stored_by_schema_1_loads_at_most_h_over_ln2_drafts_of_evidence(seen: int, weight: float) -> None:
    """Schema 1 kept a bare EWMA and the lifetime count: its estimate is read as that many tested
    drafts of evidence, at most H / ln 2 (what an endless stream levels off at), never as corrupt."""
    old = {**GOOD, "v": 1, "state": [0.3125, seen, True, 2, 3],
           "tree": {"auto": None, "since": 1, "ranks": [[0, 0.75, seen]]}}
    session = a_session()
    apply_session(session, orjson.dumps(old), half_life=64.0)
    state = session.policy_state
    assert (state.acceptance_estimate, state.proposals_seen, state.low_acceptance, state.plain_since_probe,
            state.auto_k) == (0.3125, seen, True, 2, 3)
    assert state.acceptance_weight == pytest.approx(weight)
    assert (state.drafts_proposed, state.drafts_accepted) == (0, 0)  # schema 1 never counted them
    beta, cell_weight, tests = state.ranks[0]
    assert (beta, tests) == (0.75, seen) and cell_weight == pytest.approx(weight)
    # Written back, it is schema 2 and round-trips.
    again = a_session()
    apply_session(again, dump_session(session))
    assert again.policy_state == state


@pytest.mark.parametrize("raw", [
    b"", b"not json", b"\xff\xfe", b"[]", b"null", b'"a string"', b"{}",
    orjson.dumps({**GOOD, "v": SCHEMA_VERSION + 1}),
    orjson.dumps({k: v for k, v in GOOD.items() if k != "history"}),
    orjson.dumps({**GOOD, "state": [0.5, 10.0, 10, 12, 5, 1, 0, None]}),  # low_acceptance not a bool
    orjson.dumps({**GOOD, "state": [1.5, 10.0, 10, 12, 5, True, 0, None]}),  # acceptance beyond 1
    orjson.dumps({**GOOD, "state": [0.5, 10.0, -1, 12, 5, True, 0, None]}),
    orjson.dumps({**GOOD, "state": [0.5, -10.0, 10, 12, 5, True, 0, None]}),  # a negative weight
    orjson.dumps({**GOOD, "state": [0.5, 10.0, 10, -12, 5, True, 0, None]}),
    orjson.dumps({**GOOD, "state": [0.5, 10, True, 0, None]}),  # schema 1's state under schema 2
    orjson.dumps({**GOOD, "v": 1}),  # schema 2's state under schema 1
    orjson.dumps({**GOOD, "state": [0.5, 10.0, True]}),
    orjson.dumps({**GOOD, "decision": ["plain", 0, "no_such_reason"]}),
    orjson.dumps({**GOOD, "decision": ["turbo", 0, "default"]}),
    orjson.dumps({**GOOD, "history": [[1.0, "plain", "default"]]}),
    orjson.dumps({**GOOD, "requests": "3"}),
    orjson.dumps({**GOOD, "worker": 7}),
])
def test_corrupt_or_foreign_values_are_refused_and_leave_the_session_alone(raw: bytes) -> None:
    session = a_session()
    before = controller_fields(session)
    with pytest.raises(CorruptState):
        apply_session(session, raw)
    assert controller_fields(session) == before


def test_the_memory_store_does_not_import_redis() -> None:
    import subprocess
    import sys

    code = ("import sys; from gateway.relay.app import create_app; from gateway.config.config import GatewayConfig; "
            "create_app(GatewayConfig()); assert 'redis' not in sys.modules, 'redis imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    store = create_store(GatewayConfig(), OpsMetrics.create(CollectorRegistry()))
    assert type(store) is MemoryStore
    assert store.describe() == {"state_backend": "memory", "state_backend_up": True}


# -- the store against a real Redis ----------------------------------------------------------------
def store_config(server: RedisServer, prefix: str, **state: Any) -> GatewayConfig:
    settings = {"timeout_s": 5.0, "retry_s": 60.0, **state}
    return GatewayConfig(sessions=SessionsConfig(idle_ttl_s=600.0, history=4),
                         state=StateConfig(backend="redis", redis_url=server.url, key_prefix=prefix, **settings))


def errors(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("specgate_state_backend_errors_total", {"reason": reason}) or 0.0


async def written(store: RedisStore, session: Session) -> bytes:
    assert store.client is not None
    deadline = time.monotonic() + WAIT_S
    while True:
        # WRONGTYPE or a corrupt value until the write replaces a foreign key
        with contextlib.suppress(redis.ResponseError, CorruptState):
            raw = await store.client.get(store.key(session))
            if raw is not None:
                assert isinstance(raw, bytes)
                parse_session(raw)
                return raw
        assert time.monotonic() < deadline, "the write never landed"
        await asyncio.sleep(0.02)


async def test_two_stores_share_a_session_with_the_session_ttl(redis_server: RedisServer) -> None:
    prefix = f"t-{uuid.uuid4().hex}:"
    one = RedisStore(store_config(redis_server, prefix), OpsMetrics.create(CollectorRegistry()))
    two = RedisStore(store_config(redis_server, prefix), OpsMetrics.create(CollectorRegistry()))
    async with one.running(), two.running():
        source = a_session()
        one.save(source)
        raw = await written(one, source)
        assert one.key(source) == f"{prefix}session:k1:sess-1"
        assert one.client is not None
        assert 0 < await one.client.pttl(one.key(source)) <= 600_000
        assert parse_session(raw)[0] == source.policy_state

        other = Session("sess-1", last_seen=0.0, history=deque(maxlen=4), scope="k1")
        await two.load(other)
        assert controller_fields(other) == controller_fields(source)
        unscoped = Session("sess-1", last_seen=0.0)  # another API key's session of that id
        await two.load(unscoped)
        assert unscoped.policy_state == SessionState()


async def test_a_load_does_not_undo_what_this_replica_learned_since_it_wrote(redis_server: RedisServer) -> None:
    """A request still running here has folded steps the stored copy lacks: the copy this
    replica wrote itself is not applied over them (another replica's is: last writer wins)."""
    prefix = f"t-{uuid.uuid4().hex}:"
    mine = RedisStore(store_config(redis_server, prefix), OpsMetrics.create(CollectorRegistry()))
    theirs = RedisStore(store_config(redis_server, prefix), OpsMetrics.create(CollectorRegistry()))
    async with mine.running(), theirs.running():
        session = a_session()
        mine.save(session)
        await written(mine, session)
        session.policy_state = replace(session.policy_state, proposals_seen=55)  # a step since
        await mine.load(session)
        assert session.policy_state.proposals_seen == 55

        elsewhere = a_session(requests=9)
        theirs.save(elsewhere)
        assert mine.client is not None
        deadline = time.monotonic() + WAIT_S
        while parse_session(await written(mine, session))[3] != 9:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        await mine.load(session)
        assert session.requests == 9 and session.policy_state.proposals_seen == 40


@pytest.mark.parametrize("foreign", ["garbage", "hash"])
async def test_a_corrupt_or_foreign_value_in_redis_is_ignored(redis_server: RedisServer, foreign: str) -> None:
    prefix = f"t-{uuid.uuid4().hex}:"
    registry = CollectorRegistry()
    store = RedisStore(store_config(redis_server, prefix), OpsMetrics.create(registry))
    async with store.running():
        session = a_session()
        before = controller_fields(session)
        assert store.client is not None
        if foreign == "hash":  # another program's key of another type: GET answers WRONGTYPE
            await store.client.hset(store.key(session), "field", "value")
        else:
            await store.client.set(store.key(session), b'{"v": 1, "state": "no"}')
        await store.load(session)
        assert controller_fields(session) == before
        assert errors(registry, "corrupt") == 1
        assert store.up  # a bad value is not an outage
        store.save(session)  # and the next write replaces it
        assert parse_session(await written(store, session))[0] == session.policy_state


async def test_a_dead_redis_costs_one_failure_per_retry_window(tmp_path: Path) -> None:
    server = start_redis(tmp_path)
    registry = CollectorRegistry()
    store = RedisStore(store_config(server, "t:", retry_s=3600.0), OpsMetrics.create(registry))
    async with store.running():
        server.stop()
        session = a_session()
        before = controller_fields(session)
        await store.load(session)
        assert not store.up and controller_fields(session) == before
        failures = errors(registry, "error") + errors(registry, "timeout")
        assert failures >= 1
        for _ in range(5):  # inside retry_s: Redis is not tried, nothing is queued
            await store.load(session)
            store.save(session)
        assert errors(registry, "error") + errors(registry, "timeout") == failures
        assert store.describe() == {"state_backend": "redis", "state_backend_up": False, "state_queued": 0}
        assert registry.get_sample_value("specgate_state_backend_up") == 0


# -- real gateway replicas -------------------------------------------------------------------------
def replica_config(path: Path, backend: str, redis_url: str, prefix: str, **state: Any) -> Path:
    return write_config(
        path,
        # The sim answers at once; its chat category accepts 30% of drafts, far below the floor.
        workers={"count": 1, "engine": "sim", "max_slots": 16,
                 "sim": {"time_scale": 0, "seed": 1, "acceptance": {"chat": [[None, 0.3]]}}},
        # probe_every high: the fallen-back session's next requests are all plain (no probe to allow for).
        policy={"min_proposals": 16, "acceptance_floor": 0.6, "acceptance_resume": 0.8, "probe_every": 1000,
                "num_speculative_tokens": 6},
        sessions={"idle_ttl_s": 600},
        state={"backend": backend, "redis_url": redis_url, "key_prefix": prefix, "timeout_s": 5, "retry_s": 1,
               **state})


def start_replicas(config: Path, tmp: Path, count: int) -> list[Gateway]:
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda _: start_gateway(config, tmp), range(count)))


def complete(gateway: Gateway, session: str) -> str:
    with sdk_client(gateway) as client:
        raw = client.completions.with_raw_response.create(model="specgate-demo", prompt=PROMPT, max_tokens=32,
                                                          temperature=0, extra_headers={"X-Session-ID": session})
        assert raw.http_response.status_code == 200
        return str(raw.headers["X-Specgate-Mode"])


def drive_into_fallback(gateway: Gateway, session: str) -> dict[str, Any]:
    modes = [complete(gateway, session) for _ in range(2)]
    while LOW not in modes:
        assert len(modes) < 20, modes
        modes.append(complete(gateway, session))
    record: dict[str, Any] = gateway.get_json(f"/admin/sessions/{session}")
    assert record["low_acceptance"] and record["evidence_drafted_tokens"] >= 16, record
    return record


def stored(server: RedisServer, key: str) -> Any:
    raw = redis_client(server).get(key)
    return orjson.loads(raw) if raw is not None else None


def test_a_session_that_fell_back_on_one_replica_stays_plain_on_another(redis_server: RedisServer,
                                                                        tmp_path: Path) -> None:
    prefix = f"e2e-{uuid.uuid4().hex}:"
    config = replica_config(tmp_path / "config.yaml", "redis", redis_server.url, prefix)
    a, b = start_replicas(config, tmp_path, 2)
    try:
        assert a.get_json("/ready")["state_backend"] == "redis" and a.get_json("/ready")["state_backend_up"]
        on_a = drive_into_fallback(a, "alice")
        key = f"{prefix}session::alice"
        wait_for("A's state in redis",
                 lambda: (stored(redis_server, key) or {}).get("requests") == on_a["requests"])

        assert complete(b, "alice") == LOW
        on_b = b.get_json("/admin/sessions/alice")
        for field in ("acceptance_estimate", "evidence_drafted_tokens", "low_acceptance", "worker"):
            assert on_b[field] == on_a[field], (field, on_a, on_b)
        assert on_b["requests"] == on_a["requests"] + 1
        assert on_b["mode_changes"] == on_a["mode_changes"]  # the fallback happened on A; B did not switch

        a.stop()
        assert complete(b, "alice") == LOW
        wait_for("B's state in redis",
                 lambda: (stored(redis_server, key) or {}).get("requests") == on_a["requests"] + 2)
        # A restarted (a new process, an empty session table) knows it too.
        a = start_gateway(config, tmp_path)
        assert complete(a, "alice") == LOW
        assert a.get_json("/admin/sessions/alice")["evidence_drafted_tokens"] == on_a["evidence_drafted_tokens"]

        # A corrupt value is ignored (local state kept), never a 500.
        redis_client(redis_server).set(key, b"\x00not json")
        assert complete(b, "alice") == LOW
        assert b.metric("specgate_state_backend_errors_total", reason="corrupt") == 1
    finally:
        a.stop()
        b.stop()


def test_with_the_memory_backend_another_replica_does_not_know_the_session(redis_server: RedisServer,
                                                                           tmp_path: Path) -> None:
    """The control: the same steps without Redis, and the second replica starts from nothing."""
    config = replica_config(tmp_path / "config.yaml", "memory", redis_server.url, f"mem-{uuid.uuid4().hex}:")
    a, b = start_replicas(config, tmp_path, 2)
    try:
        assert a.get_json("/ready")["state_backend"] == "memory"
        drive_into_fallback(a, "alice")
        assert complete(b, "alice").startswith("speculative; k=6; reason=default")
        assert b.get_json("/admin/sessions/alice")["requests"] == 1
        assert not redis_client(redis_server).keys("mem-*")
    finally:
        a.stop()
        b.stop()


def test_a_replica_whose_redis_dies_keeps_serving_and_writes_again_once_it_is_back(tmp_path: Path) -> None:
    server = start_redis(tmp_path / "redis")
    prefix = "degraded:"
    gateway = start_gateway(replica_config(tmp_path / "config.yaml", "redis", server.url, prefix), tmp_path)
    try:
        key = f"{prefix}session::bob"
        complete(gateway, "bob")
        wait_for("the first write", lambda: stored(server, key))

        server.stop()
        for _ in range(3):
            complete(gateway, "bob")  # 200s from local state
        wait_for("/ready to say the backend is down", lambda: gateway.get_json("/ready")["state_backend_up"] is False)
        assert gateway.get_json("/ready")["status"] == "ready"  # degraded is not unready
        assert gateway.metric("specgate_state_backend_up") == 0
        assert gateway.metric("specgate_state_backend_errors_total") >= 1

        server.start()  # the same port, empty: nothing persisted
        assert stored(server, key) is None
        # Once retry_s has passed, the session's next request writes its local state.
        requests = wait_for("a request's state written again",
                            lambda: complete(gateway, "bob") and (stored(server, key) or {}).get("requests"))
        assert requests >= 5
        wait_for("/ready to say the backend is back", lambda: gateway.get_json("/ready")["state_backend_up"])
        assert gateway.metric("specgate_state_backend_up") == 1
        log = gateway.log()
        assert log.count("state backend redis failed") == 1, log  # once per outage
        assert log.count("state backend redis is back") == 1, log
    finally:
        gateway.stop()
        server.stop()
