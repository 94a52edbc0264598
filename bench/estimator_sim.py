"""Simulated acceptance streams folded through the policy's own estimator, thousands at once.

``EstimatorSim`` draws each step of each stream from the truncated geometric (with K drafts, n < K
accepted with probability αⁿ(1−α), all K with α^K) and folds it with ``policies.acceptance`` (the
functions ``policies.speculation.observe`` calls, here on numpy arrays), tripping the latch as
``acceptance_latch`` does. tests/unit/test_acceptance_calibration.py replays its draws through
``observe`` itself, and holds the issue's calibration targets; ``bench.estimator`` prints the tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from policies import PolicyConfig
from policies.acceptance import below_floor, decayed_fold

CALIBRATION_ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9)
LATCH_ALPHAS = (0.3, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.9)
CHECKPOINTS = (32, 128)  # tested drafts after which the mean estimate is read
MAX_K = 8


@dataclass
class SimResult:
    alpha: float
    mean_at: dict[int, float]  # checkpoint -> mean estimate there (over the streams that reached it)
    latched_at: np.ndarray  # tested drafts when the latch tripped; -1: never

    def latched_within(self, drafts: int) -> float:
        return float(np.mean((self.latched_at >= 0) & (self.latched_at <= drafts)))

    def median_delay(self) -> float | None:
        hit = self.latched_at[self.latched_at >= 0]
        return float(np.median(hit)) if hit.size else None


class EstimatorSim:
    """``sessions`` streams of one α, folded step by step as ``policies.speculation.observe`` does
    (the estimate and the latch's trip; a latched stream stops, as a latched session decodes plain)."""

    def __init__(self, policy: PolicyConfig, sessions: int, seed: int) -> None:
        self.policy, self.sessions = policy, sessions
        self.rng = np.random.default_rng(seed)

    def draw(self, alpha: float, ks: np.ndarray) -> np.ndarray:
        """Drafts accepted per stream this step: P(n ≥ j) = α^j, capped at K."""
        u = 1.0 - self.rng.random(ks.shape)  # in (0, 1]
        with np.errstate(divide="ignore"):
            n = np.floor(np.log(u) / np.log(alpha)) if alpha > 0 else np.zeros(ks.shape)
        accepted: np.ndarray = np.minimum(n, ks).astype(np.int64)
        return accepted

    def run(self, alpha: float, max_drafts: int, ks: np.ndarray | None = None, stop_on_latch: bool = True,
            steps: list[tuple[np.ndarray, np.ndarray]] | None = None) -> SimResult:
        """``ks``: each stream's K (default uniform 1..8); ``stop_on_latch`` False: streams go on
        after their latch trips (the estimate's own calibration, not cut short where it is low);
        ``steps``: if given, each step's (accepted, active) arrays are appended (tests replay them
        through ``observe``)."""
        policy, count = self.policy, self.sessions
        ks = self.rng.integers(1, MAX_K + 1, count) if ks is None else ks
        estimate, weight = np.zeros(count), np.zeros(count)
        seen = np.zeros(count, dtype=np.int64)
        latched_at = np.full(count, -1, dtype=np.int64)
        at: dict[int, np.ndarray] = {c: np.full(count, np.nan) for c in CHECKPOINTS}
        active = np.ones(count, dtype=bool)
        while active.any():
            accepted = self.draw(alpha, ks)
            tested = np.where(active, accepted + (accepted < ks), 0)
            if steps is not None:
                steps.append((accepted.copy(), active.copy()))
            folded = decayed_fold(estimate, weight, tested, accepted, policy.acceptance_half_life)
            estimate = np.where(active, folded[0], estimate)
            weight = np.where(active, folded[1], weight)
            seen += tested
            for checkpoint, values in at.items():
                first = active & np.isnan(values) & (seen >= checkpoint)
                values[first] = estimate[first]
            trips = active & (latched_at < 0) & (seen >= policy.min_proposals) & below_floor(
                estimate, weight, policy.acceptance_floor, policy.acceptance_latch_stderrs)
            latched_at[trips] = seen[trips]
            active &= (seen < max_drafts) & ~(trips & stop_on_latch)
        # A checkpoint no stream reached (the run stopped earlier) reads as NaN.
        return SimResult(alpha, {c: float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")
                                 for c, v in at.items()}, latched_at)
