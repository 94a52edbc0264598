"""Token trees in a forward's attention (issue #36): checking a row's ``TreeRow`` against the
cache, packing it for the one-call kernel (``rowgemm.c`` ``forward_tree``), and the torch
path's keys gathered into logical order.

A tree token l of a row starting at cache position ``start`` is written at ``start + l`` as
always; it is rotated at ``logical[l]`` and attends to the logical keys ``0..logical[l]``: key
j is read at cache position j below its mapped keys, and at ``keymap[l][...]`` for its top
``len(keymap[l])`` (its ancestors, itself last). Both paths score the keys by logical index, in
the order and blocking a plain decoding step at ``logical[l]`` uses, so a node's K/V and logits
are that step's bit for bit (``tests/unit/engine/test_tree_attention.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from policies.tree import MAX_TREE_DEPTH
from workers.engines.embedded.trees.tree import TreeRow

# Per packed token for the kernel: its logical position, the count of mapped keys, then
# MAX_TREE_DEPTH cache positions (``TREE_STRIDE`` in rowgemm.c).
TREE_STRIDE = MAX_TREE_DEPTH + 2


def check_tree(tree: TreeRow, start: int, length: int, rotary: int, positions: int) -> None:
    """Raises ValueError unless every index a tree row makes a kernel read is in range: one
    entry per token; each logical position inside the rotary table and the cache; at most
    MAX_TREE_DEPTH mapped keys, no more than there are logical keys; the keys below the map
    and every mapped position already written (before ``start + length``: this forward
    writes its own tokens before any query attends)."""
    if len(tree.logical) != length or len(tree.keymap) != length:
        raise ValueError(f"a tree row needs one logical position and key map per token ({length})")
    written = start + length
    for logical, keymap in zip(tree.logical, tree.keymap, strict=True):
        if not 0 <= logical < min(rotary, positions):
            raise ValueError(f"tree position {logical} outside the rotary table / cache ({rotary}, {positions})")
        if len(keymap) > MAX_TREE_DEPTH or len(keymap) > logical + 1:
            raise ValueError(f"key map of {len(keymap)} at logical position {logical} (at most {MAX_TREE_DEPTH})")
        # The prefix keys 0..logical - len(keymap) are read at their own positions.
        if logical - len(keymap) >= written or any(not 0 <= p < written for p in keymap):
            raise ValueError(f"key map {keymap} at logical position {logical} reads past the {written} "
                             "positions written")


def pack_trees(trees: Sequence[TreeRow | None], starts: Sequence[int], lengths: Sequence[int], rotary: int,
               positions: int) -> torch.Tensor:
    """The kernel's tree array, (tokens, TREE_STRIDE) int64 over the rows' packed tokens, every
    index checked (``check_tree``); a row without a tree is ordinary ({start + l, 0})."""
    if len(trees) != len(starts):
        raise ValueError(f"{len(trees)} trees for {len(starts)} rows")
    flat: list[int] = []
    pad = [0] * MAX_TREE_DEPTH
    for tree, start, n in zip(trees, starts, lengths, strict=True):
        if tree is None:
            for col in range(n):
                flat += (start + col, 0, *pad)
            continue
        check_tree(tree, start, n, rotary, positions)
        for logical, keymap in zip(tree.logical, tree.keymap, strict=True):
            flat += (logical, len(keymap), *keymap, *pad[len(keymap):])
    return torch.tensor(flat, dtype=torch.long).view(-1, TREE_STRIDE)


def logical_keys(trees: Sequence[TreeRow | None], starts: Sequence[int], lengths: Sequence[int], width: int,
                 span: int, positions: torch.Tensor) -> torch.Tensor:
    """The torch path's (B, L, span) cache position of each query's logical key j: j itself,
    but a tree token's top keys through its map. ``positions`` (B, L): each query's logical
    position (padding's too); the keys past it are masked, so read in place."""
    index = torch.arange(span, dtype=torch.long).expand(len(starts), width, span).clone()
    for b, tree in enumerate(trees):
        if tree is None:
            continue
        for col, keymap in enumerate(tree.keymap):
            if keymap:
                top = int(positions[b, col]) + 1
                index[b, col, top - len(keymap):top] = torch.tensor(keymap, dtype=torch.long)
    return index


def gather_keys(layer: torch.Tensor, slots: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A cache layer (slots, Hkv, P, D) read for every query: (B, L, Hkv, span, D), row b's
    slot, each query's keys in logical order (``logical_keys``)."""
    gathered = layer[slots[:, None, None], :, index]  # (B, L, span, Hkv, D): advanced dims first
    return gathered.permute(0, 1, 3, 2, 4)


def attend_gathered(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``layers.attend_per_query`` over per-query keys: q (B, H, L, D); keys/values
    (B, L, Hkv, S, D); mask (B, 1, L, S). Every query is a single-query problem over its own
    keys, as a plain decoding step at its position is."""
    b, _, length, _ = q.shape
    if b == 1 and length > 1:
        # The L queries become L batch rows, each over its own keys.
        rows = F.scaled_dot_product_attention(q.transpose(0, 2), keys[0], values[0], attn_mask=mask.transpose(0, 2),
                                              enable_gqa=True)
        return rows.transpose(0, 2)
    return torch.cat([F.scaled_dot_product_attention(q[:, :, i:i + 1], keys[:, i], values[:, i],
                                                     attn_mask=mask[:, :, i:i + 1], enable_gqa=True)
                      for i in range(length)], dim=2)
