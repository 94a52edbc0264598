"""What ``/admin`` shows of an acceptance estimate: each figure named for what it is.

Pure, as the rest of ``policies/``; the gateway's admin endpoints call these.
"""

from __future__ import annotations

from typing import Any

from policies.acceptance import posterior, stderr
from policies.config import PolicyConfig
from policies.lookup import LookupState
from policies.states import SessionState


def acceptance_view(state: SessionState, policy: PolicyConfig, prior: float | None) -> dict[str, float | int | None]:
    """An estimate as ``/admin`` shows it, each figure named for what it is. ``alpha`` is what
    the floor is compared with: the per-draft acceptance given the drafts before it were
    accepted. ``accepted_per_proposed`` is vLLM's acceptance rate (accepted ÷ proposed over the
    life): drafts after a step's first rejection count as failures there, so it depends on K and
    is lower than α at the same quality (docs/policy.md). ``prior``: the worker's estimate, or
    None where there is none (a worker's own view)."""
    estimate, weight = state.acceptance_estimate, state.acceptance_weight
    known = estimate is not None and weight > 0.0
    return {
        "alpha": round(estimate, 4) if known and estimate is not None else None,
        "alpha_stderr": round(stderr(estimate, weight), 4) if known and estimate is not None else None,
        "alpha_weight": round(weight, 2),
        "alpha_priced": round(posterior(estimate, weight, policy.acceptance_resume if prior is None else prior,
                                        policy.acceptance_prior_drafts), 4),
        "drafts_tested": state.proposals_seen,
        "drafts_proposed": state.drafts_proposed,
        "drafts_accepted": state.drafts_accepted,
        "accepted_per_proposed": round(state.drafts_accepted / state.drafts_proposed, 4)
        if state.drafts_proposed else None,
    }


def lookup_views(state: SessionState, policy: PolicyConfig, worker: tuple[LookupState, ...] = ()
                 ) -> dict[str, dict[str, Any]]:
    """Each lookup method's evidence as ``acceptance_view`` shows the draft's, with its coverage
    (the share of its steps that proposed), keyed by method; ``worker``: the worker's, the prior."""
    out: dict[str, dict[str, Any]] = {}
    for lookup in state.lookups:
        prior = next((w for w in worker if w.method == lookup.method), None)
        prior_alpha = prior.acceptance_estimate if prior is not None and prior.acceptance_weight > 0 else None
        estimate, weight = lookup.acceptance_estimate, lookup.acceptance_weight
        known = estimate is not None and weight > 0.0
        out[lookup.method] = {
            "alpha": round(estimate, 4) if known and estimate is not None else None,
            "alpha_stderr": round(stderr(estimate, weight), 4) if known and estimate is not None else None,
            "alpha_weight": round(weight, 2),
            "alpha_priced": round(posterior(estimate, weight, policy.acceptance_resume if prior_alpha is None
                                            else prior_alpha, policy.acceptance_prior_drafts), 4),
            "coverage": None if lookup.coverage is None else round(lookup.coverage, 4),
            "steps": lookup.steps_seen,
            "shadow_steps": lookup.shadow_steps,  # of which replayed on another method's output
            # The steps it ran (what the usage counted), and, apart, the worker's replays.
            "drafts_tested": lookup.proposals_seen - lookup.shadow_drafts_tested,
            "drafts_proposed": lookup.drafts_proposed,
            "drafts_accepted": lookup.drafts_accepted,
            "shadow_drafts_tested": lookup.shadow_drafts_tested,
            "shadow_drafts_proposed": lookup.shadow_drafts_proposed,
            "shadow_drafts_accepted": lookup.shadow_drafts_accepted,
            "low_acceptance": lookup.low_acceptance,
        }
    return out


def speculative_view(state: SessionState) -> dict[str, Any]:
    """The drafts a session's requests ran, in all and per method (the draft model's and each
    lookup method's): the sum of its answers' ``usage.speculative`` blocks. The worker's shadow
    replays (docs/methods.md), which no usage counted, are apart under ``shadow``."""
    by_method = {"draft": {"proposed": state.drafts_proposed, "accepted": state.drafts_accepted,
                           "tested": state.proposals_seen}}
    shadow = {}
    for lookup in state.lookups:
        by_method[lookup.method] = {"proposed": lookup.drafts_proposed, "accepted": lookup.drafts_accepted,
                                    "tested": lookup.proposals_seen - lookup.shadow_drafts_tested}
        if lookup.shadow_steps:
            shadow[lookup.method] = {"proposed": lookup.shadow_drafts_proposed,
                                     "accepted": lookup.shadow_drafts_accepted,
                                     "tested": lookup.shadow_drafts_tested, "steps": lookup.shadow_steps}
    totals = {count: sum(m[count] for m in by_method.values()) for count in ("proposed", "accepted", "tested")}
    return {**totals, "by_method": by_method, "shadow": shadow}
