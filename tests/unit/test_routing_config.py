"""The ``routing:`` section (gateway/scheduling/config.py): the Inference Gateway's shape, every
field checked and named, the old ``policy.route_*`` keys building the same pipeline, plugins
keeping their state across a rebuild, and a scorer written here changing placements by its weight."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config.config import ConfigError, load_config, parse_config
from gateway.fleet.routing import choose_route
from gateway.scheduling.config import (
    POLICY_KEY_HOMES,
    ROUTE_KEYS,
    build,
    parse_routing,
    policy_key_mapping,
    routing_from_policy,
)
from gateway.scheduling.framework import Candidate, Cycle, RequestFeatures, Scorer
from gateway.scheduling.plugins.prefix_cache_scorer import PrefixCacheScorer
from gateway.scheduling.registry import PLUGIN_TYPES
from policies import FieldError, Mode, PolicyConfig

REPO = Path(__file__).resolve().parents[2]
BOTH: frozenset[Mode] = frozenset({"speculative", "plain"})


def default_section() -> dict[str, Any]:
    return routing_from_policy(PolicyConfig()).as_dict()


def fleet(*loads: int) -> list[Candidate]:
    return [Candidate(f"worker-{i}", True, load, BOTH) for i, load in enumerate(loads)]


def test_config_yaml_routing_section_is_the_default_pipeline() -> None:
    config = load_config(REPO / "config.yaml")
    assert config.routing == routing_from_policy(PolicyConfig())
    assert parse_routing(default_section()) == config.routing


def test_every_old_key_has_a_home_and_says_it() -> None:
    assert set(POLICY_KEY_HOMES) == set(ROUTE_KEYS)
    policy = PolicyConfig(route_prefix_weight=4.0, route_min_prefix_hit=0.2, route_index_blocks=99)
    lines = dict(zip(ROUTE_KEYS, policy_key_mapping(policy), strict=True))
    assert lines["route_prefix_weight"] == ("policy.route_prefix_weight: 4.0 -> routing.schedulingProfiles[default]"
                                            ".plugins[prefix-cache-scorer].weight: 4.0")
    assert lines["route_index_blocks"].endswith("plugins[prefix-cache-scorer].parameters.lruCapacityPerServer: 99")
    described = routing_from_policy(policy).as_dict()
    minimum = next(p for p in described["plugins"] if p["type"] == "min-prefix-hit")
    assert minimum["parameters"] == {"minHit": 0.2}


def refused(section: Any) -> list[str]:
    with pytest.raises(FieldError) as info:
        parse_routing(section)
    return [str(problem) for problem in info.value.problems]


def with_change(change: Any) -> dict[str, Any]:
    section = copy.deepcopy(default_section())
    change(section)
    return section


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: s["plugins"][0].update(type="ready-filtre"), "routing.plugins[0].type: unknown plugin type; known: "),
    (lambda s: s["schedulingProfiles"][0]["plugins"][6].update(weight=1001), "routing.schedulingProfiles[0].plugins[6]"
     ".weight: must be a number in 0..1000 (got 1001)"),
    (lambda s: s["schedulingProfiles"][0]["plugins"][6].update(weight=-1), ".plugins[6].weight: must be a number"),
    (lambda s: s["schedulingProfiles"][0]["plugins"].append({"pluginRef": "nowhere"}),
     "routing.schedulingProfiles[0].plugins[9].pluginRef: names no plugin; plugins: ready-filter"),
    (lambda s: s["schedulingProfiles"][0]["plugins"][0].update(weight=2), ".plugins[0].weight: only a scorer takes a "
     "weight (ready-filter is a filter)"),
    (lambda s: s["plugins"][5]["parameters"].update(minHit=1.5), "routing.plugins[5].parameters.minHit: must be <= 1"),
    (lambda s: s["plugins"][5]["parameters"].update(minhit=0.2), "routing.plugins[5].parameters.minhit: unknown "
     "parameter; known: minHit"),
    (lambda s: s["plugins"][1]["parameters"].update(factor="2"),
     "routing.plugins[1].parameters.factor: must be a float"),
    (lambda s: s["plugins"][2].update(name="ready-filter"), "routing.plugins[2].name: is the name of another plugin"),
    (lambda s: s["plugins"].pop(), "routing.plugins: needs exactly one profile handler"),
    (lambda s: s["schedulingProfiles"][0]["plugins"].pop(), "routing.schedulingProfiles[0].plugins: needs exactly one "
     "picker"),
    (lambda s: s["schedulingProfiles"].append({"name": "second", "plugins": [{"pluginRef": "max-score-picker"}]}),
     "routing.schedulingProfiles: single-profile-handler runs one profile: list one"),
    (lambda s: s.update(profiles=[]), "routing.profiles: unknown field; known: plugins, schedulingProfiles"),
])
def test_a_bad_section_is_refused_naming_the_field(change: Any, message: str) -> None:
    problems = refused(with_change(change))
    assert any(message in problem for problem in problems), problems


def test_every_problem_is_reported_at_once() -> None:
    def break_three(s: dict[str, Any]) -> None:
        s["plugins"][0]["type"] = "nope"
        s["plugins"][5]["parameters"]["minHit"] = 7
        s["schedulingProfiles"][0]["plugins"][7]["weight"] = "heavy"
    assert len(refused(with_change(break_three))) >= 3


def test_route_keys_beside_a_routing_section_are_refused() -> None:
    raw = {"policy": {"route_prefix_weight": 5.0}, "routing": default_section()}
    with pytest.raises(ConfigError, match=r"policy.route_prefix_weight: is set by the routing section"):
        parse_config(raw, REPO)
    assert parse_config({"policy": {"route_prefix_weight": 5.0}}, REPO).routing is None  # the old way still loads


def test_a_rebuild_keeps_each_plugins_state_where_name_and_type_stay() -> None:
    old = build(routing_from_policy(PolicyConfig()))
    scorer = old.plugins["prefix-cache-scorer"]
    assert isinstance(scorer, PrefixCacheScorer)
    scorer.index.record("worker-0", (1, 2, 3), 100)
    new = build(routing_from_policy(PolicyConfig(route_prefix_weight=1.0, route_index_blocks=10)), previous=old)
    kept = new.plugins["prefix-cache-scorer"]
    assert kept is scorer and kept.index.sizes() == {"worker-0": 3}
    assert isinstance(kept, PrefixCacheScorer) and kept.lruCapacityPerServer == 10
    renamed = with_change(lambda s: s["plugins"][6].update(name="prefix"))
    renamed["schedulingProfiles"][0]["plugins"][6]["pluginRef"] = "prefix"
    fresh = build(parse_routing(renamed), previous=new)
    assert fresh.plugins["prefix"] is not scorer  # another plugin: its own, empty index


class PreferWorker(Scorer):
    """A scorer written here: 1 for worker-1, 0 elsewhere."""

    type_name = "prefer-worker-scorer"

    def score(self, cycle: Cycle, endpoints: list[Candidate]) -> list[float]:
        return [1.0 if c.worker_id == "worker-1" else 0.0 for c in endpoints]


def preferring(weight: float) -> dict[str, Any]:
    section = default_section()
    section["plugins"].insert(0, {"type": "prefer-worker-scorer", "name": "prefer"})
    section["schedulingProfiles"][0]["plugins"].insert(0, {"pluginRef": "prefer", "weight": weight})
    for plugin in section["plugins"]:
        if plugin["type"] == "min-prefix-hit":
            plugin["parameters"]["minHit"] = 0.0  # below the minimum hit, load alone places: no scorer counts
    return section


@pytest.mark.parametrize(("weight", "loads", "placed"), [
    (0.0, (0, 1, 0), "worker-0"),  # off: the least loaded, as without it
    (1.0, (0, 1, 0), "worker-0"),  # worker-1: 1 + load's 2 x (1 - 1/1) < worker-0's 2
    (2.5, (0, 1, 0), "worker-1"),
    (0.4, (1, 2, 4), "worker-0"),  # 0.4 + 2 x (1 - 2/4) < 2 x (1 - 1/4)
    (0.6, (1, 2, 4), "worker-1"),
])
def test_a_scorer_written_in_a_test_places_by_its_weight(weight: float, loads: tuple[int, ...], placed: str) -> None:
    types = {**PLUGIN_TYPES, PreferWorker.type_name: PreferWorker}
    pipeline = build(parse_routing(yaml.safe_load(yaml.safe_dump(preferring(weight))), types), types)
    result = pipeline.place(RequestFeatures(None), fleet(*loads))
    assert result is not None and result.route.worker_id == placed
    # A session already placed stays: stickiness is an ordered rule, never outweighed.
    sticky = pipeline.place(RequestFeatures("worker-2"), fleet(*loads))
    assert sticky is not None and (sticky.route.worker_id, sticky.route.reason) == ("worker-2", "sticky")


def test_the_type_must_be_known_to_the_parser() -> None:
    assert any("unknown plugin type" in p for p in refused(preferring(1.0)))


def test_the_default_pipeline_is_the_route_rules() -> None:
    """The routing table's tests (test_gateway_units.py) run through ``choose_route``; here the
    pipeline built from config.yaml's section places as that façade does, on a sweep of fleets."""
    pipeline = build(load_config(REPO / "config.yaml").routing or routing_from_policy(PolicyConfig()))
    for loads in ((0, 0, 0), (3, 0, 1), (9, 0, 0), (2, 2, 7), (0, 12, 3)):
        for current in (None, "worker-0", "worker-2"):
            for hits in ({}, {"worker-1": 0.5}, {"worker-2": 0.05}):
                placed = pipeline.place(RequestFeatures(current), fleet(*loads), hits)
                assert placed is not None and placed.route == choose_route(current, fleet(*loads), hits)


def test_specgate_check_says_what_each_old_key_becomes(tmp_path: Path) -> None:
    from gateway.cli import route_key_notes

    path = tmp_path / "config.yaml"
    path.write_text("policy:\n  route_prefix_weight: 4.0\n  route_balance_abs: 6\n")
    assert route_key_notes(path) == [
        "policy.route_prefix_weight: 4.0 -> routing.schedulingProfiles[default].plugins[prefix-cache-scorer].weight: "
        "4.0 (the old key still loads)",
        "policy.route_balance_abs: 6 -> routing.plugins[load-guard].parameters.balanceAbs: 6 (the old key still loads)"]
    assert route_key_notes(REPO / "config.yaml") == []  # a routing: section, no old keys
