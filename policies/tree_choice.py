"""Plain, chain K or token tree T under ``num_speculative_tokens: auto``: the per-session rank
acceptances trees are priced with, and the choice among them.

Pure, like the rest of ``policies/``; ``policies.speculation.decide`` calls ``choose_plan``, and
``observe``/``observe_path`` fold steps into the rank table here.

**Rank acceptances.** A session keeps, per depth 1..MAX_TREE_DEPTH and rank 1..MAX_BRANCHING,
β (the chance the child of that rank is accepted given the ranks before it were rejected,
estimated as α is, ``policies.acceptance``: decayed accepted over decayed tests with the
session's ``acceptance_half_life``), its decayed weight and the tests it rests on
(``Ranks``). Every tested child of a tree step counts (``StepPath.tests``); a chain step's drafts
count as rank 1. Pricing reads rank 1 as the session's α at every depth (the chain's model:
chains and trees priced on one footing); rank r >= 2 at depth d as measured there once it
rests on ``min_proposals`` tests, else as measured over all depths once those do, else the prior
β_r = ``tree_rank_prior`` × β_(r−1).

**Exploration.** Until the session has ``min_proposals`` rank-2 tests a tree is priced on the
prior, and such a tree is a candidate only every ``tree_explore_every``-th auto request (the
session's ``since_tree``): at most that share of requests runs a tree the session's own evidence
does not back, and only where even the prior says it pays (it must win the choice).

**A tree step's price** (relative to a plain step at the batch depth b, like ``cost.gain``):
the chain of the tree's depth D at b (``step_cost``, or ``mixed_step_cost`` with the draft mix),
plus what the tree adds over that chain. At batch depth 1 that is measured: the target's forward
of N + 1 tokens with the tree mask instead of D + 1 (``tree_verify_cost`` against the chain's
``verify_cost``), a draft forward over each level's width instead of one token for levels
1..D−1 (``tree_draft_cost``; the first, catch-up forward is the chain's), and the per-draft
overhead for N − D more drafts. At b > 1 it is approximated (stated in docs/policy.md): the
batch-1 extra in milliseconds, or the N − D extra tokens of each of the step's g drafting
sequences at the chain curve's marginal token cost at b, whichever is more (a memory-bound
step pays the first, a compute-bound one the second), over a plain step's milliseconds at b.
A worker without tree costs (or without the parts, or ``tree_max_nodes`` 0) is priced as chains only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from policies.acceptance import decayed_fold
from policies.config import PolicyConfig
from policies.cost import CostModel, StepMix, _between, _verify, choose_k, mixed_step_cost, objective, step_cost
from policies.tree import MAX_BRANCHING, MAX_TREE_DEPTH, StepPath, TreeShape, expected_tree_tokens

# (β, weight, tests) per cell, cell = (depth − 1) × MAX_BRANCHING + rank − 1; () until the first
# test. The weight is the decayed tests β rests on (policies.acceptance), tests the lifetime count.
Ranks = tuple[tuple[float, float, int], ...]
EMPTY_CELL = (0.0, 0.0, 0)
CELLS = MAX_TREE_DEPTH * MAX_BRANCHING
MAX_TESTS = 1 << 30  # a cell's count stops here (stored as JSON; a session never gets near)
Counts = Mapping[int, tuple[int, int]]  # cell -> (tests, accepted) of one step or block


def cell(depth: int, rank: int) -> int:
    return (depth - 1) * MAX_BRANCHING + rank - 1


def path_counts(path: StepPath) -> dict[int, tuple[int, int]]:
    """A tree step's tests by cell (each child is tested at most once per step)."""
    return {cell(d, r): (1, int(ok)) for d, r, ok in path.tests() if d <= MAX_TREE_DEPTH}


def chain_counts(groups: Iterable[tuple[int, int, int]]) -> dict[int, tuple[int, int]]:
    """Chain steps as (proposed, accepted, count) groups: depths 1..accepted passed at rank 1,
    the one after failed (if the chain went on)."""
    out: dict[int, tuple[int, int]] = {}
    for proposed, accepted, count in groups:
        if proposed <= 0 or count <= 0:
            continue
        accepted = max(0, min(accepted, proposed))
        for depth in range(1, min(accepted + (accepted < proposed), MAX_TREE_DEPTH) + 1):
            tests, ok = out.get(cell(depth, 1), (0, 0))
            out[cell(depth, 1)] = (tests + count, ok + count * (depth <= accepted))
    return out


def fold_ranks(ranks: Ranks, counts: Counts, half_life: float) -> Ranks:
    """``counts`` folded into the table as ``observe`` folds α: decayed sums, half-life in tests."""
    if not counts:
        return ranks
    cells = list(ranks) if ranks else [EMPTY_CELL] * CELLS
    for i, (tests, accepted) in counts.items():
        if tests <= 0 or not 0 <= i < CELLS:
            continue
        beta, weight, seen = cells[i]
        beta, weight = decayed_fold(beta, weight if seen else 0.0, tests, max(0, min(accepted, tests)), half_life)
        cells[i] = (beta, weight, min(seen + tests, MAX_TESTS))
    return tuple(cells)


def pooled(ranks: Ranks, rank: int) -> tuple[float, int]:
    """Rank ``rank`` over every depth: β weighted by tests, and the tests."""
    total = weighted = 0.0
    for depth in range(1, MAX_TREE_DEPTH + 1):
        beta, _, tests = ranks[cell(depth, rank)]
        total += tests
        weighted += tests * beta
    return (weighted / total if total else 0.0), int(total)


def evidence(ranks: Ranks) -> int:
    """Rank-2 tests over every depth: what a tree's pricing rests on beyond α."""
    return pooled(ranks, 2)[1] if ranks else 0


def rank_rows(ranks: Ranks, alpha: float, shape: TreeShape, rho: float, need: int) -> list[list[float]]:
    """The β rows ``expected_tree_tokens`` reads for ``shape`` (see the module docstring)."""
    need = max(1, need)
    pooled_rows = {r: pooled(ranks, r) for r in range(2, max(shape.branching) + 1)} if ranks else {}
    rows = []
    for depth, children in enumerate(shape.branching, start=1):
        row = [alpha]
        for rank in range(2, children + 1):
            beta, _, tests = ranks[cell(depth, rank)] if ranks else EMPTY_CELL
            if tests < need:
                beta, tests = pooled_rows.get(rank, (0.0, 0))
            row.append(beta if tests >= need else row[-1] * rho)
        rows.append(row)
    return rows


def view(ranks: Ranks) -> list[dict[str, float | int]]:
    """The cells with evidence, for ``/admin/sessions``."""
    return [{"depth": i // MAX_BRANCHING + 1, "rank": i % MAX_BRANCHING + 1, "beta": round(beta, 4),
             "weight": round(weight, 2), "tests": tests}
            for i, (beta, weight, tests) in enumerate(ranks) if tests > 0]


# -- pricing -----------------------------------------------------------------------------------
def trees_priced(model: CostModel, tree_max_nodes: int) -> bool:
    """The worker can run trees and says what they cost (with the parts chains are priced from)."""
    return model.tree is not None and model.parts is not None and tree_max_nodes > 0


def fits(shape: TreeShape, model: CostModel, max_k: int, tree_max_nodes: int) -> bool:
    """The worker can run ``shape`` and its curves price it (no extrapolation past them)."""
    tree = model.tree
    return (tree is not None and shape.depth <= min(max_k, model.max_k) and shape.nodes <= tree_max_nodes
            and shape.nodes + 1 <= len(tree.verify) and max(shape.level_widths[:-1], default=1) <= len(tree.draft))


def tree_extra(model: CostModel, shape: TreeShape, depth: float, drafting: int) -> float:
    """What ``shape`` adds to the step over the chain of its depth, relative to a plain step at
    ``depth`` (``drafting`` sequences run it; see the module docstring)."""
    parts, tree = model.parts, model.tree
    assert parts is not None and tree is not None
    d, n = shape.depth, shape.nodes
    verify = tree.verify[n] - _verify(parts.verify[0], d + 1)
    draft = sum(tree.draft[w - 1] - parts.draft[0] for w in shape.level_widths[:-1])
    batch_one_ms = max(0.0, parts.plain_ms[0] * (verify + draft) + (n - d) * parts.draft_overhead_ms[0])
    lo, hi, w = _between(model.depths, depth)

    def marginal_ms(i: int) -> float:  # one more token for one sequence, by the chain's verify curve
        row = parts.verify[i]
        slope = (row[-1] - row[0]) / (len(row) - 1) if len(row) > 1 else 0.0
        return parts.plain_ms[i] * max(0.0, slope) / model.depths[i]

    def plain_ms(i: int) -> float:
        return parts.plain_ms[i] + parts.overhead_ms[i]

    marginal = (1 - w) * marginal_ms(lo) + w * marginal_ms(hi)
    extra_ms = max(batch_one_ms, drafting * (n - d) * marginal)
    return extra_ms / ((1 - w) * plain_ms(lo) + w * plain_ms(hi))


def tree_gain(model: CostModel, shape: TreeShape, tokens: float, others: float, depth: int,
              mix: StepMix | None = None) -> float:
    """Tokens per unit of time with ``shape``, relative to plain, as ``cost.gain`` has it for a
    chain: ``tokens`` the session's expected tokens per step, ``others`` those of the mix's
    other drafting sequences (priced running the same tree)."""
    d = shape.depth
    if mix is None:
        group, plain_others = depth, 0
        base, others = step_cost(model, depth, d), tokens
    else:
        depth = max(depth, mix.sequences + 1)
        group = min(mix.drafting + mix.would_draft, depth - 1) + 1
        plain_others = depth - group
        base = mixed_step_cost(model, depth, group, group * d, d)
    cost = base + tree_extra(model, shape, depth, group)
    return ((plain_others + tokens + (group - 1) * others) / cost - plain_others) / group


def choose_plan(model: CostModel, alpha: float, ranks: Ranks, depth: int, max_k: int, tree_max_nodes: int,
                policy: PolicyConfig, current_k: int | None = None, current_tree: TreeShape | None = None,
                explore_due: bool = False, mix: StepMix | None = None) -> tuple[int, TreeShape | None]:
    """(K, tree) maximizing the objective among plain (0, None), every chain K and every tree of
    ``policy.tree_shapes`` this worker runs and prices, with hysteresis.

    A session keeps its current choice unless another's objective is higher by more than
    ``k_switch_gain`` (chain K to chain K, as ``choose_k``) or ``tree_switch_gain`` (to or from a
    tree). Ties go to chains, then to the smaller K. Without trees this is ``choose_k``."""
    shapes: Sequence[TreeShape] = policy.trees
    need = max(1, policy.min_proposals)
    if (not shapes or not trees_priced(model, tree_max_nodes)
            or not (explore_due or evidence(ranks) >= need)):
        return choose_k(model, alpha, depth, max_k, policy.min_gain, policy.k_switch_gain, current_k, mix), None
    values: dict[tuple[int, TreeShape | None], float] = {
        (k, None): objective(model, alpha, k, depth, policy.min_gain, mix)
        for k in range(0, min(max_k, model.max_k) + 1)}
    for shape in shapes:
        if fits(shape, model, max_k, tree_max_nodes):
            values[(shape.depth, shape)] = _tree_value(model, alpha, ranks, depth, shape, policy, mix)
    best = max(values, key=lambda key: (values[key], key[1] is None, -key[0]))
    current = (current_k if current_tree is None else current_tree.depth, current_tree)
    if current_k is not None and current in values:
        margin = policy.k_switch_gain if current[1] is None and best[1] is None else policy.tree_switch_gain
        if values[current] * (1.0 + margin) >= values[best]:
            return current
    return best


def plan_value(model: CostModel, alpha: float, ranks: Ranks, depth: int, k: int, tree: TreeShape | None,
               policy: PolicyConfig, mix: StepMix | None = None) -> float:
    """What ``choose_plan`` maximizes, for one plan: plain (K 0) is 1 + ``min_gain``, a chain its
    gain, a tree its ``tree_gain`` on the session's rank acceptances."""
    if tree is None:
        return objective(model, alpha, k, depth, policy.min_gain, mix)
    return _tree_value(model, alpha, ranks, depth, tree, policy, mix)


def _tree_value(model: CostModel, alpha: float, ranks: Ranks, depth: int, shape: TreeShape, policy: PolicyConfig,
                mix: StepMix | None) -> float:
    need, rho = max(1, policy.min_proposals), policy.tree_rank_prior
    tokens = expected_tree_tokens(shape, rank_rows(ranks, alpha, shape, rho, need))
    others = tokens
    if mix is not None and mix.acceptance is not None:  # the others at the worker's α, on the prior
        others = expected_tree_tokens(shape, rank_rows((), mix.acceptance, shape, rho, need))
    return tree_gain(model, shape, tokens, others, depth, mix)
