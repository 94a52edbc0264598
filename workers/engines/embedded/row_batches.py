"""A step's rows through a model (``SpeculativeEngine._forward``): the short rows together in one
forward, each long one (a prefill, a tree on the torch path) in a forward of its own."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engines.embedded.forwards import native_rows, single_row
from workers.engines.embedded.kv_cache import CacheBatch, KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.prefix_cache import prefill_chunks
from workers.engines.embedded.sequence import Row


@dataclass(frozen=True)
class RowLimits:
    target: bool  # the model is the engine's target (its rows are scored row-invariant)
    batched_row_limit: int  # longer rows get a forward of their own
    prefill_chunk: int  # a prefill's chunks (prefix_cache.py)
    max_positions: int


def forward_rows(model: LlamaForCausalLM, cache: KVCache, rows: list[Row], limits: RowLimits) -> list[torch.Tensor]:
    """Runs rows through a model; returns each row's (n_logits, V) logits in order."""
    out: list[torch.Tensor | None] = [None] * len(rows)
    # A tree row rides with the short rows where the one-call kernel serves them; the torch
    # path verifies a tree in a forward of its own (one row's gathered keys).
    alone = [len(r.new_tokens) > limits.batched_row_limit or r.fused > 0
             or (r.tree is not None and model.fused is None) for r in rows]
    short = [i for i, r in enumerate(rows) if not alone[i]]
    groups = [short] if short else []
    groups += [[i] for i in range(len(rows)) if alone[i]]
    for group in groups:
        # The target's rows must score each token exactly as plain decoding would
        # (row-invariant attention), drafts above all, even in a long row (a short prompt
        # plus K drafts). A prefill's prompt is always bare, in a forward of its own (see
        # step), so it is computed identically in every mode and may use the fused kernel,
        # 2-3x faster on long prompts (_Row.fused). The draft's numerics never reach the output.
        row_invariant = limits.target and not any(rows[i].fused for i in group)
        if len(group) == 1:
            row = rows[group[0]]
            if limits.target and row.fused > 0:
                # A prefill: the prompt fused, in the prefix cache's aligned chunks; a resumed
                # one's output then row-invariant in one forward, as its decode steps computed it.
                out[group[0]] = prefill_chunks(model, cache, row, limits.prefill_chunk, limits.max_positions)
                if out[group[0]] is not None:
                    continue
                row = Row(row.slot, row.start + row.fused, row.new_tokens[row.fused:], row.n_logits)
                row_invariant = True
            out[group[0]] = single_row(model, cache, row, row_invariant, limits.max_positions)
            continue
        width = max(len(rows[i].new_tokens) for i in group)
        native = native_rows(model, cache, [rows[i] for i in group], row_invariant, limits.max_positions)
        if native is not None:
            for i, chunk in zip(group, native.split([rows[i].n_logits for i in group]), strict=True):
                out[i] = chunk
            continue
        tokens = torch.zeros((len(group), width), dtype=torch.long)
        logit_rows: list[int] = []
        logit_cols: list[int] = []
        for b, i in enumerate(group):
            row = rows[i]
            tokens[b, :len(row.new_tokens)] = torch.tensor(row.new_tokens)
            n = len(row.new_tokens)
            logit_rows += [b] * row.n_logits
            logit_cols += range(n - row.n_logits, n)
        batch = CacheBatch.build([rows[i].slot for i in group], [rows[i].start for i in group],
                                 [len(rows[i].new_tokens) for i in group], width, limits.max_positions,
                                 row_invariant=row_invariant, trees=[rows[i].tree for i in group])
        logits = model.forward_cached(tokens, cache, batch, torch.tensor(logit_rows), torch.tensor(logit_cols))
        splits = logits.split([rows[i].n_logits for i in group])
        for i, chunk in zip(group, splits, strict=True):
            out[i] = chunk
    # A reduced-vocabulary draft's logits, laid over the whole vocabulary (-inf elsewhere):
    # everything after this point, sampling, trees and verification alike, sees one vocabulary.
    return [model.full_vocab_logits(o) for o in out if o is not None]
