"""The engine's forwards outside the batch routing: a row alone (``single_row``) and rows
straight into the model's one-call kernel (``native_rows``, ``native_forward``)."""

from __future__ import annotations

import torch

from workers.engines.embedded.kv_cache import CacheBatch, KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.sequence import Row
from workers.engines.embedded.trees.tree import TreeRow


def native_forward(model: LlamaForCausalLM, cache: KVCache, tokens: list[list[int]], slots: list[int],
                   starts: list[int], logit_idx: list[int], row_invariant: bool,
                   trees: list[TreeRow | None] | None = None) -> torch.Tensor | None:
    """Rows straight into the model's one-call kernel (kernels/rowgemm.py), where it serves them
    as ``forward_cached`` would (row-invariant or short rows), from Python lists: no CacheBatch,
    no torch op per index check (at batch 1 a draft forward's bookkeeping through
    ``forward_cached`` cost about as much as its arithmetic). Logits (N, V) for ``logit_idx``
    (into the rows padded to the longest); None where the model must take ``forward_cached``."""
    fused = model.fused
    if fused is None or not (row_invariant or max(map(len, tokens)) <= model.native_attention_max_tokens):
        return None
    return fused.run_rows(tokens, cache.k, cache.v, slots, starts, logit_idx, trees=trees, capture=model.aux_capture)


def native_rows(model: LlamaForCausalLM, cache: KVCache, rows: list[Row], row_invariant: bool,
                max_positions: int) -> torch.Tensor | None:
    """Rows into ``native_forward``, logits for each row's last ``n_logits`` tokens (None: the
    model must take ``forward_cached``); a row past the cache's ``max_positions`` is refused."""
    needed = max(r.start + len(r.new_tokens) for r in rows)
    if needed > max_positions:
        raise ValueError(f"sequence needs {needed} positions, cache holds {max_positions}")
    width = max(len(r.new_tokens) for r in rows)
    logit_idx = [b * width + col for b, r in enumerate(rows)
                 for col in range(len(r.new_tokens) - r.n_logits, len(r.new_tokens))]
    return native_forward(model, cache, [r.new_tokens for r in rows], [r.slot for r in rows],
                          [r.start for r in rows], logit_idx, row_invariant, [r.tree for r in rows])


def single_row(model: LlamaForCausalLM, cache: KVCache, row: Row, row_invariant: bool,
               max_positions: int) -> torch.Tensor:
    """One row alone (batch 1, every draft step there): no padding, no gather; only the
    positions whose logits are read go through the LM head. Returns (n_logits, V)."""
    native = native_rows(model, cache, [row], row_invariant, max_positions)
    if native is not None:
        return native
    n = len(row.new_tokens)
    batch = CacheBatch.build([row.slot], [row.start], [n], n, max_positions, row_invariant=row_invariant,
                             trees=[row.tree])
    wanted = None if row.n_logits == n else torch.arange(n - row.n_logits, n)
    logits = model.forward_cached(torch.tensor([row.new_tokens]), cache, batch,
                                  None if wanted is None else torch.zeros_like(wanted), wanted)
    return logits[0] if wanted is None else logits
