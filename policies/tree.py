"""Token trees: their shape, notation and the tokens a step is expected to accept.

Pure, like the rest of ``policies/``. A tree's shape is its branching by level: the draft
proposes ``branching[0]`` children of the last token, each of those ``branching[1]`` children,
and so on; trailing levels of one child make the chain that ends every branch. Written
``2x2+3``: two levels of two children, then a chain of three (every leaf of the top two
levels continues for three more tokens): 2 + 4 + 4 + 4 + 4 = 18 nodes, depth 5.

A chain of K drafts is the shape ``(1,) * K`` (written ``+K``); ``TreeShape.chain(K)``.

Acceptance (issue #36): at each level the children are tested in rank order; ``beta[d][r]``
is the chance the child of rank r + 1 at depth d + 1 is accepted given that the ranks before
it were rejected. A level with k children passes with a = 1 - prod_{r<k}(1 - beta[d][r]),
and a step emits sum_d prod_{j<=d} a_j accepted tokens plus one (the bonus or replacement).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

# Bounds on any shape the engine builds or the gateway accepts in config: a tree's nodes all
# ride in one verification forward, and its depth in the cache's K margin.
MAX_BRANCHING = 4
MAX_TREE_DEPTH = 8
MAX_TREE_NODES = 32

_NOTATION = re.compile(r"^(?:(\d+(?:x\d+)*))?(?:\+(\d+))?$")


class TreeShapeError(ValueError):
    """A shape's text or numbers are out of bounds; the message says which and why."""


@dataclass(frozen=True)
class TreeShape:
    """Children per node at each level, top to bottom; factors > 1 first, then 1s (the chain)."""

    branching: tuple[int, ...]

    def __post_init__(self) -> None:
        b = self.branching
        if not b:
            raise TreeShapeError("a tree needs at least one level")
        if len(b) > MAX_TREE_DEPTH:
            raise TreeShapeError(f"depth {len(b)} is over {MAX_TREE_DEPTH}")
        if any(not 1 <= k <= MAX_BRANCHING for k in b):
            raise TreeShapeError(f"children per node must be in 1..{MAX_BRANCHING} (got {list(b)})")
        first_chain = next((i for i, k in enumerate(b) if k == 1), len(b))
        if any(k != 1 for k in b[first_chain:]):
            raise TreeShapeError(f"branching levels come before the chain (got {list(b)})")
        if self.nodes > MAX_TREE_NODES:
            raise TreeShapeError(f"{self.nodes} nodes is over {MAX_TREE_NODES}")

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """``"2x2+3"`` -> (2, 2, 1, 1, 1); ``"3"`` -> (3,); ``"+4"`` -> a chain of 4."""
        match = _NOTATION.match(text.strip()) if isinstance(text, str) else None
        if match is None or not (match.group(1) or match.group(2)):
            raise TreeShapeError(f"a tree shape is written like 2x2+3 (got {text!r:.40})")
        factors = [int(f) for f in match.group(1).split("x")] if match.group(1) else []
        chain = int(match.group(2)) if match.group(2) else 0
        if any(f < 2 for f in factors):
            raise TreeShapeError(f"branching factors before '+' must be >= 2 (got {text!r:.40})")
        return cls((*factors, *([1] * chain)))

    @classmethod
    def chain(cls, k: int) -> TreeShape:
        return cls((1,) * k)

    def __str__(self) -> str:
        factors = [str(k) for k in self.branching if k > 1]
        chain = sum(1 for k in self.branching if k == 1)
        return "x".join(factors) + (f"+{chain}" if chain else "")

    @property
    def depth(self) -> int:
        return len(self.branching)

    @property
    def is_chain(self) -> bool:
        return all(k == 1 for k in self.branching)

    @cached_property
    def level_widths(self) -> tuple[int, ...]:
        """Nodes at each depth 1..depth."""
        widths, width = [], 1
        for k in self.branching:
            width *= k
            widths.append(width)
        return tuple(widths)

    @property
    def nodes(self) -> int:
        """Draft tokens in the tree (the root, the sequence's last token, not counted)."""
        return sum(self.level_widths)


@functools.lru_cache(maxsize=64)
def parse_shape(text: str) -> TreeShape:
    """``TreeShape.parse``, remembered: the few shapes a deployment runs come back in every
    directive, step report and stored session (a text that is no shape raises every time)."""
    return TreeShape.parse(text)


def level_pass(betas: Sequence[float], k: int) -> float:
    """Chance a level with ``k`` children accepts one of them, from the rank acceptances
    ``betas`` (rank 1 first; ranks past the end take the last one)."""
    if k <= 0:
        return 0.0
    miss = 1.0
    for r in range(k):
        beta = betas[min(r, len(betas) - 1)] if betas else 0.0
        miss *= 1.0 - min(max(beta, 0.0), 1.0)
    return 1.0 - miss


def expected_tree_tokens(shape: TreeShape, betas: Sequence[Sequence[float]]) -> float:
    """Tokens a step with this tree emits on average: sum_d prod_{j<=d} a_j, plus one.

    ``betas[d]``: the rank acceptances at depth d + 1 (depths past the end take the last row).
    A chain of K at a depth-independent α gives ``policies.cost.expected_tokens(α, K)``."""
    total, reach = 1.0, 1.0
    for d, k in enumerate(shape.branching):
        row = betas[min(d, len(betas) - 1)] if betas else ()
        reach *= level_pass(row, k)
        total += reach
    return total


@dataclass(frozen=True)
class StepPath:
    """What one tree (or chain) step's verification did, level by level: the rank (1-based) of
    the child accepted at each level tested, 0 where every child of the level was rejected (the
    last entry then). A chain that accepted n of K is ``[1] * n + ([0] if n < K else [])``."""

    shape: TreeShape
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.ranks) > self.shape.depth:
            raise ValueError(f"a path of {len(self.ranks)} levels in a tree of depth {self.shape.depth}")
        for d, r in enumerate(self.ranks):
            if not 0 <= r <= self.shape.branching[d]:
                raise ValueError(f"rank {r} at depth {d + 1} of a tree with {self.shape.branching[d]} children")
            if r == 0 and d != len(self.ranks) - 1:
                raise ValueError("a rejected level ends the path")
        if len(self.ranks) < self.shape.depth and (not self.ranks or self.ranks[-1] != 0):
            raise ValueError("a path ends at a rejected level or at the tree's depth")

    @property
    def accepted(self) -> int:
        """Draft tokens accepted (levels passed)."""
        return sum(1 for r in self.ranks if r > 0)

    def tests(self) -> list[tuple[int, int, bool]]:
        """Every child tested, as (depth 1-based, rank 1-based, accepted)."""
        out = []
        for d, r in enumerate(self.ranks):
            tested = r if r > 0 else self.shape.branching[d]
            out += [(d + 1, rank, rank == r) for rank in range(1, tested + 1)]
        return out

    @classmethod
    def of_chain(cls, k: int, accepted: int) -> StepPath:
        accepted = max(0, min(accepted, k))
        return cls(TreeShape.chain(k), (1,) * accepted + ((0,) if accepted < k else ()))
