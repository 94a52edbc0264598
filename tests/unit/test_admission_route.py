"""gateway/placement.py ``route``: the worker and the decision there, from one call of the
policy's ``decide``, over workers of both modes, of one fixed mode each, and of one fixed method
each; method-aware placement's second call where a session moves."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

import policies
from gateway import placement
from gateway.config.config import parse_config
from gateway.fleet.fleet import Fleet
from gateway.fleet.handle import WorkerHandle
from gateway.observe.metrics import GatewayMetrics
from gateway.placement import Placement
from gateway.policy_store import PolicyStore
from gateway.scheduling.framework import Candidate
from gateway.sessions.table import Session, SessionTable
from gateway.state import GatewayState
from policies import Decision, Mode, SessionState
from workers.api.request_parser import parse_request
from workers.api.wire import CompletionRequest

REPO = Path(__file__).resolve().parents[2]
LATCHED = SessionState(acceptance_estimate=0.2, acceptance_weight=40.0, proposals_seen=40, low_acceptance=True)


def worker(worker_id: str, modes: set[Mode], max_k: int) -> WorkerHandle:
    """A ready remote worker; route reads its modes, K and load, never its connections."""
    return WorkerHandle(worker_id, "http://127.0.0.1:9", cast(Any, None), cast(Any, None), frozenset(modes), max_k,
                        remote=True, protocol="openai", status="ready")


def route(state: GatewayState, session: Session, candidates: list[Candidate], req: CompletionRequest,
          policy: policies.PolicyConfig) -> Placement | None:
    """``placement.route`` behind the pipeline that ``policy``'s route_* keys describe."""
    state.routing.install(None, policy)
    return placement.route(state.routing.pipeline, state.fleet.workers, session, candidates, req, policy)


def gateway_state(*handles: WorkerHandle) -> GatewayState:
    # The fleet's workers are set below, not started: the config names one remote so it parses.
    config = parse_config({"workers": {"count": 0, "remote": [{"url": "http://127.0.0.1:9", "name": "unused"}]}},
                          REPO)
    metrics = GatewayMetrics.create(config.model.name)
    fleet = Fleet(config, metrics, lambda _: None)
    fleet.workers.update({h.worker_id: h for h in handles})
    return GatewayState(config, metrics, SessionTable(config.sessions), PolicyStore(config.policy, None, metrics),
                        fleet)


def both() -> WorkerHandle:
    return worker("both", {"speculative", "plain"}, 4)


def plain() -> WorkerHandle:
    return worker("plain", {"plain"}, 0)


def spec() -> WorkerHandle:
    return worker("spec", {"speculative"}, 3)


@pytest.mark.parametrize(("workers", "sticky", "temperature", "session_state", "expected"), [
    ([both], None, 0.0, SessionState(), ("both", "speculative; k=4; reason=default")),
    # One fixed mode each: the request goes where the mode the rules want runs, for their reason.
    ([plain, spec], None, 0.0, SessionState(), ("spec", "speculative; k=3; reason=default")),
    ([plain, spec], None, 1.0, SessionState(), ("plain", "plain; reason=high_temperature")),
    ([plain, spec], "spec", 1.0, SessionState(), ("plain", "plain; reason=high_temperature")),
    ([plain, spec], "plain", 0.0, SessionState(), ("spec", "speculative; k=3; reason=default")),
    # A session that stays on its plain worker is counted plain for the rules' reason (its probes come).
    ([plain, spec], "plain", 0.0, LATCHED, ("plain", "plain; reason=low_acceptance")),
    # No worker serves the wanted mode: the fixed mode's reason says what runs.
    ([plain], None, 0.0, SessionState(), ("plain", "plain; reason=worker_plain_only")),
    ([spec], None, 1.0, SessionState(), ("spec", "speculative; k=3; reason=worker_speculative_only")),
])
def test_route_decides_once(monkeypatch: pytest.MonkeyPatch, workers: list[Any], sticky: str | None,
                            temperature: float, session_state: SessionState, expected: tuple[str, str]) -> None:
    calls: list[Decision] = []

    def counted(*args: Any) -> Decision:
        calls.append(policies.decide(*args))
        return calls[-1]

    monkeypatch.setattr(placement, "decide", counted)
    state = gateway_state(*(make() for make in workers))
    session = state.sessions.touch("s", 0.0)
    session.worker_id, session.policy_state = sticky, session_state
    req = parse_request("completion", {"model": state.config.model.name, "prompt": "x", "temperature": temperature})
    routed = route(state, session, state.fleet.candidates(), req, state.policy.active)
    assert routed is not None
    handle, decision = routed.handle, routed.decision
    assert (handle.worker_id, decision.header) == expected
    assert len(calls) == 1


def test_route_finds_no_worker_when_none_is_ready() -> None:
    down = plain()
    down.status = "unhealthy"
    state = gateway_state(down)
    session = state.sessions.touch("s", 0.0)
    req = parse_request("completion", {"model": state.config.model.name, "prompt": "x"})
    assert route(state, session, state.fleet.candidates(), req, state.policy.active) is None


@pytest.mark.parametrize(("margin", "b_drafts", "b_lookups", "expected_worker", "expected_route", "decides"), [
    (2, 0, 2, "b", "method", 2),  # a's batch drafts, b's looks up: moves, decided again on b
    (2, 0, 0, "b", "method", 2),  # an idle worker agrees more than a drafting one
    (2, 1, 0, "a", "sticky", 1),  # -1 is not 2 better than -2: stays, with the decision made on a
    (0, 0, 2, "a", "sticky", 1),  # off: as before
])
def test_a_session_whose_method_is_lookup_moves_to_a_batch_that_looks_up(
        monkeypatch: pytest.MonkeyPatch, margin: int, b_drafts: int, b_lookups: int, expected_worker: str,
        expected_route: str, decides: int) -> None:
    calls: list[str] = []
    ngram = Decision("speculative", 4, "default", method="ngram")

    def deciding(session: SessionState, worker: Any, facts: Any, policy: Any) -> Decision:
        calls.append("decide")
        return ngram

    monkeypatch.setattr(placement, "decide", deciding)
    a, b = worker("a", {"speculative", "plain"}, 4), worker("b", {"speculative", "plain"}, 4)
    for _ in range(2):
        a.draft_mix.add(Decision("speculative", 4, "default", method="draft"))  # in flight there
    for _ in range(b_lookups):
        b.draft_mix.add(ngram)
    for _ in range(b_drafts):
        b.draft_mix.add(Decision("speculative", 4, "default", method="draft"))
    state = gateway_state(a, b)
    session = state.sessions.touch("s", 0.0)
    session.worker_id, session.last_decision = "a", Decision("speculative", 4, "default", method="draft")
    policy = policies.PolicyConfig(methods=("draft", "ngram"), route_method_margin=margin)
    req = parse_request("completion", {"model": state.config.model.name, "prompt": "x", "temperature": 0.0})
    routed = route(state, session, state.fleet.candidates(), req, policy)
    assert routed is not None
    assert (routed.handle.worker_id, routed.route, routed.decision) == (expected_worker, expected_route, ngram)
    assert len(calls) == decides


@pytest.mark.parametrize(("wanted", "expected_worker", "expected_route", "expected_k"), [
    (Decision("speculative", 6, "default", method="ngram"), "ngram-server", "method", 3),  # K cut to its 3
    (Decision("speculative", 4, "default", method="draft"), "draft-server", "sticky", 4),
    (Decision("plain", 0, "high_temperature"), "draft-server", "sticky", 0),
])
def test_servers_of_one_method_each_take_the_sessions_that_want_it(
        monkeypatch: pytest.MonkeyPatch, wanted: Decision, expected_worker: str, expected_route: str,
        expected_k: int) -> None:
    asked: list[tuple[str, ...]] = []

    def deciding(session: SessionState, worker: Any, facts: Any, policy: Any) -> Decision:
        asked.append(worker.methods)
        return wanted

    monkeypatch.setattr(placement, "decide", deciding)
    draft_server, ngram_server = worker("draft-server", {"speculative", "plain"}, 4), worker(
        "ngram-server", {"speculative", "plain"}, 3)
    draft_server.methods, ngram_server.methods = ("draft",), ("ngram",)
    state = gateway_state(draft_server, ngram_server)
    session = state.sessions.touch("s", 0.0)
    session.worker_id = "draft-server"
    req = parse_request("completion", {"model": state.config.model.name, "prompt": "x"})
    routed = route(state, session, state.fleet.candidates(), req, policies.PolicyConfig(
        methods=("draft", "ngram")))
    assert routed is not None
    assert (routed.handle.worker_id, routed.route, routed.decision.k) == (expected_worker, expected_route, expected_k)
    assert asked == [("draft", "ngram")]  # asked once, as if the draft server offered both


def test_a_worker_that_keeps_no_prompt_kv_gets_no_session_by_prefix() -> None:
    from gateway.scheduling.plugins.prefix_index import prompt_blocks

    kept, none = worker("kept", {"speculative", "plain"}, 4), worker("none", {"speculative", "plain"}, 4)
    state = gateway_state(none, kept)
    req = parse_request("completion", {"model": state.config.model.name, "prompt": "You are terse. " * 40})
    blocks = prompt_blocks(req)
    policy = policies.PolicyConfig()
    for handle in (none, kept):
        index = state.routing.prefix_index()
        assert index is not None
        index.record(handle.worker_id, blocks, policy.route_index_blocks)
    # Both hold the prompt in the index: the first listed wins the tie...
    routed = route(state, state.sessions.touch("a", 0.0), state.fleet.candidates(), req, policy)
    assert routed is not None and (routed.handle.worker_id, routed.route) == ("none", "prefix")
    # ...until it says it keeps nothing: then only the other one's hit counts.
    none.prefix_cache, kept.prefix_cache = False, True
    routed = route(state, state.sessions.touch("b", 0.0), state.fleet.candidates(), req, policy)
    assert routed is not None and (routed.handle.worker_id, routed.route) == ("kept", "prefix")
    assert routed.prefix_share == 1.0


def test_a_server_of_the_wanted_method_beyond_the_load_bound_takes_no_more(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, ...]] = []

    def deciding(session: SessionState, worker: Any, facts: Any, policy: Any) -> Decision:
        asked.append(worker.methods)  # ngram wherever it is offered, else the draft
        return Decision("speculative", 4, "default", method="ngram" if "ngram" in worker.methods else "draft")

    monkeypatch.setattr(placement, "decide", deciding)
    servers = [worker(name, {"speculative", "plain"}, 4) for name in ("draft-a", "draft-b", "ngram-server")]
    servers[0].methods = servers[1].methods = ("draft",)
    servers[2].methods = ("ngram",)
    state = gateway_state(*servers)
    session = state.sessions.touch("s", 0.0)
    session.worker_id = "draft-a"
    req = parse_request("completion", {"model": state.config.model.name, "prompt": "x"})
    policy = policies.PolicyConfig(methods=("draft", "ngram"))
    # Loads 0, 0 and L (other clients' requests on the ngram server): the bound is
    # 2 x (L + 1) / 3 + 2, which L + 1 keeps within up to L = 5.
    for load, expected in ((5, ("ngram-server", "method", "ngram")), (6, ("draft-a", "sticky", "draft"))):
        servers[2].reported_depth = load
        asked.clear()
        routed = route(state, session, state.fleet.candidates(), req, policy)
        assert routed is not None
        assert (routed.handle.worker_id, routed.route, routed.decision.method) == expected, load
        # Asked as if the draft server offered both; past the bound, asked again on what it offers.
        assert asked == [("draft", "ngram")] + ([("draft",)] if load == 6 else [])


def llama_server(worker_id: str, method: str) -> WorkerHandle:
    """A ready llama-server of one mode and one method (protocol: llamacpp)."""
    handle = worker(worker_id, {"plain"} if method == "none" else {"speculative"}, 0 if method == "none" else 48)
    handle.protocol = "llamacpp"
    handle.methods = () if method == "none" else ("ngram",)
    return handle


STAYS_PLAIN = "plain; reason=worker_plain_only"


@pytest.mark.parametrize(("sticky", "wanted", "expected"), [
    # A placed session stays where the rules want the other server, until the move pays (below):
    # it runs what its server runs.
    ("plain", Decision("speculative", 8, "default", method="ngram"), ("plain", "sticky", STAYS_PLAIN)),
    ("ngram", Decision("plain", 0, "no_gain", method="ngram"),
     ("ngram", "sticky", "speculative; method=ngram; k=48; reason=worker_speculative_only")),
    # Trials run where the session is.
    ("plain", Decision("speculative", 8, "explore", method="ngram"), ("plain", "sticky", STAYS_PLAIN)),
    ("plain", Decision("speculative", 8, "probe", method="ngram"), ("plain", "sticky", STAYS_PLAIN)),
    # A new session goes where the rules want it at once (it leaves no cache behind)...
    (None, Decision("plain", 0, "high_temperature"), ("plain", "load", "plain; reason=high_temperature")),
    (None, Decision("speculative", 8, "default", method="ngram"),
     ("ngram", "method", "speculative; method=ngram; k=48; reason=default")),
    # ...and tries a method on a server no session ran it on yet (no busier): its price is unknown.
    (None, Decision("speculative", 8, "explore", method="ngram"),
     ("ngram", "method", "speculative; method=ngram; k=48; reason=explore")),
    # Staying: the route's own reason.
    ("ngram", Decision("speculative", 8, "default", method="ngram"),
     ("ngram", "sticky", "speculative; method=ngram; k=48; reason=default")),
])
def test_llama_servers_of_one_mode_and_method_each_take_the_sessions_that_want_them(
        monkeypatch: pytest.MonkeyPatch, sticky: str | None, wanted: Decision, expected: tuple[str, str, str]) -> None:
    asked: list[tuple[tuple[str, ...], bool]] = []

    def deciding(session: SessionState, worker: Any, facts: Any, policy: Any) -> Decision:
        asked.append((worker.methods, worker.serves_plain))
        return wanted

    monkeypatch.setattr(placement, "decide", deciding)
    state = gateway_state(llama_server("plain", "none"), llama_server("ngram", "ngram"))
    session = state.sessions.touch("s", 0.0)
    session.worker_id, session.context_tokens = sticky, 300
    req = parse_request("completion", {"model": state.config.model.name, "prompt": "x"})
    routed = route(state, session, state.fleet.candidates(), req,
                             policies.PolicyConfig(methods=("draft", "ngram")))
    assert routed is not None
    assert (routed.handle.worker_id, routed.route, routed.decision.header) == expected
    assert asked == [(("ngram",), True)]  # once, on the n-gram server as if it served plain


@pytest.mark.parametrize(("context_tokens", "max_tokens", "moves"), [
    (100, 128, True),  # 128 x 20 ms x (1 - 1/2) = 1280 ms saved > 100 x 5 ms computed again
    (600, 128, False),  # 3000 ms to compute the conversation again: it stays
    (400, None, True),  # no max_tokens: priced at 256 tokens, 2560 ms saved > 2000
])
def test_a_placed_session_moves_where_the_move_pays_for_itself(
        monkeypatch: pytest.MonkeyPatch, context_tokens: int, max_tokens: int | None, moves: bool) -> None:
    monkeypatch.setattr(placement, "decide", lambda *_: Decision("speculative", 8, "default", method="ngram"))
    monkeypatch.setattr(placement, "_server_value", lambda session, handle, policy: 2.0 if handle.methods else 1.0)
    plain_server, ngram_server = llama_server("plain", "none"), llama_server("ngram", "ngram")
    for _ in range(8):
        plain_server.step_costs.observe(0, 20.0)
    ngram_server.step_costs.observe_prefill(100, 500.0)  # 5 ms a prompt token
    state = gateway_state(plain_server, ngram_server)
    session = state.sessions.touch("s", 0.0)
    session.worker_id, session.context_tokens = "plain", context_tokens
    body: dict[str, Any] = {"model": state.config.model.name, "prompt": "x"}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    routed = route(state, session, state.fleet.candidates(), parse_request("completion", body),
                             policies.PolicyConfig(methods=("draft", "ngram")))
    assert routed is not None
    assert (routed.handle.worker_id, routed.route) == (("ngram", "method") if moves else ("plain", "sticky"))


def test_a_new_session_tries_a_method_where_the_load_put_it_once_the_method_has_a_price(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement, "decide", lambda *_: Decision("speculative", 8, "explore", method="ngram"))
    plain_server, ngram_server = llama_server("plain", "none"), llama_server("ngram", "ngram")
    ngram_server.acceptance = policies.observe_lookup(ngram_server.acceptance, "ngram", [(4, 2)],
                                                      policies.PolicyConfig())
    state = gateway_state(plain_server, ngram_server)
    req = parse_request("completion", {"model": state.config.model.name, "prompt": "x"})
    routed = route(state, state.sessions.touch("s", 0.0), state.fleet.candidates(), req,
                             policies.PolicyConfig(methods=("draft", "ngram")))
    assert routed is not None and (routed.handle.worker_id, routed.route) == ("plain", "load")
    # ...and on a server no session has run it on, only when that one is no busier.
    state = gateway_state(llama_server("plain", "none"), busy := llama_server("ngram", "ngram"))
    busy.draft_mix.add(Decision("speculative", 8, "default", method="ngram"))
    routed = route(state, state.sessions.touch("t", 0.0), state.fleet.candidates(), req,
                             policies.PolicyConfig(methods=("draft", "ngram")))
    assert routed is not None and (routed.handle.worker_id, routed.route) == ("plain", "load")


def test_a_llama_server_that_runs_its_method_whatever_the_rules_wanted_is_accounted_by_it() -> None:
    """Where no plain server is ready, a session whose rules want plain still runs the n-gram
    server's method: its decision names it, so its steps are that method's evidence."""
    state = gateway_state(llama_server("ngram", "ngram"))
    session = state.sessions.touch("s", 0.0)
    req = parse_request("completion", {"model": state.config.model.name, "prompt": "x", "temperature": 1.5})
    routed = route(state, session, state.fleet.candidates(), req,
                             policies.PolicyConfig(methods=("draft", "ngram")))
    assert routed is not None
    assert routed.decision.header == "speculative; method=ngram; k=48; reason=worker_speculative_only"
