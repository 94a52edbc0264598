"""PolicyConfig validation: every bad field is named with its value."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from policies import (
    PolicyConfig,
    PolicyConfigError,
)
from tests.policy_data import below

# --------------------------------------------------------------------------------------------
# PolicyConfig validation


def test_defaults() -> None:
    assert PolicyConfig.from_mapping(None) == PolicyConfig()
    assert PolicyConfig.from_mapping({}) == PolicyConfig()
    assert PolicyConfig().as_dict() == {
        "acceptance_floor": 0.60, "acceptance_resume": 0.70, "min_proposals": 32, "acceptance_half_life": 64.0,
        "acceptance_latch_stderrs": 1.5, "acceptance_prior_drafts": 16.0,
        "max_batch": 64, "batch_resume": 56, "max_temperature": 0.8, "probe_every": 8, "num_speculative_tokens": 6,
        "min_gain": 0.05, "k_switch_gain": 0.05,
        "free_batch": 0, "max_step_drafts": 0,  # off: the thresholds above are the rules
        "tree_shapes": ("2+3", "2x2+2", "3+4", "2x2+4"), "tree_rank_prior": 0.7, "tree_explore_every": 4,
        "tree_switch_gain": 0.05, "methods": ("draft",), "method_explore_every": 2,
        "route_prefix_weight": 3.0, "route_load_weight": 2.0, "route_min_prefix_hit": 0.1, "route_balance_abs": 4,
        "route_balance_rel": 1.5, "route_load_factor": 2.0, "route_load_slack": 2.0, "route_index_blocks": 65536,
        "route_method_margin": 0,
    }


@pytest.mark.parametrize(("raw", "problem"), [
    (["draft", "ngrams"], "unknown method 'ngrams'; known: draft, eagle3, ngram, suffix"),
    ([], "must list at least one method"),
    (["ngram", "ngram"], "lists a method twice"),
    ("ngram", "must be a list of methods"),
    ([1], "must be a list of methods"),
])
def test_bad_methods_are_named(raw: Any, problem: str) -> None:
    with pytest.raises(PolicyConfigError) as info:
        PolicyConfig.from_mapping({"methods": raw})
    assert info.value.field == "methods"
    assert str(info.value).startswith("policy.methods: ") and problem in str(info.value)


def test_methods_keep_their_order() -> None:
    assert PolicyConfig.from_mapping({"methods": ["suffix", "draft"]}).methods == ("suffix", "draft")


def test_ints_are_accepted_for_float_fields() -> None:
    policy = PolicyConfig.from_mapping({"acceptance_floor": 0, "acceptance_resume": 1, "acceptance_half_life": 32,
                                        "max_temperature": 2})
    assert policy == PolicyConfig(acceptance_floor=0.0, acceptance_resume=1.0, acceptance_half_life=32.0,
                                  max_temperature=2.0)
    for name in ("acceptance_floor", "acceptance_resume", "acceptance_half_life", "max_temperature"):
        assert type(getattr(policy, name)) is float


def test_missing_keys_take_defaults_and_as_dict_round_trips() -> None:
    policy = PolicyConfig.from_mapping({"max_batch": 10, "batch_resume": 3})
    assert policy == replace(PolicyConfig(), max_batch=10, batch_resume=3)
    assert PolicyConfig.from_mapping(policy.as_dict()) == policy


@pytest.mark.parametrize("raw", [
    {"acceptance_floor": 0.0, "acceptance_resume": 0.0},
    {"acceptance_floor": 1.0, "acceptance_resume": 1.0},
    {"acceptance_floor": 0.5, "acceptance_resume": 0.5},  # no band: allowed
    {"min_proposals": 0},
    {"acceptance_half_life": 1e-3},
    {"max_batch": 1, "batch_resume": 1},
    {"max_batch": 64, "batch_resume": 64},
    {"max_temperature": 0},
    {"probe_every": 1},
    {"num_speculative_tokens": 1},
    {"num_speculative_tokens": 16},
    {"route_load_factor": 0.0},  # no bound
    {"route_load_factor": 1.0, "route_load_slack": 1.0},
    {"route_method_margin": 2},
])
def test_boundary_values_are_valid(raw: dict[str, Any]) -> None:
    policy = PolicyConfig.from_mapping(raw)
    for key, value in raw.items():
        assert getattr(policy, key) == value


INVALID: list[tuple[dict[str, Any], str, Any]] = [
    # (mapping, field named in the error, bad value)
    ({"acceptance_floor": 1.5}, "acceptance_floor", 1.5),
    ({"acceptance_floor": -0.1}, "acceptance_floor", -0.1),
    ({"acceptance_floor": math.nan}, "acceptance_floor", math.nan),
    ({"acceptance_resume": 1.01}, "acceptance_resume", 1.01),
    ({"acceptance_resume": -1}, "acceptance_resume", -1),
    ({"acceptance_floor": 0.6, "acceptance_resume": 0.5}, "acceptance_resume", 0.5),
    ({"acceptance_resume": below(0.6)}, "acceptance_resume", below(0.6)),  # below the default floor
    ({"min_proposals": -1}, "min_proposals", -1),
    ({"acceptance_half_life": 0}, "acceptance_half_life", 0),
    ({"acceptance_half_life": -64}, "acceptance_half_life", -64),
    ({"acceptance_half_life": math.inf}, "acceptance_half_life", math.inf),
    ({"acceptance_half_life": math.nan}, "acceptance_half_life", math.nan),
    ({"max_batch": 0}, "max_batch", 0),
    ({"max_batch": -5}, "max_batch", -5),
    ({"batch_resume": 0}, "batch_resume", 0),
    ({"batch_resume": 65}, "batch_resume", 65),  # above the default max_batch
    ({"max_batch": 10, "batch_resume": 11}, "batch_resume", 11),
    ({"max_temperature": -0.1}, "max_temperature", -0.1),
    ({"max_temperature": math.inf}, "max_temperature", math.inf),
    ({"max_temperature": math.nan}, "max_temperature", math.nan),
    ({"probe_every": 0}, "probe_every", 0),
    ({"probe_every": -1}, "probe_every", -1),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens", 0),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens", 17),
    ({"route_load_factor": 0.5}, "route_load_factor", 0.5),  # below the mean: the least loaded could be refused
    ({"route_load_factor": math.nan}, "route_load_factor", math.nan),
    ({"route_load_slack": 0.5}, "route_load_slack", 0.5),
    ({"route_load_slack": math.inf}, "route_load_slack", math.inf),
    ({"route_method_margin": -1}, "route_method_margin", -1),
    ({"route_method_margin": 1001}, "route_method_margin", 1001),
    # wrong types
    ({"acceptance_floor": "abc"}, "acceptance_floor", "abc"),
    ({"max_temperature": "0.8"}, "max_temperature", "0.8"),
    ({"acceptance_half_life": True}, "acceptance_half_life", True),
    ({"acceptance_floor": None}, "acceptance_floor", None),
    ({"max_batch": True}, "max_batch", True),
    ({"probe_every": False}, "probe_every", False),
    ({"max_batch": 2.5}, "max_batch", 2.5),
    ({"num_speculative_tokens": 4.0}, "num_speculative_tokens", 4.0),
    ({"min_proposals": "32"}, "min_proposals", "32"),
    ({"probe_every": [8]}, "probe_every", [8]),
    # unknown keys
    ({"acceptance_flor": 0.5}, "acceptance_flor", 0.5),
    ({"max_batch": 8, "batch_resume": 4, "temperature": 1.0}, "temperature", 1.0),
]


@pytest.mark.parametrize(("raw", "field", "value"), INVALID)
def test_invalid_fields_are_named(raw: dict[str, Any], field: str, value: Any) -> None:
    with pytest.raises(PolicyConfigError) as info:
        PolicyConfig.from_mapping(raw)
    message = str(info.value)
    assert info.value.field == field
    assert message.startswith(f"policy.{field}: ")
    assert repr(value) in message
    if not (isinstance(value, float) and math.isnan(value)):
        assert info.value.value == value
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(("field", "value"), [
    ("acceptance_floor", 1.5),
    ("acceptance_half_life", 0.0),
    ("max_batch", 0),
    ("batch_resume", 100),
    ("probe_every", 0),
    ("num_speculative_tokens", 17),
])
def test_the_constructor_validates_too(field: str, value: Any) -> None:
    with pytest.raises(PolicyConfigError, match=rf"^policy\.{field}: .*\(got {value!r}\)$"):
        PolicyConfig(**{field: value})


@pytest.mark.parametrize("raw", [[1, 2], "acceptance_floor: 0.5", 3])
def test_the_section_must_be_a_mapping(raw: Any) -> None:
    with pytest.raises(PolicyConfigError) as info:
        PolicyConfig.from_mapping(raw)
    assert info.value.field == "(section)"
    assert repr(raw) in str(info.value)


def test_huge_int_for_a_float_field_is_a_policy_error() -> None:
    with pytest.raises(PolicyConfigError, match=r"^policy\.acceptance_half_life: "):
        PolicyConfig.from_mapping({"acceptance_half_life": 10**400})


def test_validation_is_pure() -> None:
    """A rejected mapping leaves nothing behind; the same valid mapping always gives equal configs."""
    raw: dict[str, Any] = {"max_batch": 8, "batch_resume": 4}
    copy = dict(raw)
    assert PolicyConfig.from_mapping(raw) == PolicyConfig.from_mapping(raw)
    assert raw == copy
    bad: dict[str, Any] = {"max_batch": 0}
    for _ in range(2):
        with pytest.raises(PolicyConfigError):
            PolicyConfig.from_mapping(bad)
    assert bad == {"max_batch": 0}


# --------------------------------------------------------------------------------------------
# Every problem at once


def test_every_bad_field_is_reported_first_one_as_the_message() -> None:
    raw = {"max_batch": "x", "probe_every": 0, "temperature": 1.0, "acceptance_floor": 0.9,
           "acceptance_resume": 0.8, "num_speculative_tokens": 99}
    with pytest.raises(PolicyConfigError) as info:
        PolicyConfig.from_mapping(raw)
    error = info.value
    assert str(error) == "policy.max_batch: must be an integer (got 'x')" and error.field == "max_batch"
    assert [(p.field, p.value) for p in error.problems] == [
        ("max_batch", "x"), ("temperature", 1.0), ("acceptance_resume", 0.8), ("probe_every", 0),
        ("num_speculative_tokens", 99)]
    assert all(p.problems == (p,) for p in error.problems[1:])
    assert error.summary() == "; ".join(str(p) for p in error.problems)


@pytest.mark.parametrize(("raw", "fields"), [
    # A rule comparing two fields is not blamed on the second when the first is the bad one.
    ({"acceptance_floor": 1.5}, ["acceptance_floor"]),
    ({"acceptance_floor": "high", "acceptance_resume": 0.1}, ["acceptance_floor"]),
    ({"max_batch": 0, "batch_resume": 56}, ["max_batch"]),
    ({"max_batch": 0, "batch_resume": 0}, ["max_batch", "batch_resume"]),
    ({"max_batch": True, "batch_resume": 100}, ["max_batch"]),
    ({"max_batch": 10, "batch_resume": 11, "min_gain": 2}, ["batch_resume", "min_gain"]),
])
def test_cross_field_rules_do_not_restate_a_bad_field(raw: dict[str, Any], fields: list[str]) -> None:
    with pytest.raises(PolicyConfigError) as info:
        PolicyConfig.from_mapping(raw)
    assert [p.field for p in info.value.problems] == fields


def test_the_summary_of_many_problems_is_bounded() -> None:
    with pytest.raises(PolicyConfigError) as info:
        PolicyConfig.from_mapping({f"k{i}": i for i in range(5000)})
    assert len(info.value.problems) == 5000
    summary = info.value.summary()
    assert summary.endswith("; and 4990 more") and len(summary) < 5000
