"""The serving KV cache and the batch layout of one cached forward.

``KVCache``: per-layer key/value tensors, one row per sequence slot, allocated once and written
by position (a rejected draft is undone by moving the position back, never by copying).
``CacheBatch``: where one forward's new tokens sit (positions, key spans, masks, scatter indices).
"""

from __future__ import annotations

import dataclasses
import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from workers.engines.embedded.trees.attention import check_tree, logical_keys

if TYPE_CHECKING:
    from workers.engines.embedded.config import ModelConfig
    from workers.engines.embedded.trees.tree import TreeRow

# Row-invariant attention spans are padded to whole blocks of this many keys (masked), so a
# token's attention reads the same number of keys whether it is decoded alone or verified
# among K drafts, in any batch (see layers.attend_per_query).
KEY_BLOCK = 64


def padded_span(positions: int) -> int:
    return -(-positions // KEY_BLOCK) * KEY_BLOCK


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor on an anonymous mapping: the kernel hands out zero pages as they are first
    written, so memory is committed as the cache fills. ``torch.zeros`` writes every byte at
    once: SmolLM2's cache (30 layers, 16 slots, 8,192 positions) is 6 GB in float32, which took
    about 6 s to zero at each worker start and stayed resident however little was cached."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor's storage holds a reference to the mapping, which is unmapped with it.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


@dataclass
class KVCache:
    """Per-layer key/value tensors, (slots, kv_heads, positions, head_dim), allocated once.

    ``positions`` is the longest sequence a slot holds (default the model's max_position_embeddings),
    rounded up to whole KEY_BLOCKs.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def allocate(cls, cfg: ModelConfig, slots: int, dtype: torch.dtype, positions: int | None = None) -> KVCache:
        span = padded_span(cfg.max_position_embeddings if positions is None else positions)
        shape = (slots, cfg.num_key_value_heads, span, cfg.head_dim)
        return cls([lazy_zeros(shape, dtype) for _ in range(cfg.num_hidden_layers)],
                   [lazy_zeros(shape, dtype) for _ in range(cfg.num_hidden_layers)])


@dataclass(frozen=True)
class Scatter:
    """Where a padded batch's real tokens go: their (row, col) in the batch, (slot, position) in the cache."""

    slots: torch.Tensor  # (B,) cache slot of each row
    valid_rows: torch.Tensor  # (N,) row of each real token
    valid_cols: torch.Tensor  # (N,) column of each real token
    write_slots: torch.Tensor  # (N,) slot each real token's K/V goes to
    write_positions: torch.Tensor  # (N,) position each real token's K/V goes to
    contiguous_slots: tuple[int, int] | None  # slots are lo..hi-1 in order: slice, don't gather


@dataclass(frozen=True)
class CacheBatch:
    """Index tensors for one cached forward over B sequences padded to L new tokens.

    A single unpadded sequence (batch 1, the latency case, and every draft step there) needs
    no scatter indices: its K/V are written by slicing. Building those indices costs more than
    a small model's layer, so they exist only for real batches.
    """

    positions: torch.Tensor  # (B, L) absolute position of each new token (padding clamped)
    key_span: int  # keys 0..key_span-1 are read: the longest row (padded to KEY_BLOCKs if row_invariant)
    mask: torch.Tensor | None  # (B, 1, L, key_span) True where allowed; None: one query sees every key
    single: tuple[int, int] | None  # (slot, start) when the batch is one unpadded sequence
    scatter: Scatter | None  # otherwise
    # Every token's logits independent of the batch's shape (see layers.attend_per_query): what a
    # target needs so verification scores exactly what plain decoding would. A draft can skip it.
    row_invariant: bool = True
    # Each row's (slot, first position, real tokens), for the native kernels (kernels/rowgemm.py).
    rows: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] = ((), (), ())
    # Token trees (issue #36): each row's TreeRow or None; None when no row has one. Then
    # ``positions`` are the tokens' logical positions (rotary, mask) while K/V are still written
    # at start + l, and ``tree_keys`` holds the rows' slots (B,) and, per query, the cache
    # position of its logical key j (B, L, key_span): its prefix in place, its ancestors mapped.
    trees: tuple[TreeRow | None, ...] | None = None
    tree_keys: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, slots: list[int], starts: list[int], lengths: list[int], width: int,
              max_positions: int, row_invariant: bool = True,
              trees: Sequence[TreeRow | None] | None = None) -> CacheBatch:
        batch = cls._build(slots, starts, lengths, width, max_positions, row_invariant)
        if trees is None or all(t is None for t in trees):
            return batch
        if len(trees) != len(slots):
            raise ValueError(f"{len(trees)} trees for {len(slots)} rows")
        positions = batch.positions.clone()
        for b, tree in enumerate(trees):
            if tree is not None:
                check_tree(tree, starts[b], lengths[b], max_positions, max_positions)
                positions[b, :lengths[b]] = torch.tensor(tree.logical, dtype=torch.long)
        keys = torch.arange(batch.key_span, dtype=torch.long)
        # Every query masked at its logical position, a plain decoding step's mask there.
        mask = (keys[None, None, :] <= positions[:, :, None])[:, None]
        index = logical_keys(trees, starts, lengths, width, batch.key_span, positions)
        return dataclasses.replace(batch, positions=positions, mask=mask, trees=tuple(trees),
                                   tree_keys=(torch.tensor(slots, dtype=torch.long), index))

    @classmethod
    def _build(cls, slots: list[int], starts: list[int], lengths: list[int], width: int,
               max_positions: int, row_invariant: bool) -> CacheBatch:
        needed = max(start + length for start, length in zip(starts, lengths, strict=True))
        if needed > max_positions:
            raise ValueError(f"sequence needs {needed} positions, cache holds {max_positions}")
        key_span = padded_span(needed) if row_invariant else needed
        keys = torch.arange(key_span, dtype=torch.long)
        if len(slots) == 1 and lengths[0] == width:
            positions = torch.arange(starts[0], starts[0] + width, dtype=torch.long)[None]
            mask = None
            if row_invariant or width > 1:
                mask = (keys[None, :] <= positions[0, :, None])[None, None]
            return cls(positions, key_span, mask, (slots[0], starts[0]), None, row_invariant,
                       ((slots[0],), (starts[0],), (width,)))
        b = len(slots)
        slot_t = torch.tensor(slots, dtype=torch.long)
        len_t = torch.tensor(lengths, dtype=torch.long)
        cols = torch.arange(width, dtype=torch.long)
        positions = torch.tensor(starts, dtype=torch.long)[:, None] + cols[None, :]
        rows_idx, cols_idx = (cols[None, :] < len_t[:, None]).nonzero(as_tuple=True)
        # Padding rows attend causally like real rows (never to nothing, so no NaN); their
        # outputs are discarded by the caller.
        mask = (keys[None, None, :] <= positions[:, :, None])[:, None]
        contiguous = (slots[0], slots[0] + b) if slots == list(range(slots[0], slots[0] + b)) else None
        scatter = Scatter(slot_t, rows_idx, cols_idx, slot_t[rows_idx], positions[rows_idx, cols_idx], contiguous)
        return cls(positions.clamp(max=max_positions - 1), key_span, mask, None, scatter, row_invariant,
                   (tuple(slots), tuple(starts), tuple(lengths)))
