"""Token trees on the simulated deployment: rank acceptances, path draws, a tree step's forwards.

Pure: no clock, no I/O. docs/sim.md ("Token trees") has the derivation and its limits.

**Acceptance.** A published deployment (1B draft, 70B target) measured 76.2% acceptance with a
5-token chain and 84.8% with a token tree on the same prompts (acceptance = accepted drafts per
step / depth). Rank 1 is the chain's draft, so ``beta_1`` is the session's per-token α, as
today. Ranks below it are accepted with ``beta_r = α · ρ^(r-1)`` (r ≥ 2) after the ranks above
were rejected: one ratio ρ, the same at every depth and for every α. ρ comes from the two
figures: α of a 5-chain whose acceptance is 0.762 (``alpha_from_rate``: α ≈ 0.91), then the ρ
that makes the assumed published tree, ``2x2+3`` (its shape was not published; depth 5, as
the chain's), reach 0.848 (ρ ≈ 0.71, β₂ ≈ 0.64). The two figures pin β₂ at that one α only;
ρ's use at other α and for ranks 3 and 4 (which ``2x2+3`` never tests) is the model's assumption.

**Step.** A tree of depth D runs D draft forwards, forward d over the level d − 1 nodes (the
root for d = 1: one token, as a chain's), and the target verifies root + nodes tokens in one
row (tree mask). Attention FLOPs stay out, as for chains, so a row of n tree tokens costs the
target what n chain tokens cost.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from policies.tree import MAX_BRANCHING, StepPath, TreeShape, expected_tree_tokens
from workers.api.sim_config import PUBLISHED_K, alpha_from_rate

# The two published figures (issue #36) and the tree shape assumed for the second.
CHAIN_ACCEPTANCE = 0.762  # accepted drafts per step / 5, a chain of PUBLISHED_K
TREE_ACCEPTANCE = 0.848  # accepted drafts per step / depth, a token tree on the same prompts
ASSUMED_TREE = TreeShape.parse("2x2+3")  # not published: depth 5 like the chain, 18 nodes


def acceptance(shape: TreeShape, betas: Sequence[float]) -> float:
    """The published figure's definition: expected accepted drafts per step / depth."""
    return (expected_tree_tokens(shape, [betas]) - 1.0) / shape.depth


def rank_betas(alpha: float, ratio: float) -> tuple[float, ...]:
    """beta_r = α · ρ^(r-1) for ranks 1..MAX_BRANCHING."""
    return tuple(alpha * ratio ** r for r in range(MAX_BRANCHING))


def calibrate(chain: float = CHAIN_ACCEPTANCE, tree: float = TREE_ACCEPTANCE,
              shape: TreeShape = ASSUMED_TREE, k: int = PUBLISHED_K) -> tuple[float, float]:
    """(α, ρ): α of a k-chain with acceptance ``chain``, then the ρ in [0, 1] that brings
    ``shape`` to ``tree`` at that α (bisection; the tree's acceptance rises with ρ)."""
    alpha = alpha_from_rate(chain, k)
    lo, hi = 0.0, 1.0
    if acceptance(shape, rank_betas(alpha, hi)) < tree:
        raise ValueError(f"{shape} cannot reach {tree} at α = {alpha:.4f} even with ρ = 1")
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if acceptance(shape, rank_betas(alpha, mid)) < tree else (lo, mid)
    return alpha, (lo + hi) / 2


CALIBRATED_ALPHA, RANK_RATIO = calibrate()


def betas_for(alpha: float) -> tuple[float, ...]:
    """A session's rank acceptances: its α, then the calibrated ratio's."""
    return rank_betas(alpha, RANK_RATIO)


def sample_path(rng: random.Random, shape: TreeShape, betas: Sequence[float]) -> StepPath:
    """One tree step's verification: at each level the children are tested in rank order, rank r
    accepted with ``betas[r-1]`` after the ranks before it were rejected; a level that rejects
    every child ends the path."""
    ranks: list[int] = []
    last = len(betas) - 1
    for k in shape.branching:
        rank = 0
        for r in range(k):
            if rng.random() < betas[min(r, last)]:
                rank = r + 1
                break
        ranks.append(rank)
        if rank == 0:
            break
    return StepPath(shape, tuple(ranks))


def truncated(shape: TreeShape, depth: int) -> TreeShape | None:
    """The tree's top ``depth`` levels (a step's K cap cuts a tree from below); None at 0. The
    shape itself where it is no deeper (the step loop's usual case: no new shape per step)."""
    if depth <= 0:
        return None
    return shape if depth >= shape.depth else TreeShape(shape.branching[:depth])


def fed_widths(shape: TreeShape | None, k: int) -> tuple[int, ...]:
    """Tokens each of the step's k draft forwards runs over for one sequence: the root, then the
    nodes of each level but the last (a chain: one token per forward)."""
    if shape is None:
        return (1,) * k
    return (1, *shape.level_widths[:k - 1])


def rank1_tests(path: StepPath) -> tuple[int, int]:
    """(tested, accepted) rank-1 children along the path: the per-token α evidence a tree step
    gives (one rank-1 test per level tested)."""
    return len(path.ranks), sum(1 for r in path.ranks if r == 1)
