"""Each routing plugin on its own (gateway/scheduling/plugins/): table-driven, a cycle and the
endpoints in, the endpoints, the settlement or the scores out."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gateway.scheduling.framework import Candidate, Cycle, Plugin, RequestFeatures, Settled, StepKind
from gateway.scheduling.plugins.has_method_filter import HasMethodFilter
from gateway.scheduling.plugins.load_bound_filter import LoadBoundFilter
from gateway.scheduling.plugins.load_guard import LoadGuard
from gateway.scheduling.plugins.load_scorer import LoadScorer
from gateway.scheduling.plugins.max_score_picker import MaxScorePicker
from gateway.scheduling.plugins.method_agreement_scorer import MethodAgreementScorer
from gateway.scheduling.plugins.method_placement import MethodPlacement
from gateway.scheduling.plugins.min_prefix_hit import MinPrefixHit
from gateway.scheduling.plugins.mode_filter import ModeFilter
from gateway.scheduling.plugins.prefix_cache_scorer import PrefixCacheScorer
from gateway.scheduling.plugins.prefix_index import prompt_blocks
from gateway.scheduling.plugins.ready_filter import ReadyFilter
from gateway.scheduling.plugins.session_affinity_scorer import SessionAffinityScorer
from gateway.scheduling.plugins.sticky_placement import StickyPlacement
from workers.api.request_parser import parse_request

BOTH = frozenset({"speculative", "plain"})


def worker(worker_id: str, load: int = 0, *, ready: bool = True, drafting: int = 0, looking: int = 0,
           modes: frozenset[Any] = BOTH, methods: tuple[Any, ...] = ("draft",),
           prefix_cache: bool | None = None) -> Candidate:
    return Candidate(worker_id, ready, load, modes, drafting, looking, methods, prefix_cache)


def cycle(endpoints: list[Candidate], session: str | None = None, kind: StepKind | None = None,
          hits: dict[str, float] | None = None, request: Any = None) -> Cycle:
    ready = tuple(c for c in endpoints if c.ready)
    made = Cycle(RequestFeatures(session, kind, request), ready, max((c.load for c in ready), default=0))
    made.hits.update(hits or {})
    return made


def configured(cls: type[Plugin], **parameters: Any) -> Any:
    plugin = cls(cls.type_name)
    plugin.configure({name: parameters.get(name, spec[1]) for name, spec in cls.parameters.items()})
    return plugin


def ids(endpoints: list[Candidate]) -> list[str]:
    return [c.worker_id for c in endpoints]


def test_ready_filter_keeps_ready_workers() -> None:
    fleet = [worker("a"), worker("b", ready=False), worker("c")]
    assert ids(ReadyFilter("r").filter(cycle(fleet), fleet)) == ["a", "c"]


@pytest.mark.parametrize(("loads", "factor", "slack", "kept", "bound"), [
    ({"a": 0, "b": 0}, 2.0, 2.0, ["a", "b"], 3.0),  # 2 x 1/2 + 2
    ({"a": 0, "b": 6}, 2.0, 2.0, ["a", "b"], 9.0),  # 2 x 7/2 + 2: b's 6 + 1 fits
    ({"a": 0, "b": 0, "c": 10}, 1.0, 1.0, ["a", "b"], 11 / 3 + 1),  # a hotspot at shallow queues
    ({"a": 0, "b": 9}, 0.0, 2.0, ["a", "b"], math.inf),  # factor 0: no bound
    ({"a": 1, "b": 3, "c": 8}, 1.0, 1.0, ["a", "b"], 13 / 3 + 1),
])
def test_load_bound_filter(loads: dict[str, int], factor: float, slack: float, kept: list[str], bound: float) -> None:
    fleet = [worker(w, load) for w, load in loads.items()]
    made = cycle(fleet)
    out = configured(LoadBoundFilter, factor=factor, slack=slack).filter(made, fleet)
    assert made.bound == pytest.approx(bound)
    assert ids(out) == kept  # the least loaded always fits


@pytest.mark.parametrize(("loads", "unbalanced", "hotspots"), [
    ({"a": 0, "b": 4}, False, set()),  # ahead by 4, not more
    ({"a": 0, "b": 5}, True, {"b"}),
    ({"a": 10, "b": 15}, False, set()),  # ahead by 5 but not more than 1.5 x
    ({"a": 2, "b": 9, "c": 9}, True, {"b", "c"}),
    ({"a": 7}, False, set()),  # one worker is never unbalanced
])
def test_load_guard_marks_hotspots_and_load_alone(loads: dict[str, int], unbalanced: bool, hotspots: set[str]) -> None:
    fleet = [worker(w, load) for w, load in loads.items()]
    made = cycle(fleet)
    assert configured(LoadGuard).apply(made, fleet) is None  # it never settles by itself
    assert (made.load_only, set(made.hotspots)) == (unbalanced, hotspots)


@pytest.mark.parametrize(("session", "hotspots", "settled"), [
    ("b", set(), "b"),
    ("b", {"b"}, None),  # the guard's hotspot keeps no session
    ("z", set(), None),  # its worker is not among the endpoints (gone, or over the bound)
    (None, set(), None),  # a new session
])
def test_sticky_placement(session: str | None, hotspots: set[str], settled: str | None) -> None:
    fleet = [worker("a"), worker("b", 3)]
    made = cycle(fleet, session)
    made.hotspots = frozenset(hotspots)
    result = StickyPlacement("s").apply(made, fleet)
    assert (None if result is None else (result.endpoint.worker_id, result.reason)) == (
        None if settled is None else (settled, "sticky"))


@pytest.mark.parametrize(("margin", "kind", "fleet", "moved"), [
    (0, "draft", [worker("a", 2, looking=2), worker("b", 2, drafting=2)], None),  # off
    (2, None, [worker("a", 2, looking=2), worker("b", 2, drafting=2)], None),  # kind unknown
    (2, "draft", [worker("a", 2, looking=2), worker("b", 2, drafting=2)], "b"),  # -2 -> +2
    (5, "draft", [worker("a", 2, looking=2), worker("b", 2, drafting=2)], None),  # not by 5
    (2, "draft", [worker("a", 2, drafting=2), worker("b", 2, drafting=4)], None),  # nothing disagrees at a
    (1, "lookup", [worker("a", 2, drafting=1), worker("b", 1, looking=1), worker("c", 1, looking=1)], "b"),
])
def test_method_placement(margin: int, kind: StepKind | None, fleet: list[Candidate], moved: str | None) -> None:
    result = configured(MethodPlacement, margin=margin).apply(cycle(fleet, "a", kind), fleet)
    assert (None if result is None else (result.endpoint.worker_id, result.reason)) == (
        None if moved is None else (moved, "method"))


@pytest.mark.parametrize(("hits", "minimum", "load_only"), [
    ({}, 0.1, True), ({"a": 0.05}, 0.1, True), ({"b": 0.1}, 0.1, False), ({}, 0.0, False)])
def test_min_prefix_hit(hits: dict[str, float], minimum: float, load_only: bool) -> None:
    fleet = [worker("a"), worker("b")]
    made = cycle(fleet, hits=hits)
    assert configured(MinPrefixHit, minHit=minimum).apply(made, fleet) is None
    assert made.load_only is load_only


def test_load_scorer_scores_spare_load() -> None:
    fleet = [worker("a", 0), worker("b", 2), worker("c", 4)]
    assert LoadScorer("l").score(cycle(fleet), fleet) == [1.0, 0.5, 0.0]
    idle = [worker("a"), worker("b")]
    assert LoadScorer("l").score(cycle(idle), idle) == [1.0, 1.0]


def test_session_affinity_scorer() -> None:
    fleet = [worker("a"), worker("b")]
    assert SessionAffinityScorer("s").score(cycle(fleet, "b"), fleet) == [0.0, 1.0]
    assert SessionAffinityScorer("s").score(cycle(fleet), fleet) == [0.0, 0.0]


def test_method_agreement_scorer_scales_to_the_unit_interval() -> None:
    fleet = [worker("a", drafting=3), worker("b", looking=1), worker("c", drafting=1, looking=1)]
    assert MethodAgreementScorer("m").score(cycle(fleet, kind="draft"), fleet) == [1.0, 0.0, 0.25]
    assert MethodAgreementScorer("m").score(cycle(fleet, kind="lookup"), fleet) == [0.0, 1.0, 0.75]
    assert MethodAgreementScorer("m").score(cycle(fleet), fleet) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(("scores", "hits", "picked"), [
    ([0.5, 0.9, 0.9], {}, ("b", "load")),  # ties go to the first listed
    ([0.5, 0.9, 0.1], {"b": 0.3}, ("b", "prefix")),
    ([1.0, 0.2, 0.1], {"b": 0.3}, ("a", "load")),
])
def test_max_score_picker(scores: list[float], hits: dict[str, float], picked: tuple[str, str]) -> None:
    fleet = [worker("a"), worker("b"), worker("c")]
    settled = MaxScorePicker("p").pick(cycle(fleet, hits=hits), fleet, scores)
    assert (settled.endpoint.worker_id, settled.reason) == picked


def test_mode_and_method_filters() -> None:
    fleet = [worker("a", modes=frozenset({"plain"})), worker("b", methods=("draft", "eagle3")),
             worker("c", modes=frozenset({"speculative"}), methods=("ngram",))]
    assert ids(configured(ModeFilter, mode="plain").filter(cycle(fleet), fleet)) == ["a", "b"]
    assert ids(configured(ModeFilter, mode="speculative").filter(cycle(fleet), fleet)) == ["b", "c"]
    assert ids(configured(HasMethodFilter, method="eagle3").filter(cycle(fleet), fleet)) == ["b"]
    assert ids(configured(HasMethodFilter, method="ngram").filter(cycle(fleet), fleet)) == ["c"]


def test_the_prefix_scorer_owns_its_index_through_its_request_and_response_steps() -> None:
    scorer = configured(PrefixCacheScorer)
    req = parse_request("completion", {"model": "m", "prompt": "You are terse. " * 40})
    fleet = [worker("a"), worker("b"), worker("c", prefix_cache=False)]
    first = cycle(fleet, request=req)
    scorer.pre_cycle(first)
    assert first.blocks == prompt_blocks(req) and first.hits == {} and scorer.score(first, fleet) == [0, 0, 0]
    for worker_id in ("b", "c"):
        scorer.pre_request(first, worker_id)  # the placement's pre-request step records it
    again = cycle(fleet, request=req)
    scorer.pre_cycle(again)
    # c was sent it too, but says it keeps no prompt K/V: no hit there.
    assert again.shares == {"b": 1.0, "c": 1.0} and again.hits == {"b": 1.0}
    assert scorer.score(again, fleet) == [0.0, 1.0, 0.0]
    # b reports serving none of what the index expected, again and again: its hold, and its hits, fall.
    for _ in range(20):
        scorer.post_response("b", 1.0, 600, 0)
    later = cycle(fleet, request=req)
    scorer.pre_cycle(later)
    assert later.hits["b"] < 0.2
    scorer.forget("b")  # it left the fleet
    gone = cycle(fleet, request=req)
    scorer.pre_cycle(gone)
    assert "b" not in gone.shares
    # Another tenant's same prompt has other blocks: never placed by this one's prefix.
    other = parse_request("completion", {"model": "m", "prompt": "You are terse. " * 40, "cache_salt": "t2"})
    salted = cycle(fleet, request=other)
    scorer.pre_cycle(salted)
    assert salted.shares == {}


def test_the_prefix_scorer_is_off_at_zero_capacity() -> None:
    scorer = configured(PrefixCacheScorer, lruCapacityPerServer=0)
    req = parse_request("completion", {"model": "m", "prompt": "x" * 1000})
    made = cycle([worker("a")], request=req)
    scorer.pre_cycle(made)
    scorer.pre_request(made, "a")
    assert made.blocks == () and scorer.index.sizes() == {}


def test_a_settlement_names_its_reason() -> None:
    assert Settled(worker("a"), "sticky").reason == "sticky"
