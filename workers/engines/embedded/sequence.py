"""The engine's per-sequence state, its forward rows, and a step's token tree.

Shared by the engine (``engine.py``) and its tree steps (``trees/step.py``), which both read and
write them; kept apart so that neither module imports the other's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.engines.embedded.sampling import seeded_noise
from workers.engines.embedded.trees.sampling import TreeProposals
from workers.engines.embedded.trees.tree import TreeLayout, TreeRow
from workers.engines.interface import GenerationRequest


@dataclass
class TreeDraft:
    """One sequence's tree in the step being run."""

    layout: TreeLayout
    base: int  # cache position of the root (the sequence's last token)
    tokens: list[int]  # [node]: its token; node 0 is the root
    proposals: TreeProposals = field(default_factory=TreeProposals)

    def verification_row(self, real: int) -> TreeRow:
        return TreeRow.for_nodes(self.layout, self.base, real, range(1, self.layout.size))


@dataclass
class Sequence:
    """One running request's state in the engine."""

    request: GenerationRequest
    slot: int
    tokens: list[int]
    generator: torch.Generator
    k: int
    target_len: int = 0
    draft_len: int = 0
    emitted: int = 0
    step_k: int = 0
    drafts: list[int] = field(default_factory=list)
    draft_probs: list[torch.Tensor] = field(default_factory=list)
    # Seeded requests: Gumbel noise by output position, drawn once, read by draft and target.
    noise: dict[int, torch.Tensor] = field(default_factory=dict)
    tree: TreeLayout | None = None  # the token tree asked for (GenerationRequest.tree)
    step_tree: TreeDraft | None = None  # this step's tree; None: a chain of step_k
    cached: int = 0  # prompt tokens whose K/V came from the prefix cache (prefix_cache.py)
    # The eagle3 method (eagle3/step.py): the head's K/V holds positions < head_len; the target's
    # states for positions head_len .. target_len - 1 wait in aux_pending for its next catch-up.
    head_len: int = 0
    aux_pending: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    cache_reported: bool = False  # the first event carried ``cached`` (StepEvent.cached_tokens)

    @property
    def coupled(self) -> bool:
        """Sampled with a seed: Gumbel-max sampling, the same answer in every mode."""
        params = self.request.params
        return params.seed is not None and params.temperature > 0.0

    def noise_at(self, j: int, vocab: int) -> torch.Tensor:
        """The noise for the j-th token from now (output position emitted + j)."""
        position = self.request.params.position_offset + self.emitted + j
        noise = self.noise.get(position)
        if noise is None:
            assert self.request.params.seed is not None
            noise = self.noise[position] = seeded_noise(self.request.params.seed, position, vocab)
        return noise



@dataclass(frozen=True)
class Row:
    """One sequence's input to a cached forward."""

    slot: int
    start: int
    new_tokens: list[int]
    n_logits: int  # logits wanted for the last n_logits new tokens
    # Leading new tokens the target may compute with fused attention: a long prompt in its
    # prefill (see step), bare, in a forward of its own, so computed the same way in every mode.
    # Tokens after them (a resumed request's output) go row-invariant, as decoding computed them.
    fused: int = 0
    tree: TreeRow | None = None  # the row's tokens sit in a token tree (tree.py); None: a plain row
