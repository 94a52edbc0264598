"""The acceptance estimator's calibration on simulated streams (issue #40's targets).

``bench.estimator_sim`` folds thousands of streams at once through ``policies.acceptance``; the
first test replays its draws through ``observe`` itself, so the figures below are the policy's.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench.estimator_sim import CHECKPOINTS, MAX_K, EstimatorSim
from policies import PolicyConfig, SessionState, observe

POLICY = PolicyConfig()


def test_the_simulation_is_the_policys_own_fold() -> None:
    sim = EstimatorSim(POLICY, 200, seed=1)
    ks = np.random.default_rng(2).integers(1, MAX_K + 1, 200)
    steps: list[tuple[np.ndarray, np.ndarray]] = []
    result = sim.run(0.6, 512, ks=ks, steps=steps)
    for i in range(200):
        session, latched_at = SessionState(), -1
        for accepted, active in steps:
            if not active[i]:
                break
            session = observe(session, int(ks[i]), int(accepted[i]), POLICY)
            if session.low_acceptance:
                latched_at = session.proposals_seen
                break
        assert latched_at == result.latched_at[i], i
    assert (result.latched_at >= 0).any() and (result.latched_at < 0).any()  # both outcomes replayed


@pytest.mark.parametrize("alpha", [0.5, 0.6, 0.7, 0.8, 0.9])
def test_the_mean_estimate_is_within_002_of_the_true_alpha(alpha: float) -> None:
    """After 32 and after 128 tested drafts, for every K from 1 to 8 (the estimate alone, no prior)."""
    for k in range(1, MAX_K + 1):
        result = EstimatorSim(POLICY, 2000, seed=k).run(alpha, max(CHECKPOINTS), ks=np.full(2000, k),
                                                         stop_on_latch=False)
        for checkpoint in CHECKPOINTS:
            assert result.mean_at[checkpoint] == pytest.approx(alpha, abs=0.02), (k, checkpoint)


@pytest.mark.parametrize("alpha", [0.70, 0.75, 0.8, 0.9])
def test_sessions_that_accept_well_are_rarely_latched(alpha: float) -> None:
    """At most 1% of 10,000 sessions of 512 tested drafts (K uniform in 1..8)."""
    result = EstimatorSim(POLICY, 10_000, seed=40).run(alpha, 512)
    assert result.latched_within(512) <= 0.01


@pytest.mark.parametrize("alpha", [0.3, 0.4, 0.45])
def test_sessions_that_accept_poorly_are_caught_within_96_drafts(alpha: float) -> None:
    result = EstimatorSim(POLICY, 10_000, seed=40).run(alpha, 96)
    assert result.latched_within(96) >= 0.95


def test_the_margin_is_what_keeps_alpha_070_sessions_speculating() -> None:
    """The bare estimate compared with the floor latches about a quarter of them (issue #40: 26-29%)."""
    bare = PolicyConfig(acceptance_latch_stderrs=0.0)
    assert EstimatorSim(bare, 10_000, seed=40).run(0.7, 256).latched_within(256) > 0.2
