"""What a generation asks for and what its steps ran, shared by the gateway and every engine.

``SamplingParams`` is what the protocol hands an engine; ``SpecSteps`` and ``StepCounts`` are the
step counts a worker's step reports carry and the gateway folds (a migrated stream's dead part
included); ``ShadowSteps`` what a lookup method the request did not run would have done. Pure: no
torch, no engine (the engine interface, ``workers/engines/interface.py``, builds on these).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from policies.methods import Method
from policies.speculation import tested_drafts


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    top_k: int = 0  # 0 disables
    seed: int | None = None  # fixes the request's answer, whatever the decoding mode, K and batch
    # Output position of the first generated token. A seeded request's noise is keyed by
    # (seed, position), so a request resumed after n tokens passes n and continues the same noise.
    position_offset: int = 0
    ignore_eos: bool = False  # vLLM's: an EOS token does not end the generation (max_tokens does)
    min_tokens: int = 0  # vLLM's: EOS cannot be generated before this many output tokens


@dataclass(frozen=True)
class SpecSteps:
    """Speculative steps folded together: ``count`` steps that each drafted ``proposed`` and
    accepted ``accepted``. Engines that learn acceptance only when a request ends (vLLM's
    per-request histogram) report it this way; the gateway folds each step into the session."""

    proposed: int
    accepted: int
    count: int


def group_steps(drafted: Iterable[int], accepted: Iterable[int]) -> tuple[SpecSteps, ...]:
    """Per-step (drafted, accepted) pairs, in step order, as ``SpecSteps`` groups; steps that
    drafted nothing (plain) are left out."""
    counts: dict[tuple[int, int], int] = {}
    for d, a in zip(drafted, accepted, strict=False):
        if d > 0:
            counts[(d, a)] = counts.get((d, a), 0) + 1
    return tuple(SpecSteps(d, a, c) for (d, a), c in sorted(counts.items()))


@dataclass
class StepCounts:
    """What the steps of one generation ran, folded step by step: the worker's usage counts
    (workers/server/app.py), and the gateway's for a dead worker's part of a migrated stream."""

    proposed: int = 0
    accepted: int = 0
    tested: int = 0  # drafts tested: the accepted ones and each step's first rejected one (α's denominator)
    steps: int = 0
    speculative_steps: int = 0

    def add(self, proposed: int, accepted: int, late: Sequence[SpecSteps] = ()) -> None:
        """One step, and the steps whose acceptance its engine reported late (``late_steps``):
        a step that drafted is speculative, and so is every late one."""
        if not late:  # the usual step: no generators
            self.proposed += proposed
            self.accepted += accepted
            self.tested += tested_drafts(proposed, accepted)
            self.steps += 1
            self.speculative_steps += proposed > 0
            return
        self.proposed += proposed + sum(g.proposed * g.count for g in late)
        self.accepted += accepted + sum(g.accepted * g.count for g in late)
        self.tested += tested_drafts(proposed, accepted) + sum(tested_drafts(g.proposed, g.accepted) * g.count
                                                                for g in late)
        self.steps += 1
        self.speculative_steps += int(proposed > 0) + sum(g.count for g in late)


@dataclass(frozen=True)
class ShadowSteps:
    """What a lookup method the request did not run would have done on its output: its steps
    replayed, in step order, as runs of equal steps (``count`` steps of ``proposed`` drafts with
    ``accepted`` accepted; a step with ``proposed`` 0 found no match, a plain step). An engine
    reports it where the replay is exact (greedy, or seeded and coupled across modes;
    docs/methods.md "Shadow evidence"); the gateway folds it into the method's evidence."""

    method: Method
    runs: tuple[SpecSteps, ...]

    def steps(self) -> Iterator[tuple[int, int]]:
        """Each replayed step as (proposed, accepted), in order."""
        for run in self.runs:
            for _ in range(run.count):
                yield run.proposed, run.accepted

    def counts(self) -> StepCounts:
        """The replay's totals, as ``StepCounts`` folds a request's own steps."""
        counts = StepCounts()
        for run in self.runs:
            counts.proposed += run.proposed * run.count
            counts.accepted += run.accepted * run.count
            counts.tested += tested_drafts(run.proposed, run.accepted) * run.count
            counts.steps += run.count
            counts.speculative_steps += run.count if run.proposed > 0 else 0
        return counts


def step_runs(steps: Iterable[tuple[int, int]]) -> tuple[SpecSteps, ...]:
    """(proposed, accepted) steps, in order, as runs of equal neighbours (``ShadowSteps.runs``)."""
    runs: list[SpecSteps] = []
    for proposed, accepted in steps:
        if runs and runs[-1].proposed == proposed and runs[-1].accepted == accepted:
            runs[-1] = SpecSteps(proposed, accepted, runs[-1].count + 1)
        else:
            runs.append(SpecSteps(proposed, accepted, 1))
    return tuple(runs)
