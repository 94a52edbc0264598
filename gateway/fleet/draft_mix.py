"""What the gateway has in flight on one worker, by the K each request was sent with (0 for a
lookup method's: it runs no draft forward).

K auto prices a step at its worker's draft mix (``policies/cost.py``): a session joining a batch
where a third of the sequences draft gets a deeper K than one joining a batch where all do. The
gateway knows that mix exactly for the requests it forwarded, from the decision each went with;
the worker's own step rule cuts a K now and then (the batch latch, ``max_step_drafts``), which
the mix does not follow, because the gateway decides per request, not per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from policies import Decision, Reason, StepMix
from policies.methods import is_lookup

WOULD_DRAFT: frozenset[Reason] = frozenset({"no_gain", "batch_full"})


@dataclass
class DraftMix:
    by_k: dict[int, int] = field(default_factory=dict)  # K (0: plain) -> requests in flight with it
    # Of the plain ones, those the rules would let draft: sent plain because no K paid
    # (``no_gain``) or by the batch latch (``batch_full``).
    would_draft: int = 0
    lookups: int = 0  # requests in flight with a lookup method (method-aware placement)

    @property
    def count(self) -> int:
        return sum(self.by_k.values())

    @property
    def drafting(self) -> int:
        return sum(n for k, n in self.by_k.items() if k > 0)

    def add(self, decision: Decision) -> None:
        k = _draft_k(decision)
        self.by_k[k] = self.by_k.get(k, 0) + 1
        self.would_draft += decision.reason in WOULD_DRAFT
        self.lookups += _is_lookup(decision)

    def remove(self, decision: Decision) -> None:
        k = _draft_k(decision)
        if decision.reason in WOULD_DRAFT:
            self.would_draft = max(0, self.would_draft - 1)
        if _is_lookup(decision):
            self.lookups = max(0, self.lookups - 1)
        left = self.by_k.get(k, 0) - 1
        if left > 0:
            self.by_k[k] = left
        else:  # the last one (or one never added: nothing to take back)
            self.by_k.pop(k, None)

    def step_mix(self) -> StepMix:
        return StepMix(self.count, self.drafting, self.would_draft)

    def view(self) -> dict[str, Any]:
        """For ``/admin/workers``: in-flight requests by K, how many draft and how much per step."""
        return {"by_k": {str(k): n for k, n in sorted(self.by_k.items())}, "drafting": self.drafting,
                "drafts_per_step": sum(k * n for k, n in self.by_k.items()), "would_draft": self.would_draft,
                "lookups": self.lookups}


def _is_lookup(decision: Decision) -> bool:
    return decision.mode == "speculative" and decision.method is not None and is_lookup(decision.method)


def _draft_k(decision: Decision) -> int:
    """The draft forwards a request adds to its steps: its K, or 0 for a lookup method's (its
    proposals cost no forward; the mix prices the draft's)."""
    return 0 if decision.method is not None and is_lookup(decision.method) else decision.k
