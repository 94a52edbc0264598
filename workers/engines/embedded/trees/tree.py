"""A token tree's layout in a sequence's cache: node order, parents, depths, ancestor maps.

Nodes are numbered breadth first: node 0 is the root (the sequence's last token, at cache
position ``base``), then depth 1's children in rank order, then depth 2's (children of node 1
first), and so on. Node i's K/V is written at scratch position ``base + i``; its rotary
position is ``base + depth(i)``, the position it would have in the sequence, and it attends to
the sequence's positions ``0..base`` and to its ancestors (itself included), read through
``ancestors(i)``. The arithmetic is then a plain decoding step's at that position, key for key
in the same order (``rowgemm.c`` ``rope_attend``, ``llama.Attention``), so a node accepted onto
the sequence has the K/V and logits plain decoding would have given it.

After verification the accepted path's K/V is copied from ``base + node`` to ``base + depth``
(``compaction``): depth-first order never overwrites a node not yet copied, since a node's
index is never below its depth and the path's indices increase.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from policies.tree import TreeShape


@dataclass(frozen=True)
class TreeLayout:
    shape: TreeShape
    parent: tuple[int, ...]  # [node]: its parent's index (-1 for the root)
    depth: tuple[int, ...]  # [node]: 0 for the root
    rank: tuple[int, ...]  # [node]: 1-based rank among its siblings (0 for the root)
    children: tuple[tuple[int, ...], ...]  # [node]: its children in rank order
    level_start: tuple[int, ...]  # [d]: the first node at depth d (d = 0..depth), then the end

    @property
    def size(self) -> int:
        """Nodes including the root: the tokens of the verification row."""
        return len(self.parent)

    def level(self, d: int) -> range:
        """The nodes at depth d, a contiguous range of indices."""
        return range(self.level_start[d], self.level_start[d + 1])

    def ancestors(self, node: int) -> tuple[int, ...]:
        """Node indices at depths 1..depth(node) on the path to ``node`` (itself last)."""
        path: list[int] = []
        while node > 0:
            path.append(node)
            node = self.parent[node]
        return tuple(reversed(path))

    def path_to(self, ranks: tuple[int, ...]) -> tuple[int, ...]:
        """The nodes a verification's accepted ranks (1-based, 0 ends) lead through."""
        node, out = 0, []
        for r in ranks:
            if r == 0:
                break
            node = self.children[node][r - 1]
            out.append(node)
        return tuple(out)


@cache
def layout(shape: TreeShape) -> TreeLayout:
    parent, depth, rank = [-1], [0], [0]
    children: list[list[int]] = [[]]
    level_start = [0, 1]
    frontier = [0]
    for d, k in enumerate(shape.branching, start=1):
        nxt = []
        for node in frontier:
            for r in range(1, k + 1):
                index = len(parent)
                parent.append(node)
                depth.append(d)
                rank.append(r)
                children.append([])
                children[node].append(index)
                nxt.append(index)
        frontier = nxt
        level_start.append(len(parent))
    return TreeLayout(shape, tuple(parent), tuple(depth), tuple(rank), tuple(tuple(c) for c in children),
                      tuple(level_start))


@dataclass(frozen=True)
class TreeRow:
    """How one forward row's new tokens sit in a tree, for the kernels.

    Token l of the row is written at cache position ``start + l`` as always. ``logical[l]`` is
    its position in the sequence (rotary, and how many keys it attends to: ``logical[l] + 1``);
    ``keymap[l]`` the cache positions of its top ``len(keymap[l])`` logical keys, those at
    ``logical[l] - len(keymap[l]) + 1 .. logical[l]`` (its ancestors in the tree, itself last);
    keys below them are read at their own positions. A token with an empty map and
    ``logical == start + l`` is an ordinary one (a real token of the sequence).
    """

    logical: tuple[int, ...]
    keymap: tuple[tuple[int, ...], ...]

    @classmethod
    def for_nodes(cls, tree: TreeLayout, base: int, real: int, nodes: range) -> TreeRow:
        """A row of ``real`` real tokens ending with the root at ``base``, then ``nodes`` (a
        contiguous range of node indices starting right after them, written at ``base + node``).
        The target's verification row is ``real`` tokens then ``range(1, tree.size)``; a draft
        level's row is no real tokens and the level's nodes."""
        logical = [base - real + 1 + t for t in range(real)]
        keymap: list[tuple[int, ...]] = [() for _ in range(real)]
        for node in nodes:
            logical.append(base + tree.depth[node])
            keymap.append(tuple(base + a for a in tree.ancestors(node)))
        return cls(tuple(logical), tuple(keymap))
