"""The speculative fallback policy: every rule, top to bottom, as pure functions.

Sans-I/O: frozen dataclasses in, a frozen ``Decision`` or new state out. No clock, no I/O, no
torch or aiohttp; the gateway owns time and storage and calls these functions.

Rules, in the order ``decide`` applies them (thresholds named as in config.yaml):
1. ``worker_plain_only``: the worker cannot speculate (no draft, or it serves one plain mode).
   (Its mirror, ``worker_speculative_only``, is the last word: a worker that serves one fixed
   speculative mode speculates whatever the rules below say. The gateway first looks for a
   worker that serves the mode the rules want; these two reasons say it found none.)
2. ``high_temperature``: the request samples hotter than ``max_temperature``.
3. ``batch_full``: the worker's batch depth went above ``max_batch`` and has not yet fallen
   below ``batch_resume`` (hysteresis latch, see ``batch_latch``).
4. ``low_acceptance`` / ``probe``: the session's acceptance estimate fell below
   ``acceptance_floor`` by more than ``acceptance_latch_stderrs`` standard errors, with at least
   ``min_proposals`` tested drafts of evidence (``acceptance_latch``; the estimator is
   ``policies/acceptance.py``), and has not climbed back above ``acceptance_resume``. Every
   ``probe_every``-th request of such a session speculates anyway (``probe``) so that new
   evidence can bring it back.
5. ``no_gain`` (``num_speculative_tokens: auto`` only): the worker's measured costs say no K
   buys ``min_gain`` more throughput than plain for this session's acceptance at this batch
   depth (``policies/cost.py``). Every ``probe_every``-th such request speculates anyway
   (``probe``), so a session's estimate can recover.
6. ``default``: speculate with K = ``num_speculative_tokens`` (capped by the worker's max K), or
   with ``auto``, the K that maximizes expected tokens per unit of time on the worker's cost
   curves, priced at the worker's draft mix (``WorkerState.mix``: how many of its in-flight
   sequences draft), kept unless another K is better by ``k_switch_gain`` (``policies/cost.py``).
   Where the worker runs and prices token trees, each of ``tree_shapes`` competes too, and the
   session may get a tree (``Decision.tree``, K its depth), kept unless another choice is better
   by ``tree_switch_gain``; a tree priced on the prior only every ``tree_explore_every``-th
   request (``policies/tree_choice.py``). A worker that publishes no cost model speculates with its own max K.
``free_batch`` (off at 0) exempts shallow batches from rules 2 and 4: at or below that depth a
GPU step is memory-bound and drafting cheap, so a hot or low-acceptance session still gains
(reason ``free_batch`` when a rule was waived). ``free_batch: auto`` exempts them wherever the
worker's cost model says the session's acceptance pays at the worker's depth (``_free_batch_k``).
Per step, inside the worker, ``step_depth`` applies the batch latch and shrinks K once the
batch drafts more than ``max_step_drafts``; with ``auto`` the worker then gives the step's
drafting sequences one K, the best at the step's exact mix (``policies.cost.batch_step_k``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

from policies.acceptance import acceptance_latch, decayed_fold
from policies.config import PolicyConfig
from policies.cost import choose_k, expected_tokens, objective, step_cost
from policies.lookup import fold_lookup_steps, lookup_state, price_lookup, with_lookup_state
from policies.methods import METHODS, Method, is_lookup, keeps_own_evidence
from policies.states import RequestFacts, SessionState, WorkerState
from policies.tree import StepPath, TreeShape
from policies.tree_choice import Counts, chain_counts, choose_plan, fold_ranks, path_counts, plan_value
from policies.trial_k import acceptance_for_k, explore_k, mix_of, probe_k

Mode = Literal["speculative", "plain"]
Reason = Literal["default", "probe", "worker_plain_only", "worker_speculative_only", "high_temperature",
                 "batch_full", "low_acceptance", "no_gain", "free_batch", "explore"]
REASONS: tuple[Reason, ...] = ("default", "probe", "worker_plain_only", "worker_speculative_only",
                               "high_temperature", "batch_full", "low_acceptance", "no_gain", "free_batch", "explore")
# Decisions forced by what a fixed-mode worker serves, not by the rules.
FIXED_MODE_REASONS: frozenset[Reason] = frozenset({"worker_plain_only", "worker_speculative_only"})


@dataclass(frozen=True)
class Decision:
    mode: Mode
    k: int  # drafts per step; 0 when plain; a tree's depth
    reason: Reason
    tree: TreeShape | None = None  # a token tree instead of a chain of K (K auto, policies/tree_choice.py)
    # Where the session chose among methods (``policy.methods`` lists a lookup method the worker
    # offers): the one it speculates with. None: the draft model, no choice made.
    # (A plain decision made among methods names the one priced best, or "draft": the
    # session's explore count then moves on.)
    method: Method | None = None

    @property
    def header(self) -> str:
        """The ``X-Specgate-Mode`` response header value: today's fields in today's order, with
        ``method=`` after the mode where a method was chosen (clients that read ``k=`` still do)."""
        if self.mode == "speculative":
            method = "" if self.method is None else f"method={self.method}; "
            if self.tree is not None:
                return f"speculative; {method}tree={self.tree}; reason={self.reason}"
            return f"speculative; {method}k={self.k}; reason={self.reason}"
        return f"plain; reason={self.reason}"


def decide(session: SessionState, worker: WorkerState, request: RequestFacts, policy: PolicyConfig) -> Decision:
    """Which K, if any: plain or speculative on this worker, with its K and the rule's reason.

    The one entry point for the choice at admission (the rules in the module docstring, in
    order); a worker's steps may only lower the K (``step_depth``, ``policies.cost.batch_step_k``,
    ``policies.cost.catch_up_pays``)."""
    return run_on(_rules(session, worker, request, policy), worker)


def run_on(decision: Decision, worker: WorkerState) -> Decision:
    """What ``worker`` runs of the rules' ``decision``: a worker of one fixed speculative mode runs
    its own K, whatever the rules wanted (``worker_speculative_only`` where they wanted plain).
    ``decide`` ends here; the gateway calls it too, where it asked the rules about such a worker
    as if it served both modes, to learn which mode they want (gateway/admission.py ``route``)."""
    if not worker.serves_plain and worker.max_k > 0:
        # A server of one lookup method (a llama-server with an n-gram --spec-type) runs it whatever they wanted.
        own = worker.methods[0] if len(worker.methods) == 1 and keeps_own_evidence(worker.methods[0]) else None
        if decision.mode == "plain":
            return Decision("speculative", worker.max_k, "worker_speculative_only", method=own)
        return replace(decision, k=worker.max_k, tree=None, method=decision.method if own is None else own)
    return decision


def _rules(session: SessionState, worker: WorkerState, request: RequestFacts, policy: PolicyConfig) -> Decision:
    if worker.max_k <= 0 or not worker.serves_speculative:
        return Decision("plain", 0, "worker_plain_only")
    k = worker.max_k if policy.num_speculative_tokens == "auto" else min(policy.num_speculative_tokens, worker.max_k)
    # The waiver is priced only where a rule it waives would apply (it may ask the cost model).
    if request.temperature > policy.max_temperature:
        waived_k = _free_batch_k(session, worker, policy, k)
        if waived_k:
            return Decision("speculative", waived_k, "free_batch")
        return Decision("plain", 0, "high_temperature")
    if worker.batch_full:
        return Decision("plain", 0, "batch_full")
    lookups = [m for m in policy.methods if keeps_own_evidence(m) and m in worker.methods]  # type: ignore[arg-type]
    if lookups:
        return _method_rules(session, worker, policy, lookups, k, worker.shadow_lookup and request.temperature <= 0.0)
    if session.low_acceptance and (waived_k := _free_batch_k(session, worker, policy, k)):
        return Decision("speculative", waived_k, "free_batch")
    probe_due = session.plain_since_probe + 1 >= policy.probe_every
    if session.low_acceptance:
        if probe_due:
            return Decision("speculative", probe_k(session, worker, policy, k), "probe")
        return Decision("plain", 0, "low_acceptance")
    tree = None
    if policy.num_speculative_tokens == "auto" and worker.cost is not None:
        alpha = acceptance_for_k(session, worker, policy)
        k, tree = choose_plan(worker.cost, alpha, session.ranks, worker.batch_depth + 1, worker.max_k,
                              worker.tree_max_nodes, policy, session.auto_k, session.auto_tree,
                              session.since_tree + 1 >= policy.tree_explore_every, mix_of(worker))
        if k == 0:
            if probe_due:
                return Decision("speculative", probe_k(session, worker, policy, 1), "probe")
            return Decision("plain", 0, "no_gain")
    return Decision("speculative", k, "default", tree)


def _method_rules(session: SessionState, worker: WorkerState, policy: PolicyConfig, lookups: list[Method],
                  k: int, shadowed: bool) -> Decision:
    """Rules 4-6 where a session may choose its method (``policy.methods`` and the worker's).

    Each method not latched by its own acceptance floor is priced: the draft model as without methods
    (its K or tree, ``choose_plan``), each lookup method and the head on its α and coverage
    (``price_lookup``). The best is kept unless the current method is within ``k_switch_gain`` of
    it. A method never tried is priced on the worker's evidence for it where there is some; every
    ``method_explore_every``-th request (at once, where nothing else is on offer) one never tried
    runs (``explore``). Plain only when no method is expected to pay: every one latched
    (``low_acceptance``, the best-estimated probed every ``probe_every``-th request) or none pays
    ``min_gain`` (``no_gain``). ``shadowed``: the request brings shadow evidence for each lookup
    method it does not run (its worker replays them; T=0), so none is explored or probed while
    another runs; the models (draft, head) have no free shadow: explored and probed as before."""
    depth, auto = worker.batch_depth + 1, policy.num_speculative_tokens == "auto"
    options: dict[Method, tuple[float, int, TreeShape | None]] = {}
    latched: list[Method] = []
    untried: list[Method] = []
    waived = False  # the draft runs though latched: free_batch says it pays at this depth
    if "draft" in policy.methods and "draft" in worker.methods:
        if not session.low_acceptance:
            options["draft"] = _draft_option(session, worker, policy, k)
        elif waived_k := _free_batch_k(session, worker, policy, k):
            options["draft"], waived = (_draft_option(session, worker, policy, k)[0], waived_k, None), True
        else:
            latched.append("draft")
    for method in lookups:
        state, prior = lookup_state(session.lookups, method), lookup_state(worker.lookups, method)
        if state.low_acceptance:
            latched.append(method)
            continue
        if not state.tried:
            untried.append(method)
            if not prior.tried:
                continue
        price = price_lookup(state, prior, worker.cost, depth, worker.max_k if auto else k, policy,
                             policy.acceptance_resume)
        options[method] = (price.value, price.k if auto else k, None)
    # Where nothing else is on offer, trying costs nothing: the method runs at once. A shadowed lookup
    # method learns from every request (the head has no shadow: explored as ever).
    explorable = [m for m in untried if not (shadowed and is_lookup(m))]
    if untried and (not options or (explorable and session.since_method + 1 >= policy.method_explore_every)):
        method = untried[0] if not options else explorable[0]
        return Decision("speculative", explore_k(session, worker, policy, method, k), "explore", method=method)
    probe_due = session.plain_since_probe + 1 >= policy.probe_every
    # A latched method gets new evidence even while another one runs: probed every probe_every-th
    # request, as a latched session is (a shadowed lookup method gets it from every request).
    probed = [m for m in latched if not (shadowed and is_lookup(m))]
    if probed and options and session.since_method + 1 >= policy.probe_every:
        method = max(probed, key=lambda m: _estimate(session, m))
        return Decision("speculative", probe_k(session, worker, policy, k) if method == "draft" else k, "probe",
                        method=method)
    if not options:
        if not latched:
            return Decision("plain", 0, "no_gain", method="draft")
        if probe_due and probed:
            method = max(probed, key=lambda m: _estimate(session, m))
            return Decision("speculative", probe_k(session, worker, policy, k) if method == "draft" else k, "probe",
                            method=method)
        return Decision("plain", 0, "low_acceptance", method=latched[0])
    best = max(options, key=lambda m: (options[m][0], -METHODS.index(m)))
    current = session.method
    if current in options and options[current][0] * (1.0 + policy.k_switch_gain) >= options[best][0]:
        best = current
    value, best_k, tree = options[best]
    if best_k == 0 or (auto and worker.cost is not None and value <= 1.0 + policy.min_gain):
        if probe_due:
            return Decision("speculative", probe_k(session, worker, policy, 1) if best == "draft" else k, "probe",
                            method=best)
        return Decision("plain", 0, "no_gain", method=best)
    return Decision("speculative", best_k, "free_batch" if best == "draft" and waived else "default", tree,
                    method=best)


def _draft_option(session: SessionState, worker: WorkerState, policy: PolicyConfig,
                  k: int) -> tuple[float, int, TreeShape | None]:
    """The draft model's (value, K, tree) for this session: its plan as ``_rules`` chooses it and
    what that plan is expected to buy (plain decoding is 1; without a cost model every step is
    priced as plain, so the value is the tokens a step emits)."""
    alpha = acceptance_for_k(session, worker, policy)
    if policy.num_speculative_tokens != "auto" or worker.cost is None:
        cost = 1.0 if worker.cost is None else step_cost(worker.cost, worker.batch_depth + 1, min(k, worker.cost.max_k))
        return expected_tokens(alpha, k) / cost, k, None
    current_k = session.auto_k if session.method == "draft" else None
    current_tree = session.auto_tree if session.method == "draft" else None
    plan_k, tree = choose_plan(worker.cost, alpha, session.ranks, worker.batch_depth + 1, worker.max_k,
                               worker.tree_max_nodes, policy, current_k, current_tree,
                               session.since_tree + 1 >= policy.tree_explore_every, mix_of(worker))
    value = plan_value(worker.cost, alpha, session.ranks, worker.batch_depth + 1, plan_k, tree, policy, mix_of(worker))
    return value, plan_k, tree


def _estimate(session: SessionState, method: Method) -> float:
    """A method's bare acceptance estimate in the session (0 without one)."""
    if method == "draft":
        return session.acceptance_estimate or 0.0
    return lookup_state(session.lookups, method).acceptance_estimate or 0.0


def observe_lookup(session: SessionState, method: Method, steps: Iterable[tuple[int, int]],
                   policy: PolicyConfig, shadow: bool = False) -> SessionState:
    """A lookup method's steps, as (proposed, accepted), into the session's (or a worker's)
    evidence for it; a step that proposed nothing counts toward the method's coverage alone.
    ``shadow``: steps the worker replayed on another method's output (counted apart too)."""
    state = fold_lookup_steps(lookup_state(session.lookups, method), steps, policy, shadow)
    return replace(session, lookups=with_lookup_state(session.lookups, state))


def _free_batch_k(session: SessionState, worker: WorkerState, policy: PolicyConfig, k: int) -> int:
    """The K a session speculates with where ``free_batch`` waives the temperature and acceptance
    rules; 0 where it does not (off, the batch latch set, or too deep).

    A number waives them at or below that depth. ``auto`` waives them wherever the worker's cost
    model says a K buys ``min_gain`` for this session's acceptance at the worker's depth and mix,
    and that K is the one it runs (a fixed ``num_speculative_tokens`` must pay itself). Without
    a cost model, ``auto`` waives nothing: the configured rules stand.
    """
    if worker.batch_full or policy.free_batch == 0:
        return 0
    if policy.free_batch != "auto":
        return k if worker.batch_depth <= policy.free_batch else 0
    if worker.cost is None:
        return 0
    alpha, depth, mix = acceptance_for_k(session, worker, policy), worker.batch_depth + 1, mix_of(worker)
    if policy.num_speculative_tokens != "auto":
        return k if objective(worker.cost, alpha, k, depth, policy.min_gain, mix) > 1.0 + policy.min_gain else 0
    return choose_k(worker.cost, alpha, depth, worker.max_k, policy.min_gain, 0.0, None, mix)


def record_decision(session: SessionState, decision: Decision, auto_k: bool = False) -> SessionState:
    """Counts the requests a session spends plain for want of acceptance or gain, so probes
    come on time, and with ``auto_k`` (policy K auto) remembers the K the cost model chose: its
    hysteresis starts there."""
    if decision.reason in ("low_acceptance", "no_gain"):
        session = replace(session, plain_since_probe=session.plain_since_probe + 1)
    if decision.method is not None:  # methods in play: the explore count, and the method it runs
        since = 0 if decision.reason in ("explore", "probe") else min(session.since_method + 1, _MAX_SINCE)
        session = replace(session, since_method=since)
        if decision.mode == "speculative" and decision.reason != "probe":  # a probe is not a switch
            session = replace(session, method=decision.method)
            if decision.method != "draft":
                return session
    if decision.reason == "probe":
        return replace(session, plain_since_probe=0)
    if auto_k and decision.reason in ("default", "no_gain"):
        since = 0 if decision.tree is not None else min(session.since_tree + 1, _MAX_SINCE)
        return replace(session, auto_k=decision.k, auto_tree=decision.tree, since_tree=since)
    return session


_MAX_SINCE = 1 << 20  # since_tree stops counting here (only "due or not" matters)


def observe(session: SessionState, proposed: int, accepted: int, policy: PolicyConfig, *,
            ranks: bool = True) -> SessionState:
    """Folds one step's drafts into the acceptance estimate and the latch.

    Acceptance is the per-token α of Leviathan et al.: the chance a draft is accepted given
    the drafts before it were. A step that accepted n of K drafts tested n + 1 of them (the
    ones after the first rejection were never tested), or K if all passed; counting untested
    drafts as failures would make α depend on K. The estimate is the ratio of decayed accepted
    to decayed tested drafts (``policies.acceptance``): evidence ``acceptance_half_life``
    tested drafts old counts half as much as new evidence, and the first draft counts as one
    draft, not as the whole estimate.

    Counts a worker could not have meant (negative, or more accepted than proposed) are
    clamped here too; the gateway counts them before (``gateway.admission.checked_step``).

    ``ranks``: also fold the step into the rank acceptances trees are priced with; False for a
    worker's acceptance, of which only α is read (``observe_path`` and ``observe_steps`` alike).
    """
    if proposed <= 0:
        return session
    accepted = max(0, min(accepted, proposed))
    return _fold(session, tested_drafts(proposed, accepted), accepted, policy,
                 chain_counts(((proposed, accepted, 1),)) if ranks else None, proposed)


def observe_path(session: SessionState, path: StepPath, policy: PolicyConfig, *, ranks: bool = True) -> SessionState:
    """Folds one tree step (or a chain's, ``StepPath.of_chain``) into the estimates: every child
    it tested into the rank acceptances, and its rank-1 tests alone into α, which keeps its
    meaning (a draft's acceptance given its predecessors were accepted), so the acceptance
    rules see a tree session as they see a chain's."""
    if not path.ranks:
        return session
    # One rank-1 test per level tested, passed where rank 1 was the child taken.
    return _fold(session, len(path.ranks), sum(1 for r in path.ranks if r == 1), policy,
                 path_counts(path) if ranks else None, path.shape.depth)


def observe_steps(session: SessionState, steps: Iterable[tuple[int, int, int]], policy: PolicyConfig, *,
                  ranks: bool = True) -> SessionState:
    """Folds steps reported together, as (proposed, accepted, count) groups, into one block.

    Engines that learn acceptance only when a request ends (vLLM's per-request histogram)
    report steps without their order. Folding them one by one would make the estimate depend
    on an arbitrary order; the block is folded as one: the old evidence decays by all the
    drafts it tested, and each of them is added at weight 1.
    """
    steps = list(steps)  # read twice: α, then the rank table
    tested = accepted = proposed_total = 0
    for proposed, step_accepted, count in steps:
        if proposed <= 0 or count <= 0:
            continue
        step_accepted = max(0, min(step_accepted, proposed))
        tested += count * tested_drafts(proposed, step_accepted)
        accepted += count * step_accepted
        proposed_total += count * proposed
    if tested == 0:
        return session
    return _fold(session, tested, accepted, policy, chain_counts(steps) if ranks else None, proposed_total)


def _fold(session: SessionState, tested: int, accepted: int, policy: PolicyConfig,
          counts: Counts | None, proposed: int) -> SessionState:
    """α and the latch, and ``counts`` (None: none) into the rank acceptances."""
    estimate, weight = decayed_fold(session.acceptance_estimate or 0.0, session.acceptance_weight, tested, accepted,
                                    policy.acceptance_half_life)
    seen = session.proposals_seen + tested
    latched = acceptance_latch(session.low_acceptance, estimate, weight, seen, policy)
    plain_since_probe = session.plain_since_probe if latched else 0
    ranks = session.ranks if counts is None else fold_ranks(session.ranks, counts, policy.acceptance_half_life)
    return replace(session, acceptance_estimate=estimate, acceptance_weight=weight, proposals_seen=seen,
                   drafts_proposed=session.drafts_proposed + proposed,
                   drafts_accepted=session.drafts_accepted + accepted, low_acceptance=latched,
                   plain_since_probe=plain_since_probe, ranks=ranks)


def tested_drafts(proposed: int, accepted: int) -> int:
    """Drafts a step actually tested: the accepted ones plus the first rejected one, if any (none
    is tested after it); 0 for a step that drafted nothing."""
    if proposed <= 0:
        return 0
    return accepted + (1 if accepted < proposed else 0)


def batch_latch(latched: bool, batch_depth: int, policy: PolicyConfig) -> bool:
    """Hysteresis: trip above max_batch, clear only below batch_resume."""
    return _depth_latch(latched, batch_depth, policy.max_batch, policy.batch_resume)


def _depth_latch(latched: bool, batch_depth: int, max_batch: int, batch_resume: int) -> bool:
    if batch_depth > max_batch:
        return True
    if batch_depth < batch_resume:
        return False
    return latched


@dataclass(frozen=True)
class StepDepth:
    """The per-step batch rule inside a worker, where batch depth changes mid-request."""

    k: int  # drafts for this step
    batch_full: bool  # the worker's latch after this step's depth


def step_depth(requested_k: int, batch_depth: int, latched: bool, max_batch: int, batch_resume: int,
               max_step_drafts: int = 0) -> StepDepth:
    """Plain for this step while the worker's latch is set; otherwise the requested K, shrunk to
    max(1, round(max_step_drafts / batch_depth)) when ``max_step_drafts`` is set (0: no limit).

    Takes the thresholds rather than a PolicyConfig because a worker receives them with each
    request (the gateway's live policy), not from a file.
    """
    latched = _depth_latch(latched, batch_depth, max_batch, batch_resume)
    if latched:
        return StepDepth(0, True)
    if max_step_drafts > 0 and requested_k > 0 and batch_depth > 0:
        requested_k = min(requested_k, max(1, round(max_step_drafts / batch_depth)))
    return StepDepth(requested_k, False)
