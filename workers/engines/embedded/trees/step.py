"""The engine's tree steps: draft a token tree level by level, verify it in one target forward,
settle the accepted path into both caches.

A sequence asked to speculate with a tree (``GenerationRequest.tree``) runs one in every step
whose K (after the per-step rules) reaches the tree's depth and whose cache has room for its
nodes; otherwise that step runs the chain of the K it got. The layout (which node sits where,
what it attends to) is ``tree.py``'s; the sampling rules (which children the draft proposes,
which one the target accepts) are ``sampling.py``'s.

Drafting: the first draft forward catches the draft up on the sequence's last tokens and
gives the root's distribution, from which the depth-1 children are drawn; each later forward
feeds one level's nodes (written at their scratch positions, attending to their ancestors)
and gives every node of that level its children. The leaves are never fed, as a chain's last
draft is not. Verification: one target row of the pending real tokens and every node.
Settling: the accepted path's K/V moves from ``base + node`` to ``base + depth`` in the
target's cache (and, for the nodes the draft was fed, in the draft's), and the lengths are
set, so the caches hold what plain decoding of the emitted tokens would have written.
"""

from __future__ import annotations

from typing import Protocol

import torch

from policies.tree import StepPath
from workers.engines.embedded.kv_cache import KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.sequence import Row, Sequence, TreeDraft
from workers.engines.embedded.trees.sampling import draft_children, verify_tree
from workers.engines.embedded.trees.tree import TreeRow


class TreeEngine(Protocol):
    """What a tree step uses of the engine (engine.SpeculativeEngine)."""

    draft: LlamaForCausalLM | None
    draft_cache: KVCache | None
    target_cache: KVCache
    max_positions: int

    def _forward_isolated(self, model: LlamaForCausalLM, cache: KVCache, seqs: list[Sequence], rows: list[Row],
                          failed: dict[str, Exception]) -> list[torch.Tensor | None]: ...


def plan(engine: TreeEngine, seq: Sequence, k: int) -> TreeDraft | None:
    """The tree this step drafts for ``seq`` at step depth ``k``, or None (a chain of ``k``):
    not asked for, the step's K below the tree's depth, or no room for its nodes."""
    layout = seq.tree
    if layout is None or k < layout.shape.depth or engine.draft is None:
        return None
    base = len(seq.tokens) - 1
    if base + layout.size > engine.max_positions:
        return None
    return TreeDraft(layout, base, [seq.tokens[-1]] + [0] * (layout.size - 1))


def propose(engine: TreeEngine, seqs: list[Sequence], failed: dict[str, Exception]) -> None:
    """Draft every tree sequence's tree, level by level, batched across sequences."""
    if not seqs:
        return
    assert engine.draft is not None and engine.draft_cache is not None
    deepest = max(s.step_tree.layout.shape.depth for s in seqs if s.step_tree is not None)
    for level in range(deepest):
        active = [s for s in seqs if s.request.request_id not in failed and s.step_tree is not None
                  and level < s.step_tree.layout.shape.depth]
        rows = []
        for seq in active:
            tree = seq.step_tree
            assert tree is not None
            if level == 0:  # catch up on the real tokens; the root's logits
                rows.append(Row(seq.slot, seq.draft_len, seq.tokens[seq.draft_len:], 1))
            else:
                nodes = tree.layout.level(level)
                rows.append(Row(seq.slot, tree.base + nodes.start, [tree.tokens[n] for n in nodes], len(nodes),
                                 tree=TreeRow.for_nodes(tree.layout, tree.base, 0, nodes)))
        logits = engine._forward_isolated(engine.draft, engine.draft_cache, active, rows, failed)
        for seq, row, row_logits in zip(active, rows, logits, strict=True):
            if row_logits is None:
                continue
            tree = seq.step_tree
            assert tree is not None
            if level == 0:
                seq.draft_len += len(row.new_tokens)
            parents = [0] if level == 0 else list(tree.layout.level(level))
            try:
                for parent, parent_logits in zip(parents, row_logits, strict=True):
                    children = tree.layout.children[parent]
                    tokens = draft_children(parent_logits, len(children), seq.request.params, seq.generator,
                                            seq.noise_at(level, parent_logits.shape[-1]) if seq.coupled else None,
                                            tree.proposals, parent)
                    for child, token in zip(children, tokens, strict=False):
                        tree.tokens[child] = token
            except Exception as exc:
                failed[seq.request.request_id] = exc


def settle(engine: TreeEngine, seq: Sequence, logits: torch.Tensor) -> tuple[list[int], StepPath]:
    """Verifies ``seq``'s tree against the target's logits for the root and every node
    ((size, V)), moves the accepted path into place in both caches and sets their lengths.
    Returns the tokens the step yields (accepted nodes, then the replacement or bonus token)
    and the path."""
    tree = seq.step_tree
    assert tree is not None
    layout = tree.layout
    tokens, ranks = verify_tree(layout, tree.tokens, logits, tree.proposals, seq.request.params, seq.generator,
                                seq.noise_at if seq.coupled else None)
    path = layout.path_to(ranks)
    before = len(seq.tokens)
    depth = layout.shape.depth
    # Target: every accepted node was verified (written); the draft was fed levels < depth only.
    compact(engine.target_cache, seq.slot, tree.base, path)
    assert engine.draft_cache is not None
    compact(engine.draft_cache, seq.slot, tree.base, path[:depth - 1])
    seq.target_len = before + len(path)
    seq.draft_len = before + min(len(path), depth - 1)
    return tokens, StepPath(layout.shape, tuple(ranks))


def compact(cache: KVCache, slot: int, base: int, path: tuple[int, ...]) -> None:
    """Moves the K/V of the path's nodes (node i at ``base + i``) to ``base + 1, base + 2, ...``.

    One gather and one scatter per tensor: the sources are read whole before any destination
    is written, so an overlap cannot corrupt (and a node's index is never below its depth)."""
    moves = [(base + node, base + d) for d, node in enumerate(path, start=1) if node != d]
    if not moves:
        return
    src = torch.tensor([m[0] for m in moves])
    dst = torch.tensor([m[1] for m in moves])
    for layer in (*cache.k, *cache.v):
        layer[slot, :, dst] = layer[slot, :, src]
