"""The target's auxiliary hidden states for an EAGLE-3 head: the residual stream after the head's
``layer_ids`` layers (vLLM's ``aux_hidden_states``), at every token a target forward computes.

A forward with an ``AuxCapture`` set on the model (``LlamaForCausalLM.aux_capture``) records, per
row, (slot, start, states (n, len(layer_ids) * hidden)) for its n real tokens: one kernel call
(kernels/rowgemm.c's ``forward_aux``), the per-op native path and the torch path alike. The logits
do not change: the states are copies of what the forward computed anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class AuxCapture:
    layer_ids: tuple[int, ...]
    rows: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)

    def add_packed(self, packed: torch.Tensor, slots: Sequence[int], starts: Sequence[int],
                   lengths: Sequence[int]) -> None:
        """``packed`` (sum(lengths), A * hidden): row b's lengths[b] tokens, then the next row's."""
        for slot, start, part in zip(slots, starts, packed.split(list(lengths)), strict=True):
            self.rows.append((int(slot), int(start), part))

    def add_padded(self, per_layer: list[torch.Tensor], slots: Sequence[int], starts: Sequence[int],
                   lengths: Sequence[int]) -> None:
        """``per_layer``: each (B, L, hidden), rows padded to L; row b's first lengths[b] tokens are real."""
        states = torch.cat(per_layer, dim=-1)
        for b, (slot, start, n) in enumerate(zip(slots, starts, lengths, strict=True)):
            self.rows.append((int(slot), int(start), states[b, :n].clone()))

    def take(self) -> list[tuple[int, int, torch.Tensor]]:
        rows, self.rows = self.rows, []
        return rows
