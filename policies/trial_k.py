"""The inputs a decision prices with, and the K of the steps that bring evidence: the α the cost
model is read at (a session's estimate shrunk towards its worker's), the worker's draft mix, and
the K a probe or a method's trial runs at."""

from __future__ import annotations

from dataclasses import replace

from policies.acceptance import posterior
from policies.config import PolicyConfig
from policies.cost import StepMix, gain
from policies.lookup import lookup_state, price_lookup
from policies.methods import Method
from policies.states import SessionState, WorkerState


def acceptance_for_k(session: SessionState, worker: WorkerState, policy: PolicyConfig) -> float:
    """The α the cost model is read at: the session's estimate shrunk towards a prior worth
    ``acceptance_prior_drafts`` tested drafts (a Beta posterior mean, ``policies.acceptance``).
    The prior is the worker's estimate over all its sessions, or before the worker has any,
    ``acceptance_resume``, the level at which the rules let a session speculate."""
    prior = worker.acceptance if worker.acceptance is not None else policy.acceptance_resume
    return posterior(session.acceptance_estimate, session.acceptance_weight, prior, policy.acceptance_prior_drafts)


def worker_acceptance(worker: SessionState, policy: PolicyConfig) -> float | None:
    """A worker's acceptance over all its sessions (folded as a session's is), as
    ``WorkerState.acceptance`` gives it to the cost model: shrunk towards ``acceptance_resume``
    with ``acceptance_prior_drafts`` pseudo-drafts, so that one unlucky first session (two
    rejected drafts) cannot send every session new to the worker plain for ``no_gain`` (plain
    requests add no evidence, and only probes would bring it back). None before any evidence."""
    if worker.acceptance_estimate is None or worker.acceptance_weight <= 0.0:
        return None
    return posterior(worker.acceptance_estimate, worker.acceptance_weight, policy.acceptance_resume,
                     policy.acceptance_prior_drafts)


def probe_k(session: SessionState, worker: WorkerState, policy: PolicyConfig, fallback: int) -> int:
    """A probe's K: with ``auto`` and a cost model, the K with the best gain (never 0)."""
    if policy.num_speculative_tokens != "auto" or worker.cost is None:
        return fallback
    cost, alpha, depth = worker.cost, acceptance_for_k(session, worker, policy), worker.batch_depth + 1
    ks = range(1, min(worker.max_k, cost.max_k) + 1)
    mix = mix_of(worker)
    return max(ks, key=lambda k: (gain(cost, alpha, k, depth, mix), -k), default=fallback)


def explore_k(session: SessionState, worker: WorkerState, policy: PolicyConfig, method: Method,
               fallback: int) -> int:
    """A trial's K: with ``auto`` and a cost model, the K the method is priced best at on its
    prior (the worker's evidence for it, else ``acceptance_resume``), at least 1. A trial at the
    worker's largest K pays the dearest verification there is (on a dequantizing target, about
    four plain steps at K = 8), to learn an α that any K measures."""
    if policy.num_speculative_tokens != "auto" or worker.cost is None:
        return fallback
    price = price_lookup(lookup_state(session.lookups, method), lookup_state(worker.lookups, method), worker.cost,
                         worker.batch_depth + 1, worker.max_k, policy, policy.acceptance_resume)
    return max(1, price.k)


def mix_of(worker: WorkerState) -> StepMix | None:
    """The worker's draft mix, its drafting sequences accepting as the worker does overall."""
    return None if worker.mix is None else replace(worker.mix, acceptance=worker.acceptance)
