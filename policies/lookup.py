"""A lookup method's evidence and price, per session and per worker (``policies/methods.py``
says what the methods are); an EAGLE-3 head's (``eagle3``) too, which is kept and priced the same
way with a coverage of 1 (the head always proposes) and its own forwards in the step's cost.

Pure, as the rest of ``policies/``: ``policies.speculation.decide`` prices each lookup method a
session may use with ``price_lookup`` and compares it with the draft model's plan; the gateway
folds a lookup request's steps with ``fold_lookup_steps``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from policies.acceptance import acceptance_latch, decayed_fold, posterior
from policies.config import PolicyConfig
from policies.cost import CostModel, expected_tokens, head_step_cost, lookup_step_cost
from policies.methods import METHODS, Method


@dataclass(frozen=True)
class LookupState:
    """One lookup method's evidence in a session (or, over all its sessions, a worker).

    α as the draft's (``policies.acceptance``: decayed accepted over decayed tested drafts, the
    same half-life and latch), and the method's *coverage*: the share of its steps that proposed
    anything. A lookup step without a match is a plain step, so what a lookup method is worth
    depends on how often it finds one as much as on how often its proposals pass. Steps decay
    with ``acceptance_half_life`` counted in steps.
    """

    method: Method
    acceptance_estimate: float | None = None
    acceptance_weight: float = 0.0
    proposals_seen: int = 0  # drafts tested over the life, run and shadow
    drafts_proposed: int = 0  # ...proposed by steps that ran (what the usage's speculative block counted)
    drafts_accepted: int = 0
    low_acceptance: bool = False  # the floor's latch, per method
    steps_weight: float = 0.0  # decayed steps run with this method
    proposing_weight: float = 0.0  # ...of which proposed at least one token
    steps_seen: int = 0  # steps over the life
    # ...of which shadow steps: replayed by the worker on the output of a request that ran another
    # method (docs/methods.md "Shadow evidence"), folded as the method's own steps are.
    shadow_steps: int = 0
    # The shadow steps' drafts, apart: no client's usage counted them.
    shadow_drafts_proposed: int = 0
    shadow_drafts_accepted: int = 0
    shadow_drafts_tested: int = 0

    @property
    def coverage(self) -> float | None:
        return None if self.steps_weight <= 0.0 else self.proposing_weight / self.steps_weight

    @property
    def tried(self) -> bool:
        return self.steps_seen > 0


def lookup_state(states: tuple[LookupState, ...], method: Method) -> LookupState:
    return next((s for s in states if s.method == method), LookupState(method))


def with_lookup_state(states: tuple[LookupState, ...], state: LookupState) -> tuple[LookupState, ...]:
    """``states`` with ``state`` in its method's place (methods in METHODS order)."""
    by_method = {s.method: s for s in states} | {state.method: state}
    return tuple(by_method[m] for m in METHODS if m in by_method)


def fold_lookup_steps(state: LookupState, steps: Iterable[tuple[int, int]], policy: PolicyConfig,
                      shadow: bool = False) -> LookupState:
    """Lookup steps, as (proposed, accepted), into ``state``: every step into the coverage, the
    proposing ones into α and the latch (a step that accepted n of its K proposals tested n + 1
    of them, or K; ``policies.speculation.tested_drafts``). ``shadow``: replayed steps, which
    count as the method's own (at T=0 they are exactly what running it would have reported).

    Folded in local variables, one state built at the end: a shadow brings a step per output
    token of each method, on the gateway's event loop (a frozen copy per step cost 10 µs each)."""
    decay = 0.5 ** (1.0 / policy.acceptance_half_life)
    estimate, weight = state.acceptance_estimate, state.acceptance_weight
    steps_w, proposing_w, low = state.steps_weight, state.proposing_weight, state.low_acceptance
    n = seen = proposed_total = accepted_total = 0
    for proposed, accepted in steps:
        n += 1
        steps_w = steps_w * decay + 1.0
        proposing_w = proposing_w * decay + (1.0 if proposed > 0 else 0.0)
        if proposed <= 0:
            continue
        accepted = max(0, min(accepted, proposed))
        tested = accepted + (1 if accepted < proposed else 0)
        estimate, weight = decayed_fold(estimate or 0.0, weight, tested, accepted, policy.acceptance_half_life)
        seen, proposed_total, accepted_total = seen + tested, proposed_total + proposed, accepted_total + accepted
        low = acceptance_latch(low, estimate, weight, state.proposals_seen + seen, policy)
    folded = replace(state, acceptance_estimate=estimate, acceptance_weight=weight,
                     proposals_seen=state.proposals_seen + seen, low_acceptance=low,
                     steps_weight=steps_w, proposing_weight=proposing_w, steps_seen=state.steps_seen + n)
    if shadow:  # no client's usage counted these drafts: kept apart
        return replace(folded, shadow_steps=state.shadow_steps + n,
                       shadow_drafts_proposed=state.shadow_drafts_proposed + proposed_total,
                       shadow_drafts_accepted=state.shadow_drafts_accepted + accepted_total,
                       shadow_drafts_tested=state.shadow_drafts_tested + seen)
    return replace(folded, drafts_proposed=state.drafts_proposed + proposed_total,
                   drafts_accepted=state.drafts_accepted + accepted_total)


@dataclass(frozen=True)
class LookupPrice:
    """What a lookup method is expected to be worth for a session: its α and coverage, shrunk
    towards the worker's for the method (``acceptance_prior_drafts``), and the K (the cap on a
    step's proposal) that buys the most."""

    alpha: float
    coverage: float
    k: int
    value: float  # tokens per unit of time relative to plain decoding


def price_lookup(session: LookupState, worker: LookupState, model: CostModel | None, depth: int, max_k: int,
                 policy: PolicyConfig, prior_alpha: float) -> LookupPrice:
    """Priced as ``price_method`` says, for a lookup method or the head (``state.method``)."""
    return price_method(session, worker, model, depth, max_k, policy, prior_alpha)


def price_method(session: LookupState, worker: LookupState, model: CostModel | None, depth: int, max_k: int,
                 policy: PolicyConfig, prior_alpha: float) -> LookupPrice:
    """The session's lookup method priced on the worker's measured verification costs.

    A proposing step of K costs the target's forward of K + 1 tokens and no draft forward
    (``lookup_step_cost``); a step without a match costs a plain step and emits one token. So
    the value is (c E(α, K) + 1 − c) / (c cost(K) + 1 − c), c the coverage. Without a cost model
    each step is priced as plain (the tokens per step alone)."""
    prior_a = worker.acceptance_estimate if worker.acceptance_weight > 0 else None
    alpha = posterior(session.acceptance_estimate, session.acceptance_weight,
                      posterior(prior_a, worker.acceptance_weight, prior_alpha, policy.acceptance_prior_drafts),
                      policy.acceptance_prior_drafts)
    head = session.method == "eagle3"
    prior_c = worker.coverage if worker.coverage is not None else LOOKUP_PRIOR_COVERAGE
    coverage = 1.0 if head else posterior(session.coverage, session.steps_weight, prior_c,
                                          policy.acceptance_prior_drafts)
    best = LookupPrice(alpha, coverage, 0, 1.0)
    step_cost = head_step_cost if head else lookup_step_cost
    for k in range(1, max_k + 1):
        cost = 1.0 if model is None else step_cost(model, depth, min(k, model.max_k))
        value = (coverage * expected_tokens(alpha, k) + 1.0 - coverage) / (coverage * cost + 1.0 - coverage)
        if value > best.value:
            best = LookupPrice(alpha, coverage, k, value)
    return best


# A lookup method's coverage before any step of it was seen, by the session or its worker: the
# price of exploring it is bounded by ``method_explore_every``, not by this guess.
LOOKUP_PRIOR_COVERAGE = 0.5
