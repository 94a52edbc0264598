"""Token trees' drafting and verification rules (issue #36) on fixed distributions.

The target and the draft are Markov tables by output position: the distribution of the token
at position t given the one before it, ``P[t][prev]`` and ``Q[t][prev]`` (position 0 reads row
0). A node's target row is then what a model would give for that node's context, siblings with
different tokens get different rows, and "plain decoding" is a walk through the table.

Exactness is a chi-square test of many independent steps' first emitted token, and of the first
two tokens (joint; where a step emitted one, the second comes from the next step), against the
target's own p(x1) and p(x1) p(x2 | x1). The same harness must reject deliberately wrong rules,
or it would show nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from policies.tree import StepPath, TreeShape
from workers.engines.embedded.sampling import SamplingParams, gumbel_max, probabilities, seeded_noise
from workers.engines.embedded.trees import sampling as tree_sampling
from workers.engines.embedded.trees.sampling import (
    Children,
    TreeDrafts,
    TreeProposals,
    TreeVerdicts,
    draft_children,
    draft_sampled,
    draft_seeded,
    draft_top_k,
    verify_tree,
    verify_trees,
)
from workers.engines.embedded.trees.tree import TreeLayout, layout

ChiSquare = Callable[[Sequence[int], torch.Tensor], float]
Drafter = Callable[[torch.Tensor, int, torch.Generator], Children]

V = 6
DRAWS = 40_000
SHAPES = ["2", "3", "2x2", "2+1"]
POSITIONS = 5  # deepest tree (2) plus its bonus, then the next step's tree
SAMPLED = SamplingParams(temperature=1.0)


def _tables(seed: int, spread: float = 1.5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(spread * torch.randn(POSITIONS, V, V, generator=gen), dim=-1)


P = _tables(11)
Q = _tables(12)


def _sparse(q: torch.Tensor, keep: int, seed: int) -> torch.Tensor:
    """q with all but ``keep`` random tokens per row zeroed, renormalised."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.rand(q.shape, generator=gen).argsort(dim=-1)
    q = q.scatter(-1, order[..., keep:], 0.0)
    return q / q.sum(dim=-1, keepdim=True)


def _sampled(q: torch.Tensor, k: int, gen: torch.Generator) -> Children:
    return draft_sampled(q, k, gen)


def _point(q: torch.Tensor, k: int, gen: torch.Generator) -> Children:
    return draft_top_k(q, k)


def _original_q(q: torch.Tensor, k: int, gen: torch.Generator) -> Children:
    """WRONG: drawn without replacement, but every rank reports the original q, so the verifier
    tests and subtracts against q rather than against q without the rejected siblings."""
    children = draft_sampled(q, k, gen)
    assert children.q is not None
    return Children(children.tokens, children.count, children.q[:, :1].expand_as(children.q).contiguous())


def step(tree: TreeLayout, start: int, prev: torch.Tensor, drafter: Drafter, gen: torch.Generator,
         p: torch.Tensor = P, q: torch.Tensor = Q) -> TreeVerdicts:
    """One tree step for len(prev) sequences at output position ``start``."""
    batch = prev.shape[0]
    context = torch.zeros(batch, tree.size, dtype=torch.long)
    context[:, 0] = prev
    levels = []
    for d in range(tree.shape.depth):
        parents, kids = tree.level(d), tree.level(d + 1)
        children = drafter(q[start + d][context[:, parents.start:parents.stop].reshape(-1)],
                           tree.shape.branching[d], gen)
        context[:, kids.start:kids.stop] = children.tokens.reshape(batch, -1)
        levels.append(children)
    draft = TreeDrafts.from_levels(tree, levels, batch)
    depth = torch.tensor(tree.depth)
    target_logits = torch.log(p[start + depth[None, :], context])
    return verify_trees(tree, draft, target_logits, SAMPLED, generator=gen)


def first_two(shape: str, drafter: Drafter, seed: int, p: torch.Tensor = P,
              q: torch.Tensor = Q) -> tuple[list[int], list[int]]:
    """DRAWS steps from position 0: the first token, and the first two as x1 * V + x2."""
    tree = layout(TreeShape.parse(shape))
    gen = torch.Generator().manual_seed(seed)
    verdicts = step(tree, 0, torch.zeros(DRAWS, dtype=torch.long), drafter, gen, p, q)
    x1, x2 = verdicts.tokens[:, 0], verdicts.tokens[:, 1].clone()
    short = (verdicts.length < 2).nonzero().squeeze(1)
    x2[short] = step(tree, 1, x1[short], drafter, gen, p, q).tokens[:, 0]
    return x1.tolist(), (x1 * V + x2).tolist()


def joint(p: torch.Tensor = P) -> torch.Tensor:
    return (p[0, 0][:, None] * p[1]).reshape(-1)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("drafter", [_sampled, _point], ids=["sampled", "point"])
def test_emitted_tokens_follow_the_target(shape: str, drafter: Drafter, chi_square: ChiSquare) -> None:
    x1, pair = first_two(shape, drafter, seed=7)
    assert chi_square(x1, P[0, 0]) > 1e-3
    assert chi_square(pair, joint()) > 1e-3


@pytest.mark.parametrize("drafter", [_sampled, _point], ids=["sampled", "point"])
def test_draft_with_fewer_tokens_than_children_stays_exact(drafter: Drafter, chi_square: ChiSquare) -> None:
    sparse = _sparse(Q, keep=2, seed=3)  # 2 tokens of mass under 3 children
    x1, pair = first_two("3", drafter, seed=8, q=sparse)
    assert chi_square(x1, P[0, 0]) > 1e-3
    assert chi_square(pair, joint()) > 1e-3


@pytest.mark.parametrize("shape", ["3", "2x2"])
def test_residual_against_the_original_q_is_rejected(shape: str, chi_square: ChiSquare) -> None:
    x1, _ = first_two(shape, _original_q, seed=7)
    assert chi_square(x1, P[0, 0]) < 1e-6


def _point_masses_not_renormalised(p: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor,
                                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """WRONG: every rank is accepted with its original p(c_r), not p's renormalised rest."""
    m, k = tokens.shape
    uniforms = torch.rand(m, k, generator=generator)
    rank = torch.zeros(m, dtype=torch.long)
    rest = p.clone()
    for r in range(k):
        still = (rank == 0) & valid[:, r]
        child = tokens[:, r:r + 1]
        accept = still & (uniforms[:, r] < p.gather(1, child)[:, 0])
        rank[accept] = r + 1
        rest = torch.where((still & ~accept)[:, None], rest.scatter(1, child, 0.0), rest)
    return rank, tree_sampling._emit(rank, tokens, rest, generator)


@pytest.mark.parametrize("shape", ["3", "2x2"])
def test_point_masses_not_renormalised_are_rejected(shape: str, chi_square: ChiSquare,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tree_sampling, "_verify_point_masses", _point_masses_not_renormalised)
    x1, _ = first_two(shape, _point, seed=7)
    assert chi_square(x1, P[0, 0]) < 1e-6


# -- greedy and seeded: token for token plain decoding --------------------------------------------
def _walk(tree: TreeLayout, draft: TreeDrafts, b: int, plain: list[int]) -> list[int]:
    """The ranks a tree verification must report when plain decoding emits ``plain``."""
    node, ranks = 0, []
    for d in range(tree.shape.depth):
        kids = tree.children[node][:int(draft.count[b, node])]
        hits = [r for r, kid in enumerate(kids, start=1) if int(draft.tokens[b, kid]) == plain[d]]
        ranks.append(hits[0] if hits else 0)
        if not hits:
            break
        node = kids[hits[0] - 1]
    return ranks


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_is_plain_greedy_decoding(shape: str) -> None:
    """The engine's one-sequence path: draft_children node by node, then verify_tree."""
    tree = layout(TreeShape.parse(shape))
    gen = torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0.0)
    # Small integer logits: ties everywhere, so the argmax convention (first maximum) matters.
    target = torch.randint(0, 3, (POSITIONS, V, V), generator=gen).float()
    for trial in range(20):
        draft_logits = torch.randint(0, 3, (POSITIONS, V, V), generator=gen).float()
        for prev in range(V):
            tokens = [prev] + [0] * (tree.size - 1)
            proposals = TreeProposals()
            for node in range(tree.size):
                if tree.children[node]:
                    row = draft_logits[1 + tree.depth[node], tokens[node]]
                    kids = draft_children(row, len(tree.children[node]), greedy, gen, None, proposals, node)
                    assert kids[0] == int(row.argmax())
                    for child, token in zip(tree.children[node], kids, strict=True):
                        tokens[child] = token
            logits = target[1 + torch.tensor(tree.depth), torch.tensor(tokens)]
            emitted, ranks = verify_tree(tree, tokens, logits, proposals, greedy)
            plain, x = [], prev
            for t in range(1, tree.shape.depth + 2):
                x = int(target[t, x].argmax())
                plain.append(x)
            assert emitted == plain[:len(emitted)], (trial, prev)
            drafts = TreeDrafts(torch.tensor([tokens]), torch.tensor([[len(c) for c in tree.children]]))
            assert list(ranks) == _walk(tree, drafts, 0, plain)
            assert len(emitted) == len(tree.path_to(ranks)) + 1
            StepPath(tree.shape, ranks)  # a valid path


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("children", ["seeded", "random"])
def test_seeded_is_plain_seeded_decoding(shape: str, children: str) -> None:
    tree = layout(TreeShape.parse(shape))
    params = SamplingParams(temperature=0.8, seed=1)
    seeds = range(100, 300)
    batch = len(seeds)
    noise = torch.stack([torch.stack([seeded_noise(s, j, V) for j in range(POSITIONS)]) for s in seeds])
    gen = torch.Generator().manual_seed(5)
    context = torch.zeros(batch, tree.size, dtype=torch.long)
    levels = []
    for d in range(tree.shape.depth):
        parents, kids = tree.level(d), tree.level(d + 1)
        rows = torch.log(Q[d][context[:, parents.start:parents.stop].reshape(-1)])
        k = tree.shape.branching[d]
        if children == "seeded":
            level_noise = noise[:, d].repeat_interleave(len(parents), dim=0)
            drafted = draft_seeded(rows, params, level_noise, k)
            assert drafted.tokens[:, 0].tolist() == gumbel_max(rows, params, level_noise)
        else:
            drafted = draft_top_k(torch.rand(rows.shape, generator=gen), k)
        context[:, kids.start:kids.stop] = drafted.tokens.reshape(batch, -1)
        levels.append(drafted)
    draft = TreeDrafts.from_levels(tree, levels, batch)
    logits = torch.log(P[torch.tensor(tree.depth)[None, :], context])
    verdicts = verify_trees(tree, draft, logits, params, noise_at=lambda j: noise[:, j])
    for b in range(batch):
        plain, x = [], 0
        for t in range(tree.shape.depth + 1):
            x = gumbel_max(torch.log(P[t, x])[None], params, noise[b, t][None])[0]
            plain.append(x)
        emitted, ranks = verdicts.verdict(b)
        assert emitted == plain[:len(emitted)]
        assert list(ranks) == _walk(tree, draft, b, plain)
        assert verdicts.path(b).accepted == len(emitted) - 1


# -- edge cases -----------------------------------------------------------------------------------
def test_sampled_children_are_drawn_without_replacement() -> None:
    gen = torch.Generator().manual_seed(0)
    q = Q[0, 0].repeat(500, 1)
    children = draft_sampled(q, 4, gen)
    assert children.q is not None
    assert torch.equal(children.count, torch.full((500,), 4))
    for r in range(4):
        assert torch.allclose(children.q[:, r].sum(dim=-1), torch.ones(500))
        for s in range(r):
            # A sibling drawn (and, if it comes to that, rejected) earlier has no mass at rank r.
            assert (children.q[:, r].gather(1, children.tokens[:, s:s + 1]) == 0).all()
            assert (children.tokens[:, r] != children.tokens[:, s]).all()
    expected = q.scatter(1, children.tokens[:, :1], 0.0)
    assert torch.allclose(children.q[:, 1], expected / expected.sum(dim=-1, keepdim=True))


def test_fewer_tokens_of_mass_than_children() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.tensor([[0.0, 0.7, 0.0, 0.3, 0.0, 0.0]]).repeat(50, 1)
    sampled = draft_sampled(q, 3, gen)
    assert sampled.q is not None
    assert sampled.count.tolist() == [2] * 50
    assert {tuple(sorted(t)) for t in sampled.tokens[:, :2].tolist()} == {(1, 3)}
    assert torch.equal(sampled.tokens[:, 2], sampled.tokens[:, 0])  # filler, never accepted
    assert (sampled.q[:, 2] == 0).all()
    top = draft_top_k(q[:1], 3)
    assert top.count.tolist() == [2] and top.tokens.tolist() == [[1, 3, 1]]
    # The level tests only the two proposed children: the filler slot is never accepted.
    tree = layout(TreeShape.parse("3"))
    draft = TreeDrafts.from_levels(tree, [sampled], 50)
    logits = torch.log(torch.tensor([0.1, 0.2, 0.1, 0.2, 0.2, 0.2])).repeat(50, tree.size, 1)
    verdicts = verify_trees(tree, draft, logits, SAMPLED, generator=gen)
    assert set(verdicts.ranks[:, 0].tolist()) <= {0, 1, 2}


def test_target_equal_to_draft_accepts_every_level() -> None:
    tree = layout(TreeShape.parse("2x2+1"))
    gen = torch.Generator().manual_seed(2)
    verdicts = step(tree, 0, torch.zeros(2000, dtype=torch.long), _sampled, gen, p=Q, q=Q)
    assert (verdicts.ranks == 1).all()  # p == q_1: rank 1 always passes, no residual needed
    assert (verdicts.length == tree.shape.depth + 1).all()


def test_zero_residual_falls_back_to_p() -> None:
    # Rounding can reject a child while max(p - q_r, 0) has no mass; the rule must not divide by
    # zero and must keep drawing from the target's support. q_r = 2p forces that case.
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0]]).repeat(1000, 1)
    tokens = torch.tensor([[0, 1]]).repeat(1000, 1)
    q = (2 * p)[:, None, :].repeat(1, 2, 1)
    rank, emitted = tree_sampling._verify_sampled(p, tokens, q, torch.ones(1000, 2, dtype=torch.bool), gen)
    assert (rank == 0).any() and (rank > 0).any()
    assert set(emitted[rank == 0].tolist()) <= {0, 1}


def test_point_masses_accept_a_sure_child() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0]]).repeat(200, 1)
    tokens = torch.tensor([[1, 2, 3]]).repeat(200, 1)
    rank, emitted = tree_sampling._verify_point_masses(p, tokens, torch.ones(200, 3, dtype=torch.bool), gen)
    assert (rank == 2).all() and (emitted == 2).all()


def test_probabilities_of_log_p_is_p() -> None:
    # The harness feeds log P as logits at temperature 1; the rule then sees P itself.
    assert torch.allclose(probabilities(torch.log(P[0]), SAMPLED), P[0], atol=1e-6)


def test_ranked_children_are_a_stable_descending_sorts_first_k() -> None:
    """The k children of every row, batched or not, ties (at the k-th score, and -inf) included:
    a full stable descending sort's first k, its finite ones counted."""
    gen = torch.Generator().manual_seed(5)
    for trial in range(300):
        rows, vocab = int(torch.randint(1, 30, (1,), generator=gen)), int(torch.randint(2, 10, (1,), generator=gen))
        k = int(torch.randint(1, vocab + 1, (1,), generator=gen))
        scores = torch.randint(-3, 3, (rows, vocab), generator=gen).float() if trial % 2 else torch.randn(rows, vocab)
        scores[torch.rand(rows, vocab, generator=gen) < 0.3] = float("-inf")
        children = tree_sampling._ranked(scores, k)
        ranked = torch.sort(scores, dim=-1, descending=True, stable=True)
        count = torch.isfinite(ranked.values[:, :k]).sum(dim=-1)
        assert torch.equal(children.count, count)
        for row in range(rows):
            n = int(count[row])
            assert children.tokens[row, :n].tolist() == ranked.indices[row, :n].tolist(), (scores[row], k)
