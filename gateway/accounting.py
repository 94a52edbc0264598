"""The way back: a worker's chunks into the session's evidence, the worker's acceptance, the usage
and the request's tally. Each function takes the admission (``gateway/admission.py``, the way in)
and what the worker reported, and returns one ``ChunkOutcome`` per chunk, which the caller hands
to the metrics in one call (``observe.chunk_outcome.record_chunk``) and, where the worker reported
its cache, to the routing pipeline's post-response step. Nothing here reads the gateway's state.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.admission import Admission
from gateway.fleet.handle import WorkerHandle
from gateway.fleet.worker_stream import RawChunk
from gateway.llamacpp import TIMINGS_FIELD, TimingsSeen, timings_report
from gateway.observe.chunk_outcome import ChunkOutcome
from policies import StepPath, observe, observe_lookup, observe_path, observe_steps, tested_drafts
from policies.methods import Method, is_lookup, keeps_own_evidence
from policies.tree import parse_shape
from workers.api.answers import chunk_text, speculative_usage
from workers.api.generation import ShadowSteps
from workers.api.wire import DIRECTIVE_FIELD, RequestKind, StepReport, vllm_step_report

MAX_LATE_STEPS = 4096  # late step groups folded one by one up to this count (a worker's bug must stay cheap)


@dataclass
class StreamTally:
    """What the chunks of one request added up to."""

    proposed: int = 0
    accepted: int = 0
    tested: int = 0  # drafts tested (α's denominator)
    speculative_steps: int = 0
    first_token_at: float | None = None
    last_at: float = 0.0  # when the last chunk with tokens arrived
    tokens: int = 0
    collected: list[dict[str, Any]] = field(default_factory=list)
    timings: TimingsSeen = field(default_factory=TimingsSeen)  # a llama-server's counters (gateway/llamacpp.py)


def account_chunk(admission: Admission, tally: StreamTally, raw: RawChunk, kind: RequestKind, started: float,
                  now: float) -> ChunkOutcome:
    """One chunk into the session's and worker's acceptance and the tally; ``now`` is when its
    worker read came (time to first token, inter-token gaps). The usage chunk is restated in
    specgate's terms where the worker's own does not say what ran."""
    # The streaming relay forwards chunks without usage as the worker sent them: only the usage
    # chunk may be changed here.
    chunk = raw.chunk if raw.chunk.get("usage") is None else raw.changed()
    handle = admission.handle
    outcome = ChunkOutcome(handle.worker_id)
    report = raw.report
    if handle.protocol == "vllm" and chunk.get("usage"):
        report = vllm_step_report(chunk, admission.decision.k)
        # vLLM's own field, restated in specgate's terms: every engine's chunks look alike.
        chunk.pop("metrics", None)
        if report is not None:
            chunk[DIRECTIVE_FIELD] = report.to_json()
    elif handle.protocol == "llamacpp":
        # llama.cpp's counters, restated as the steps behind the chunk (gateway/llamacpp.py).
        if TIMINGS_FIELD in chunk:
            chunk = raw.changed()
        report = timings_report(chunk, tally.timings, handle.max_k, any(is_lookup(m) for m in handle.methods),
                                bool(chunk_text(kind, chunk)))
        outcome.clamps.extend(tally.timings.take_clamps())
        _learn_costs(handle, tally.timings)
    if report is not None and report.cached is not None:
        outcome.cached = (admission.prefix_share, *report.cached)
    elif handle.protocol in ("vllm", "llamacpp") and chunk.get("usage"):
        outcome.cached = _cached(admission, chunk["usage"])
    # Tokens by the mode of the steps that made them: one step, or a coalesced chunk's steps.
    emitted = outcome.tokens
    if report is not None:
        for step in report.steps():
            account_step(admission, tally, step, outcome)
            mode = "speculative" if step.k > 0 else "plain"
            emitted[mode] = emitted.get(mode, 0) + step.tokens
    elif chunk_text(kind, chunk):
        emitted[admission.decision.mode] = 1
    _time_tokens(admission, tally, report, started, now, outcome)
    if chunk.get("usage"):
        chunk["usage"] = _usage(admission, tally, chunk["usage"])
    return outcome


def _time_tokens(admission: Admission, tally: StreamTally, report: StepReport | None, started: float, now: float,
                 outcome: ChunkOutcome) -> None:
    """The chunk's tokens into the tally, time to first token and the inter-token gaps."""
    emitted = outcome.tokens
    tokens = sum(emitted.values())
    if not tokens:
        return
    tally.tokens += tokens
    gapped = emitted  # tokens whose gap since the one before is observed
    if tally.first_token_at is None:
        # A coalesced chunk says how long its worker held it (workers/server/coalesce.py): the
        # first token came then, and the chunk's later steps in the time since.
        held = report.held_s if report is not None else 0.0
        tally.first_token_at = tally.last_at = max(started, now - held)
        outcome.first_token = (admission.decision.mode, tally.first_token_at - started)
        gapped = {}
        if report is not None and report.then:  # the first step's own tokens came together
            head = "speculative" if report.k > 0 else "plain"
            gapped = {mode: n - report.tokens if mode == head else n for mode, n in emitted.items()}
    count = sum(gapped.values())
    gap = (now - tally.last_at) / count if count else 0.0
    # A span's tokens share its time evenly, as a speculative step's do.
    outcome.gaps.extend((mode, gap, n) for mode, n in gapped.items() if n > 0)
    tally.last_at = now


def _usage(admission: Admission, tally: StreamTally, raw_usage: Any) -> dict[str, Any]:
    """The usage chunk's counts: the session's context size taken from it, and ``speculative``
    (what ran) added where the worker reports no steps of its own."""
    usage: dict[str, Any] = dict(raw_usage)
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if type(prompt) is int and type(completion) is int and prompt >= 0 and completion >= 0:
        admission.session.context_tokens = prompt + completion
    # A specgate worker's usage says what ran (its step counts); a server that reports no
    # steps gets the gateway's tally, and the plain steps it cannot see stay unknown.
    if "speculative" not in usage:
        usage["speculative"] = speculative_usage(tally.proposed, tally.accepted, admission.decision.mode,
                                                 tally.speculative_steps if tally.proposed else None,
                                                 tested=tally.tested)
    return usage


def _learn_costs(handle: WorkerHandle, seen: TimingsSeen) -> None:
    """A llama-server's timed steps and prefill into its costs (gateway/llamacpp.py ``StepCosts``)."""
    if seen.prefill is not None and seen.prefill[0] > 0:
        handle.step_costs.observe_prefill(*seen.prefill)
        seen.prefill = (0, 0.0)  # told once a request
    step_ms = seen.take_step_ms()
    if not step_ms:
        return
    for k, ms in step_ms:
        handle.step_costs.observe(k, ms)
    if handle.max_k > 0:
        handle.cost = handle.step_costs.model(handle.max_k)


def _cached(admission: Admission, usage: Any) -> tuple[float, int, int] | None:
    """A vLLM server's or llama-server's usage, where it reports cached tokens (vLLM's
    ``--enable-prompt-tokens-details``): what the prefix scorer's hold learns from."""
    if not isinstance(usage, dict):
        return None
    details, prompt = usage.get("prompt_tokens_details"), usage.get("prompt_tokens")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if type(prompt) is int and type(cached) is int and 0 <= cached <= prompt:
        return admission.prefix_share, prompt, cached
    return None


def checked_step(report: StepReport, clamps: list[str]) -> StepReport:
    """The report with counts no worker could mean (negative, or more accepted than proposed)
    clamped, each reason added to ``clamps`` (``specgate_step_reports_clamped_total{reason}``): a
    worker's bug must not poison a session's estimate, nor pass unseen."""
    if 0 <= report.accepted <= report.proposed and (report.proposed > 0 or report.accepted == 0) and all(
            0 <= g.accepted <= g.proposed and g.count >= 0 for g in report.late_steps):
        return report  # the usual report: nothing built
    proposed, accepted = _clamped(report.proposed, report.accepted, clamps)
    late = []
    for group in report.late_steps:
        if group.count < 0:
            clamps.append("negative")
            continue
        late.append(replace(group, **dict(zip(("proposed", "accepted"), _clamped(group.proposed, group.accepted,
                                                                                  clamps), strict=True))))
    return replace(report, proposed=proposed, accepted=accepted, late_steps=tuple(late))


def _clamped(proposed: int, accepted: int, clamps: list[str]) -> tuple[int, int]:
    if proposed < 0 or accepted < 0:
        clamps.append("negative")
        proposed, accepted = max(0, proposed), max(0, accepted)
    if accepted > proposed:
        clamps.append("accepted_over_proposed")
        accepted = proposed
    return proposed, accepted


def account_step(admission: Admission, tally: StreamTally, report: StepReport, outcome: ChunkOutcome) -> None:
    """One engine step's drafts into the session's and the worker's acceptance and the tally."""
    if report.shadow:
        _account_shadow(admission, report.shadow, outcome)
    method = admission.decision.method
    if method is not None and keeps_own_evidence(method) and admission.decision.mode == "speculative":
        _account_lookup_step(admission, tally, method, report, outcome)
        return
    if method == "draft" and admission.decision.mode == "speculative":
        outcome.method_steps.append((method, report.proposed, report.accepted))
    if report.proposed == 0 and report.accepted == 0 and not report.late_steps:
        return  # a plain step: no drafts to count (every step of a plain stream comes here)
    report = checked_step(report, outcome.clamps)
    session, handle, policy = admission.session, admission.handle, admission.policy
    # The worker's acceptance is read for α alone: the rank table is the session's.
    path = step_path(report)
    if path is not None:  # a tree step: its rank-1 tests into α, every test into the rank table
        session.policy_state = observe_path(session.policy_state, path, policy)
        handle.acceptance = observe_path(handle.acceptance, path, policy, ranks=False)
    else:
        session.policy_state = observe(session.policy_state, report.proposed, report.accepted, policy)
        handle.acceptance = observe(handle.acceptance, report.proposed, report.accepted, policy, ranks=False)
    tally.proposed += report.proposed
    tally.accepted += report.accepted
    tally.tested += tested_drafts(report.proposed, report.accepted)
    tally.speculative_steps += int(report.proposed > 0) + sum(g.count for g in report.late_steps)
    outcome.steps.append((report.proposed, report.accepted, 1))
    if report.late_steps:  # acceptance the engine learned late (vLLM: when the request ended)
        groups = [(g.proposed, g.accepted, g.count) for g in report.late_steps]
        session.policy_state = observe_steps(session.policy_state, groups, policy)
        handle.acceptance = observe_steps(handle.acceptance, groups, policy, ranks=False)
        tally.proposed += sum(g.proposed * g.count for g in report.late_steps)
        tally.accepted += sum(g.accepted * g.count for g in report.late_steps)
        tally.tested += sum(tested_drafts(g.proposed, g.accepted) * g.count for g in report.late_steps)
        outcome.steps.extend(groups)


def _account_lookup_step(admission: Admission, tally: StreamTally, method: Method, report: StepReport,
                         outcome: ChunkOutcome) -> None:
    """A lookup request's step: into the method's evidence, a step that proposed nothing too (it
    counts toward the method's coverage: how often a lookup finds anything to propose)."""
    report = checked_step(report, outcome.clamps)
    session, handle, policy = admission.session, admission.handle, admission.policy
    steps = [(report.proposed, report.accepted)]
    steps += [(g.proposed, g.accepted) for g in report.late_steps for _ in range(min(g.count, MAX_LATE_STEPS))]
    session.policy_state = observe_lookup(session.policy_state, method, steps, policy)
    handle.acceptance = observe_lookup(handle.acceptance, method, steps, policy)
    proposing = [(p, a) for p, a in steps if p > 0]
    tally.proposed += sum(p for p, _ in proposing)
    tally.accepted += sum(a for _, a in proposing)
    tally.tested += sum(tested_drafts(p, a) for p, a in proposing)
    tally.speculative_steps += len(proposing)
    if report.proposed > 0:
        outcome.steps.append((report.proposed, report.accepted, 1))
    outcome.method_steps.extend((method, proposed, accepted) for proposed, accepted in steps)


def _account_shadow(admission: Admission, shadow: tuple[ShadowSteps, ...], outcome: ChunkOutcome) -> None:
    """What the lookup methods the request did not run would have done (the worker replayed them
    on its output, docs/methods.md "Shadow evidence"), into their evidence as their own steps
    are, session and worker. Only the methods the policy allows; a run's counts are clamped as
    a step report's, and at most MAX_LATE_STEPS steps of each are folded."""
    session, handle, policy = admission.session, admission.handle, admission.policy
    for replay in shadow:
        if replay.method not in policy.methods:
            continue
        steps = [(max(0, p), max(0, min(a, p))) for p, a in itertools.islice(replay.steps(), MAX_LATE_STEPS)]
        session.policy_state = observe_lookup(session.policy_state, replay.method, steps, policy, shadow=True)
        handle.acceptance = observe_lookup(handle.acceptance, replay.method, steps, policy, shadow=True)
        outcome.shadows.append((replay.method, steps))


def step_path(report: StepReport) -> StepPath | None:
    """A tree step's path, checked against its shape; None for a chain step, or for a path that
    does not fit its tree (a worker's bug: the step is then folded as a chain's drafts)."""
    if report.tree is None or report.path is None:
        return None
    try:
        return StepPath(parse_shape(report.tree), report.path)
    except ValueError:  # TreeShapeError among them
        return None
