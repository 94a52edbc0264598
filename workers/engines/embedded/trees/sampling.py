"""Drafting a token tree's children and verifying the tree exactly (issue #36).

Tensors in, tensors out; no engine state. A tree's nodes follow ``tree.TreeLayout`` (breadth
first, node 0 the root, children in rank order). Four ways to draft the children of a node,
each with its verification rule, chosen by the request's sampling parameters:

* greedy (temperature 0): the draft's top-k tokens by logit; the level accepts the child equal
  to the target's argmax, else emits that argmax. Token for token plain greedy decoding.
* seeded (a seed, temperature > 0): the top-k tokens of log q + G, G the Gumbel noise of that
  output position (``sampling.gumbel_max``), so rank 1 is the draft's own Gumbel-max token;
  the level accepts the child equal to the target's Gumbel-max token with the same noise, else
  emits it. Token for token plain seeded decoding, whatever the children.
* sampled (unseeded, temperature > 0): k tokens drawn from q without replacement; verified by
  Sequoia's rule (Chen et al. 2024, "Sequoia", sampling without replacement), see
  ``_verify_sampled``. Exactly the target's distribution.
* point masses (unseeded, temperature > 0, "top_k"): the draft's k most probable tokens as
  deterministic proposals; verified by the rule SpecInfer (Miao et al. 2024) gives for
  deterministic proposals, see ``_verify_point_masses``. Exactly the target's distribution.

A level's draft for a batch of nodes is a ``Children``; ``TreeDrafts.from_levels`` lays them
out per node; ``verify_trees`` verifies B sequences sharing a layout, a level at a time. The
engine's tree steps use the one-sequence form: ``draft_children`` a node at a time, recording
into ``TreeProposals``, then ``verify_tree``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch

from policies.tree import StepPath
from workers.engines.embedded.sampling import SamplingParams, probabilities, sample
from workers.engines.embedded.trees.tree import TreeLayout

__all__ = ["Children", "Mode", "NoiseAt", "TreeDrafts", "TreeProposals", "TreeVerdict", "TreeVerdicts",
           "draft_children", "draft_greedy", "draft_sampled", "draft_seeded", "draft_top_k", "mode_of", "verify_tree",
           "verify_trees"]

Mode = Literal["greedy", "seeded", "sampled", "point"]
# noise_at(j): the Gumbel noise of the j-th token from now (j = 0 the first this step emits), (V,)
# shared by the batch or (B, V) one row per sequence (``sampling.seeded_noise``).
NoiseAt = Callable[[int], torch.Tensor]


# -- drafting: the children of a batch of nodes -----------------------------------------------------
@dataclass(frozen=True)
class Children:
    """The children drafted under n nodes, k slots each, in rank order.

    ``count[i]`` children are proposed under node i; it is below k only when the draft has
    fewer than k tokens it could propose (positive mass; finite score). The slots past it hold
    the rank-1 token as filler, so the tree's forward stays the same shape; verification never
    accepts them. ``q[i, r]`` is the distribution rank r + 1 was drawn from (sampled drafts
    only; zero rows for filler slots)."""

    tokens: torch.Tensor  # (n, k) long
    count: torch.Tensor  # (n,) long
    q: torch.Tensor | None = None  # (n, k, V) float32, or None for deterministic proposals


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _fill(tokens: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    slots = torch.arange(tokens.shape[1])[None, :]
    return torch.where(slots < count[:, None], tokens, tokens[:, :1])


def _ranked(scores: torch.Tensor, k: int) -> Children:
    """The k best tokens of each row of ``scores`` (n, V); -inf scores are never proposed.

    The order is a stable descending sort's: ties in index order, torch.argmax's convention (the
    first maximum), so rank 1 is exactly the token plain decoding would pick from the same
    scores. Only the candidates at or above the k-th largest score are sorted (topk's own order
    among ties is unspecified): a full sort of the vocabulary per node cost a third of a tree
    step at batch 1 on the demo models."""
    if not 1 <= k <= scores.shape[-1]:
        raise ValueError(f"k = {k} children from a vocabulary of {scores.shape[-1]}")
    kth = torch.topk(scores, k, dim=-1).values[:, -1:]
    order = torch.empty(scores.shape[0], k, dtype=torch.long)
    values = torch.empty(scores.shape[0], k, dtype=scores.dtype)
    at_least = scores >= kth
    exact = at_least.sum(dim=-1) == k
    # Rows with exactly k candidates (the usual case) all at once: each row's in index order, then
    # the same stable sort; rows with ties at the k-th score one at a time.
    rows = exact.nonzero().squeeze(1)
    if len(rows):
        candidates = at_least[rows].nonzero()[:, 1].reshape(-1, k)  # row-major: each row's in index order
        ranked = torch.sort(scores[rows].gather(1, candidates), dim=-1, descending=True, stable=True)
        order[rows], values[rows] = candidates.gather(1, ranked.indices), ranked.values
    for row in (~exact).nonzero().squeeze(1).tolist():
        candidates = at_least[row].nonzero().squeeze(1)  # in index order
        ranked = torch.sort(scores[row][candidates], descending=True, stable=True)
        order[row], values[row] = candidates[ranked.indices[:k]], ranked.values[:k]
    count = torch.isfinite(values).sum(dim=-1)
    return Children(_fill(order, count), count)


def draft_greedy(logits: torch.Tensor, k: int) -> Children:
    """Temperature 0: the draft's top-k tokens by logit (..., V); rank 1 is its argmax."""
    return _ranked(_rows(logits).float(), k)


def draft_seeded(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor, k: int) -> Children:
    """Seeded: the top-k of log q + G, q = ``probabilities(logits, params)``, G the noise of the
    children's output position ((V,) or one row per node). Rank 1 is ``gumbel_max``'s token."""
    scores = torch.log(probabilities(_rows(logits), params)) + noise.float()
    return _ranked(scores, k)


def draft_top_k(q: torch.Tensor, k: int) -> Children:
    """Point masses: the k most probable tokens of the draft's distribution q (..., V), only
    tokens of positive mass (fewer when q has fewer)."""
    q = _rows(q).float()
    return _ranked(torch.where(q > 0, q, float("-inf")), k)


def draft_sampled(q: torch.Tensor, k: int, generator: torch.Generator) -> Children:
    """k tokens drawn from q (..., V) without replacement: draw, zero that token, renormalise,
    draw again. ``q[:, r]`` is the distribution rank r + 1 was drawn from (q without ranks
    1..r, renormalised), which verification needs. Rows with fewer than k tokens of positive
    mass propose only those."""
    rest = _rows(q).float().clone()
    n, vocab = rest.shape
    if not 1 <= k <= vocab:
        raise ValueError(f"k = {k} children from a vocabulary of {vocab}")
    tokens = torch.zeros(n, k, dtype=torch.long)
    dists = torch.zeros(n, k, vocab)
    count = torch.zeros(n, dtype=torch.long)
    for r in range(k):
        mass = rest.sum(dim=-1)
        alive = (mass > 0).nonzero().squeeze(1)
        if alive.numel() == 0:
            break
        dist = rest[alive] / mass[alive, None]
        drawn = sample(dist, generator)
        tokens[alive, r] = drawn
        dists[alive, r] = dist
        count[alive] += 1
        rest[alive, drawn] = 0.0  # without replacement: a rejected sibling can't come back
    return Children(_fill(tokens, count), count, dists)


# -- a tree's drafts, per node -------------------------------------------------------------------
@dataclass(frozen=True)
class TreeDrafts:
    """A tree's drafts for B sequences, per node of the layout (column 0, the root, unused).

    ``tokens[b, i]``: node i's token; ``count[b, i]``: the children proposed under node i (the
    layout's number or fewer, see ``Children``); ``q[b, i]``: the distribution node i was drawn
    from (its parent's q_r, r its rank), None for deterministic proposals (greedy, seeded,
    point masses)."""

    tokens: torch.Tensor  # (B, N+1) long
    count: torch.Tensor  # (B, N+1) long
    q: torch.Tensor | None = None  # (B, N+1, V) float32

    @classmethod
    def from_levels(cls, tree: TreeLayout, levels: Sequence[Children], batch: int = 1) -> TreeDrafts:
        """``levels[d]``: the children drafted under the nodes at depth d, their rows sequence
        major (``batch`` times the level's nodes, in node order), ``branching[d]`` slots each."""
        if len(levels) != tree.shape.depth:
            raise ValueError(f"{len(levels)} levels for a tree of depth {tree.shape.depth}")
        sampled = {lv.q is not None for lv in levels}
        if len(sampled) != 1:
            raise ValueError("every level is sampled or none is")
        tokens = torch.zeros(batch, tree.size, dtype=torch.long)
        count = torch.zeros(batch, tree.size, dtype=torch.long)
        first_q = levels[0].q
        q = torch.zeros(batch, tree.size, first_q.shape[-1]) if first_q is not None else None
        for d, lv in enumerate(levels):
            parents, kids = tree.level(d), tree.level(d + 1)
            if tuple(lv.tokens.shape) != (batch * len(parents), tree.shape.branching[d]):
                raise ValueError(f"level {d}: tokens {tuple(lv.tokens.shape)} for {batch} x {len(parents)} "
                                 f"nodes of {tree.shape.branching[d]} children")
            # The layout puts a node's children contiguously, parents in order: a level's
            # (parents, k) slots are the next depth's node range as is.
            tokens[:, kids.start:kids.stop] = lv.tokens.reshape(batch, len(kids))
            count[:, parents.start:parents.stop] = lv.count.reshape(batch, len(parents))
            if q is not None and lv.q is not None:
                q[:, kids.start:kids.stop] = lv.q.reshape(batch, len(kids), -1)
        return cls(tokens, count, q)


# -- verification --------------------------------------------------------------------------------
def mode_of(params: SamplingParams, sampled: bool) -> Mode:
    """The rule a request's parameters call for; ``sampled``: the unseeded drafts were drawn
    (``draft_sampled``) rather than taken as point masses (``draft_top_k``)."""
    if params.temperature <= 0.0:
        return "greedy"
    if params.seed is not None:
        return "seeded"
    return "sampled" if sampled else "point"


def _verify_sampled(p: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor, valid: torch.Tensor,
                    generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequoia's rule for children drawn without replacement, m levels at once.

    p (m, V) the target's distribution, tokens (m, k), q (m, k, V) the q_r each child was drawn
    from, valid (m, k). For r = 1..k: accept c_r with probability min(1, p(c_r)/q_r(c_r)); on
    rejection p <- norm(max(p - q_r, 0)); all rejected: draw from the last p. Exact by
    induction on k, as in Sequoia's proof for sampling without replacement: if what follows
    a rejection emits the residual p', the level emits min(p, q_r) + (sum max(q_r - p, 0)) p'
    = p, for any q_r the child was really drawn from -- so the q_{r+1} tested at rank r + 1
    must be q_r without c_r, renormalised, the distribution that child was drawn from.
    Returns the accepted rank (0: none) and the emitted token."""
    m, k = tokens.shape
    uniforms = torch.rand(m, k, generator=generator)
    rank = torch.zeros(m, dtype=torch.long)
    for r in range(k):
        still = (rank == 0) & valid[:, r]
        child = tokens[:, r:r + 1]
        q_r = q[:, r]
        # u < p/q without a division (q_r(c_r) > 0 for a drawn child, but not for filler).
        accept = still & (uniforms[:, r] * q_r.gather(1, child)[:, 0] < p.gather(1, child)[:, 0])
        rank[accept] = r + 1
        reject = still & ~accept
        residual = (p - q_r).clamp(min=0.0)
        total = residual.sum(dim=-1, keepdim=True)
        # Zero residual mass means p == q_r, where c_r is accepted with probability 1: the
        # rejection came from rounding (an O(eps) event), so any distribution keeps the rule
        # exact to rounding; p itself keeps the draw in the target's support (as sampling.verify).
        after = torch.where(total > 0, residual / total.clamp(min=torch.finfo(p.dtype).tiny), p)
        p = torch.where(reject[:, None], after, p)
    return rank, _emit(rank, tokens, p, generator)


def _verify_point_masses(p: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor,
                         generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic proposals (SpecInfer's rule with point-mass drafts, q_r = one-hot(c_r)):
    accept c_r with probability p(c_r); on rejection p <- p with c_r zeroed, renormalised; all
    rejected: draw from the last p. The level is then a draw from p asked one token at a time
    (is it c_1? else is it c_2? ...): c_r comes out with prod_{s<r}(1 - p_s(c_s)) p_r(c_r) =
    p(c_r), the rest as p restricted to the other tokens. p is kept unnormalised: accept iff
    u * sum(p) < p(c_r). A rejection leaves positive mass (p(c_r) < sum(p)), so the final draw
    always has some."""
    m, k = tokens.shape
    uniforms = torch.rand(m, k, generator=generator)
    rank = torch.zeros(m, dtype=torch.long)
    for r in range(k):
        still = (rank == 0) & valid[:, r]
        child = tokens[:, r:r + 1]
        accept = still & (uniforms[:, r] * p.sum(dim=-1) < p.gather(1, child)[:, 0])
        rank[accept] = r + 1
        reject = still & ~accept
        p = torch.where(reject[:, None], p.scatter(1, child, 0.0), p)
    return rank, _emit(rank, tokens, p, generator)


def _emit(rank: torch.Tensor, tokens: torch.Tensor, residual: torch.Tensor,
          generator: torch.Generator) -> torch.Tensor:
    """The accepted child's token, or a draw from the residual where the level rejected all."""
    out = tokens.gather(1, (rank - 1).clamp(min=0)[:, None])[:, 0].clone()
    missed = (rank == 0).nonzero().squeeze(1)
    if missed.numel():
        out[missed] = sample(residual[missed], generator)
    return out


def _target_token(mode: Mode, logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor | None,
                  generator: torch.Generator | None) -> torch.Tensor:
    """The token plain decoding emits from the target's logits (m, V): argmax, Gumbel-max with
    the position's noise, or a draw from p."""
    if mode == "greedy":
        return logits.argmax(dim=-1)
    if mode == "seeded":
        assert noise is not None
        return (torch.log(probabilities(logits, params)) + noise).argmax(dim=-1)
    assert generator is not None
    return sample(probabilities(logits, params), generator)


class TreeVerdict(NamedTuple):
    """One sequence's verdict; unpacks as ``tokens, ranks``."""

    tokens: list[int]  # the accepted children's tokens, then one target token (replacement or bonus)
    ranks: tuple[int, ...]  # the rank accepted per level tested, 0 where a level rejected every child


@dataclass(frozen=True)
class TreeVerdicts:
    """B sequences' verdicts: ``tokens[b, :length[b]]`` emitted, ``ranks[b, :levels[b]]`` the
    path (-1 past either end)."""

    tree: TreeLayout
    tokens: torch.Tensor  # (B, depth + 1) long
    ranks: torch.Tensor  # (B, depth) long

    @property
    def length(self) -> torch.Tensor:
        return (self.tokens >= 0).sum(dim=1)

    def verdict(self, b: int) -> TreeVerdict:
        ranks = tuple(r for r in self.ranks[b].tolist() if r >= 0)
        return TreeVerdict([t for t in self.tokens[b].tolist() if t >= 0], ranks)

    def path(self, b: int) -> StepPath:
        return StepPath(self.tree.shape, self.verdict(b).ranks)


def verify_trees(tree: TreeLayout, draft: TreeDrafts, target_logits: torch.Tensor, params: SamplingParams, *,
                 generator: torch.Generator | None = None, noise_at: NoiseAt | None = None) -> TreeVerdicts:
    """Verifies B sequences' trees (one layout): from the root, each node's children are tested
    by the rule ``mode_of(params, draft.q is not None)`` names; on acceptance the walk moves to
    that child, else the level's replacement ends it; a leaf emits the bonus token from its row.

    target_logits (B, N+1, V): row i is the target's logits for the token after node i (root
    row 0). ``generator``: unseeded sampling's randomness; ``noise_at``: seeded requests' noise
    (children of depth-d nodes use noise_at(d), the bonus after depth D noise_at(D)). Per level
    the work is a few (m, V) tensor ops for the m sequences still walking."""
    mode = mode_of(params, draft.q is not None)
    if mode in ("sampled", "point") and generator is None:
        raise ValueError("unseeded sampling needs a generator")
    if mode == "seeded" and noise_at is None:
        raise ValueError("seeded sampling needs noise_at")
    if mode in ("greedy", "seeded"):
        return _verify_matching(tree, draft, target_logits, params, noise_at)
    batch = draft.tokens.shape[0]
    depth = tree.shape.depth
    out = torch.full((batch, depth + 1), -1, dtype=torch.long)
    ranks = torch.full((batch, depth), -1, dtype=torch.long)
    node = torch.zeros(batch, dtype=torch.long)
    walking = torch.arange(batch)
    for d in range(depth + 1):
        if walking.numel() == 0:
            break
        at = node[walking]
        logits = target_logits[walking, at].float()
        if d == depth:  # at a leaf: the bonus token
            out[walking, d] = _target_token(mode, logits, params, None, generator)
            break
        k = tree.shape.branching[d]
        kids = (tree.level_start[d + 1] + (at - tree.level_start[d]) * k)[:, None] + torch.arange(k)
        tokens = draft.tokens[walking[:, None], kids]
        valid = torch.arange(k)[None, :] < draft.count[walking, at][:, None]
        if mode == "sampled":
            assert draft.q is not None and generator is not None
            q = draft.q[walking[:, None], kids].float()
            rank, emitted = _verify_sampled(probabilities(logits, params), tokens, q, valid, generator)
        else:
            assert generator is not None
            rank, emitted = _verify_point_masses(probabilities(logits, params), tokens, valid, generator)
        ranks[walking, d] = rank
        out[walking, d] = emitted
        accepted = rank > 0
        node[walking[accepted]] = kids[accepted, rank[accepted] - 1]
        walking = walking[accepted]
    return TreeVerdicts(tree, out, ranks)


# -- one sequence, a node at a time (the engine's tree steps) ---------------------------------------
@dataclass
class TreeProposals:
    """One sequence's drafts in a step, per parent node: the ``Children`` (n = 1) drafted under
    it, as ``draft_children`` records them. ``style``: how an unseeded sampled request drafts,
    "sampled" (without replacement, Sequoia's rule) or "point" (the top k, point masses)."""

    by_parent: dict[int, Children] = field(default_factory=dict)
    style: Literal["sampled", "point"] = "sampled"


def draft_children(logits: torch.Tensor, k: int, params: SamplingParams, generator: torch.Generator,
                   noise: torch.Tensor | None, proposals: TreeProposals, parent: int) -> list[int]:
    """The children of ``parent`` from the draft's logits there (V,), recorded in ``proposals``:
    greedy at temperature 0, seeded with ``noise`` (the children's position's), else as
    ``proposals.style`` says. Returns the proposed tokens, rank order (fewer than k only when
    the draft has fewer tokens of positive mass; the slots left are never accepted)."""
    if params.temperature <= 0.0:
        children = draft_greedy(logits, k)
    elif params.seed is not None:
        if noise is None:
            raise ValueError("a seeded request drafts with its noise")
        children = draft_seeded(logits, params, noise, k)
    elif proposals.style == "point":
        children = draft_top_k(probabilities(_rows(logits), params), k)
    else:
        children = draft_sampled(probabilities(_rows(logits), params), k, generator)
    proposals.by_parent[parent] = children
    return children.tokens[0, :int(children.count[0])].tolist()


def verify_tree(tree: TreeLayout, tokens: Sequence[int] | torch.Tensor, target_logits: torch.Tensor,
                proposals: TreeProposals, params: SamplingParams, generator: torch.Generator | None = None,
                noise_at: Callable[[int, int], torch.Tensor] | None = None) -> TreeVerdict:
    """One sequence's tree: ``tokens[i]`` node i's token (the root's unused), target_logits
    (N+1, V) row i the target's for the token after node i, ``proposals`` as ``draft_children``
    recorded them (a node without an entry proposed no children), noise_at(j, V) the seeded
    noise of the j-th token from now. See ``verify_trees``."""
    vocab = target_logits.shape[-1]
    if params.temperature <= 0.0 or params.seed is not None:
        return _walk_matching(tree, list(tokens), target_logits, proposals, params, noise_at)
    node_tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(1, tree.size)
    count = torch.zeros(1, tree.size, dtype=torch.long)
    sampled = any(c.q is not None for c in proposals.by_parent.values())
    q = torch.zeros(1, tree.size, vocab) if sampled else None
    for parent, children in proposals.by_parent.items():
        kids = tree.children[parent]
        count[0, parent] = min(int(children.count[0]), len(kids))
        if q is not None and children.q is not None:
            q[0, list(kids)] = children.q[0, :len(kids)]
    noise = None if noise_at is None else (lambda j: noise_at(j, vocab))
    verdicts = verify_trees(tree, TreeDrafts(node_tokens, count, q), target_logits.reshape(1, tree.size, vocab),
                            params, generator=generator, noise_at=noise)
    return verdicts.verdict(0)


def _verify_matching(tree: TreeLayout, draft: TreeDrafts, target_logits: torch.Tensor, params: SamplingParams,
                     noise_at: NoiseAt | None) -> TreeVerdicts:
    """``verify_trees`` for greedy and seeded trees: each sequence's path by ``_match_path``."""
    batch, depth = draft.tokens.shape[0], tree.shape.depth
    out = torch.full((batch, depth + 1), -1, dtype=torch.long)
    ranks = torch.full((batch, depth), -1, dtype=torch.long)
    for b in range(batch):
        def noise_of(j: int, b: int = b) -> torch.Tensor:
            assert noise_at is not None
            noise = noise_at(j)
            return noise[b] if noise.dim() == 2 else noise
        verdict = _match_path(tree, draft.tokens[b].tolist(), draft.count[b].tolist(), target_logits[b], params,
                              noise_of if noise_at is not None else None)
        out[b, :len(verdict.tokens)] = torch.tensor(verdict.tokens)
        ranks[b, :len(verdict.ranks)] = torch.tensor(verdict.ranks, dtype=torch.long)
    return TreeVerdicts(tree, out, ranks)


def _walk_matching(tree: TreeLayout, tokens: Sequence[int], target_logits: torch.Tensor, proposals: TreeProposals,
                   params: SamplingParams, noise_at: Callable[[int, int], torch.Tensor] | None) -> TreeVerdict:
    """``verify_tree`` for greedy and seeded trees: ``_match_path`` on the proposals' counts."""
    count = [0] * tree.size
    for parent, children in proposals.by_parent.items():
        count[parent] = int(children.count[0])
    vocab = target_logits.shape[-1]
    return _match_path(tree, list(tokens), count, target_logits, params,
                       None if noise_at is None else (lambda j: noise_at(j, vocab)))


def _match_path(tree: TreeLayout, tokens: Sequence[int], count: Sequence[int], target_logits: torch.Tensor,
                params: SamplingParams, noise_of: Callable[[int], torch.Tensor] | None) -> TreeVerdict:
    """Greedy and seeded, one sequence, in plain Python along the path (the batched level
    bookkeeping cost a tree step ten times its forwards at batch 1 on the demo models): at each
    node reached, the token plain decoding emits there (``_target_token``: the argmax, or the
    Gumbel-max token with the noise of the j-th token from now, ``noise_of(j)``) is accepted if
    a child equals it (children are distinct: at most one does), else emitted, ending the path;
    at a leaf it is the bonus. ``count[i]``: the children proposed under node i (``Children``).
    target_logits (N+1, V)."""
    mode: Mode = "greedy" if params.temperature <= 0.0 else "seeded"
    argmax: list[int] = target_logits.argmax(dim=-1).tolist() if mode == "greedy" else []
    node, out, ranks = 0, [], []
    for d in range(tree.shape.depth + 1):
        if mode == "greedy":
            target = argmax[node]
        else:
            assert noise_of is not None
            target = int(_target_token(mode, target_logits[node:node + 1].float(), params, noise_of(d).float(),
                                       None)[0])
        out.append(target)
        if d == tree.shape.depth:
            break
        kids = tree.children[node][:count[node]]
        rank = next((r for r, kid in enumerate(kids, start=1) if tokens[kid] == target), 0)
        ranks.append(rank)
        if rank == 0:
            break
        node = kids[rank - 1]
    return TreeVerdict(out, tuple(ranks))
