"""Pure pieces of the gateway: the session table and the router."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Histogram

from gateway.config.config import SessionsConfig
from gateway.fleet.probe import precision_signature
from gateway.fleet.routing import Candidate, Route, StepKind, choose_route, choose_worker, load_bound, unbalanced
from gateway.fleet.supervisor import HEALTHY_RUN_S, restart_delay
from gateway.observe.metrics import TOKEN_GAP_BUCKETS, GatewayMetrics
from gateway.sessions.table import SessionTable
from policies import Decision, Mode, PolicyConfig


def test_lru_bound_evicts_least_recently_used() -> None:
    table = SessionTable(SessionsConfig(max_sessions=3, idle_ttl_s=100, history=5))
    for i, name in enumerate(["a", "b", "c"]):
        table.touch(name, now=i)
    table.touch("a", now=3)  # a is now the most recent
    table.touch("d", now=4)  # evicts b, the least recently used
    assert table.get("b") is None
    assert [s for s in ("a", "c", "d") if table.get(s) is not None] == ["a", "c", "d"]
    assert len(table) == 3 and table.evicted == 1


def test_memory_stays_bounded_under_many_sessions() -> None:
    table = SessionTable(SessionsConfig(max_sessions=100, idle_ttl_s=1e9, history=5))
    for i in range(10_000):
        table.touch(f"s{i}", now=i)
    assert len(table) == 100 and table.evicted == 9_900


def test_idle_sessions_expire() -> None:
    table = SessionTable(SessionsConfig(max_sessions=10, idle_ttl_s=10, history=5))
    table.touch("old", now=0)
    table.touch("fresh", now=5)
    table.touch("probe", now=10.5)  # old is 10.5 s idle: gone; fresh is 5.5 s idle: kept
    assert table.get("old") is None and table.get("fresh") is not None
    again = table.touch("old", now=11)
    assert again.requests == 0 and again.worker_id is None  # a new session under the same id


def test_new_ids_are_unique_and_history_is_bounded() -> None:
    table = SessionTable(SessionsConfig(max_sessions=10, idle_ttl_s=10, history=2))
    a, b = table.touch(None, now=0), table.touch(None, now=0)
    assert a.session_id != b.session_id and a.session_id.startswith("sess-")
    assert a.history.maxlen == 2


def test_move_off_unpins_sessions_and_counts_modes() -> None:
    table = SessionTable(SessionsConfig(max_sessions=10, idle_ttl_s=10, history=5))
    for name, worker, mode in (("x", "w0", "speculative"), ("y", "w0", "plain"), ("z", "w1", None)):
        session = table.touch(name, now=0)
        session.worker_id = worker
        if mode == "speculative":
            session.last_decision = Decision("speculative", 2, "default")
        elif mode == "plain":
            session.last_decision = Decision("plain", 0, "high_temperature")
    assert table.move_off("w0") == 2
    assert [table.get(n).worker_id for n in ("x", "y", "z")] == [None, None, "w1"]  # type: ignore[union-attr]
    assert table.counts_by_mode() == {"speculative": 1, "plain": 1, "undecided": 1}


def ready(worker_id: str, load: int, modes: frozenset[str] = frozenset({"speculative", "plain"})) -> Candidate:
    return Candidate(worker_id, True, load, modes)  # type: ignore[arg-type]


@pytest.mark.parametrize(("current", "candidates", "expected"), [
    (None, [ready("a", 3), ready("b", 1), ready("c", 2)], "b"),  # least loaded
    ("a", [ready("a", 3), ready("b", 1)], "a"),  # sticky while ready
    ("a", [Candidate("a", False, 0, frozenset()), ready("b", 5)], "b"),  # moves when down
    ("gone", [ready("a", 1)], "a"),  # its worker no longer exists
    (None, [ready("a", 1), ready("b", 1)], "a"),  # ties: first listed
    (None, [Candidate("a", False, 0, frozenset())], None),  # nothing ready
])
def test_choose_worker(current: str | None, candidates: list[Candidate], expected: str | None) -> None:
    assert choose_worker(current, candidates) == expected
    route = choose_route(current, candidates)
    assert (route.worker_id if route else None) == expected


PLAIN: frozenset[Mode] = frozenset({"plain"})
SPECULATIVE: frozenset[Mode] = frozenset({"speculative"})


@pytest.mark.parametrize(("current", "candidates", "expected"), [
    (None, [ready("a", 0, PLAIN), ready("b", 4), ready("c", 2, SPECULATIVE)], Route("a", "c")),  # least loaded
    ("c", [ready("a", 0, PLAIN), ready("c", 2, SPECULATIVE)], Route("c", "a", "sticky")),  # sticky, and the other mode
    (None, [ready("a", 0, PLAIN), ready("b", 4, PLAIN)], Route("a")),  # nobody serves the other mode
    (None, [ready("a", 0, PLAIN), Candidate("b", False, 0, SPECULATIVE)], Route("a")),  # ...that is ready
    (None, [ready("a", 0), ready("b", 0, SPECULATIVE)], Route("a")),  # both modes: no other needed
    (None, [ready("a", 0, frozenset()), ready("b", 1, PLAIN)], Route("a")),  # serves nothing yet
])
def test_choose_route_names_a_worker_of_the_other_mode(current: str | None, candidates: list[Candidate],
                                                       expected: Route) -> None:
    assert choose_route(current, candidates) == expected


RULES = PolicyConfig(route_balance_abs=4, route_balance_rel=1.5, route_min_prefix_hit=0.1)


@pytest.mark.parametrize(("current", "loads", "hits", "expected"), [
    # sticky while its worker is ready and not the one an unbalanced fleet piles on
    ("a", {"a": 3, "b": 0}, {}, Route("a", reason="sticky")),
    ("a", {"a": 9, "b": 2}, {}, Route("b", reason="load")),  # unbalanced: 9 - 2 > 4 and 9 > 1.5 x 2
    ("a", {"a": 9, "b": 2, "c": 9}, {}, Route("b", reason="load")),  # a shares the top: it moves too
    ("a", {"a": 6, "b": 2, "c": 9}, {}, Route("a", reason="sticky")),  # unbalanced, but c is the hotspot
    # a new request: the expected prefix hit against load
    (None, {"a": 2, "b": 0}, {"a": 0.8}, Route("a", reason="prefix")),  # 3 x 0.8 + 2 x 0 beats 0 + 2 x 1
    (None, {"a": 2, "b": 0}, {"a": 0.2}, Route("b", reason="load")),  # 0.6 < 2: load wins the score
    (None, {"a": 2, "b": 0}, {"a": 0.05}, Route("b", reason="load")),  # below route_min_prefix_hit: least loaded
    (None, {"a": 9, "b": 2}, {"a": 1.0}, Route("b", reason="load")),  # the guard: load alone
    (None, {"a": 6, "b": 2}, {"a": 1.0}, Route("a", reason="prefix")),  # 6 - 2 = 4: not beyond the guard
    (None, {"a": 1, "b": 1}, {"a": 0.5, "b": 0.5}, Route("a", reason="prefix")),  # ties: first listed
    # the load bound, 2 x the mean (this request counted) + 2: the guard's 4-ahead is not reached,
    # but a's 5th request would pass 2 x 5 / 4 + 2 = 4.5, so the session moves and the hit is not taken
    ("a", {"a": 4, "b": 0, "c": 0, "d": 0}, {}, Route("b", reason="load")),
    ("a", {"a": 3, "b": 0, "c": 0, "d": 0}, {}, Route("a", reason="sticky")),  # 4 <= 2 x 4 / 4 + 2
    (None, {"a": 4, "b": 0, "c": 0, "d": 0}, {"a": 1.0}, Route("b", reason="load")),
    (None, {"a": 4, "b": 0, "c": 1, "d": 0, "e": 0}, {"a": 1.0, "c": 0.5}, Route("c", reason="prefix")),  # within 4.4
])
def test_cache_aware_routing_with_a_load_guard(current: str | None, loads: dict[str, int], hits: dict[str, float],
                                               expected: Route) -> None:
    assert choose_route(current, [ready(w, load) for w, load in loads.items()], hits, RULES) == expected


def test_the_load_bound_is_off_at_factor_zero_and_counts_the_request() -> None:
    unbounded = PolicyConfig(route_load_factor=0.0)
    fleet = [ready("a", 4), ready("b", 0), ready("c", 0), ready("d", 0)]
    assert choose_route("a", fleet, {}, unbounded) == Route("a", reason="sticky")
    assert load_bound([4, 0, 0, 0], unbounded) == math.inf
    assert load_bound([4, 0, 0, 0], RULES) == 2.0 * 5 / 4 + 2.0
    # The tightest bound still keeps an idle fleet's sessions where they are.
    tight = PolicyConfig(route_load_factor=1.0, route_load_slack=1.0)
    assert load_bound([0] * 4, tight) == 1 / 4 + 1
    assert choose_route("b", [ready(w, 0) for w in "abcd"], {}, tight) == Route("b", reason="sticky")
    assert choose_route("b", [ready("a", 0), ready("b", 2)], {}, tight) == Route("a", reason="load")  # 3 > 2.5


def mixed(worker_id: str, drafting: int, looking: int) -> Candidate:
    return Candidate(worker_id, True, drafting + looking, PLAIN | SPECULATIVE, drafting, looking)


METHOD_RULES = PolicyConfig(route_method_margin=2)


@pytest.mark.parametrize(("current", "kind", "fleet", "expected"), [
    # a lookup session whose worker drafts moves where lookups run...
    ("a", "lookup", [mixed("a", 2, 1), mixed("b", 0, 2)], Route("b", reason="method")),  # -1 -> 2: by 3
    ("a", "lookup", [mixed("a", 1, 0), mixed("b", 0, 1)], Route("b", reason="method")),  # -1 -> 1: by 2
    # ...but not for less than the margin, nor when nothing beside it drafts
    ("a", "lookup", [mixed("a", 1, 1), mixed("b", 0, 1)], Route("a", reason="sticky")),  # 0 -> 1
    ("a", "lookup", [mixed("a", 0, 2), mixed("b", 0, 4)], Route("a", reason="sticky")),
    # a drafting session, the other way; the first of equals
    ("a", "draft", [mixed("a", 0, 2), mixed("b", 1, 0), mixed("c", 1, 0)], Route("b", reason="method")),
    # plain, or no request yet: sticky
    ("a", None, [mixed("a", 3, 0), mixed("b", 0, 3)], Route("a", reason="sticky")),
    # never past the load bound (2 x (9 + 1) / 2 + 2 = 12: b's 12 + 1 would pass it)
    ("a", "lookup", [mixed("a", 0, 0), mixed("b", 0, 12)], Route("a", reason="sticky")),
    ("a", "lookup", [mixed("a", 1, 0), mixed("b", 0, 8)], Route("b", reason="method")),
])
def test_a_session_moves_to_a_batch_that_runs_its_kind_of_step(current: str, kind: StepKind | None,
                                                                 fleet: list[Candidate], expected: Route) -> None:
    assert choose_route(current, fleet, {}, METHOD_RULES, kind) == expected
    # Off by default: the session stays with its worker (and its prefix cache).
    assert choose_route(current, fleet, {}, RULES, kind) == Route(current, reason="sticky")


def test_the_load_guard_needs_both_thresholds() -> None:
    assert unbalanced([10, 2], RULES) and not unbalanced([6, 2], RULES)  # 4 is not beyond route_balance_abs
    assert not unbalanced([30, 25], RULES)  # far apart, but within 1.5x
    assert not unbalanced([7], RULES)


@pytest.mark.parametrize("amount", [0.0, 0.0005, 0.001, 0.003, 0.7, 5.0])  # a boundary, the last bucket, +Inf
@pytest.mark.parametrize("n", [1, 2, 63])
def test_observe_many_is_n_observations(amount: float, n: int) -> None:
    samples = []
    for weighted in (False, True):
        registry = CollectorRegistry()
        gaps = Histogram("gaps_seconds", "gaps", ["mode"], buckets=TOKEN_GAP_BUCKETS, registry=registry)
        child = gaps.labels("plain")
        child.observe(0.002)  # an earlier observation stays as it was
        if weighted:
            GatewayMetrics.observe_many(child, amount, n)
        else:
            for _ in range(n):
                child.observe(amount)
        samples.append({(s.name, tuple(sorted(s.labels.items()))): s.value for metric in registry.collect()
                        for s in metric.samples if not s.name.endswith("_created")})
    plain, weighted_samples = samples
    assert plain.keys() == weighted_samples.keys()
    for key, value in plain.items():  # buckets and count exactly; the sum up to rounding (n additions)
        assert weighted_samples[key] == (pytest.approx(value, rel=1e-12) if key[0].endswith("_sum") else value), key


def test_restart_delay_doubles_per_consecutive_failure_up_to_the_cap() -> None:
    """The first failure (or a worker that had run HEALTHY_RUN_S: 0) waits the configured
    delay; each consecutive one twice the last, never more than the cap."""
    assert [restart_delay(n, 0.5, 30.0) for n in range(9)] == [0.5, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert restart_delay(3, 0.0, 30.0) == 0.0 and restart_delay(5, 2.0, 0.0) == 0.0
    assert HEALTHY_RUN_S == 60.0  # README's workers.restart_backoff_s row states it


def test_precision_signature_tells_apart_what_changes_the_arithmetic() -> None:
    def info(target: str | None, prepacked: bool = True, products: str | None = "float32") -> dict[str, object]:
        return {"precision": {"target": target, "target_prepacked": prepacked, "products": products, "why": "x"}}

    assert precision_signature(info("float32")) == "a float32 prepacked target with float32 products"
    # Same dtype, other products: the two round differently, so the fleet must tell them apart.
    assert precision_signature(info("float32")) != precision_signature(info("float32", products="bfloat16"))
    assert precision_signature(info("bfloat16", prepacked=False, products=None)) == "a bfloat16 target"
    assert precision_signature(info(None)) is None and precision_signature({}) is None
