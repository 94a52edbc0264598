"""Tree attention (issue #36): one forward of a token tree gives every node the K/V and logits
plain decoding of its root-to-node path gives it, bit for bit, on the one-call kernel (float32
and bfloat16 products) and on the torch path (bfloat16 on oneDNN's prepacked weights); a draft
level's row likewise; a tree row beside an ordinary row changes neither; key maps that would
read out of range are refused before any kernel runs."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from policies.tree import TreeShape
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.kv_cache import CacheBatch, KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.projections import Products, bf16_prepacking_available
from workers.engines.embedded.trees.tree import TreeLayout, TreeRow, layout

REPO = Path(__file__).resolve().parents[3]
KERNEL = rowgemm.load()
SHAPES = ["2", "2+2", "2x2+1", "3x2", "4", "2x2x2"]
# The root's cache position: the tree's keys cross an 8-key block (the kernel's) and a 64-key
# block (the torch path's padded span) above it.
BASE = 61
VARIANTS = ["native-float32", "native-bfloat16-products", "torch-bfloat16-prepacked"]


@functools.cache
def model_for(variant: str) -> LlamaForCausalLM:
    """The demo target as each exact serving path runs it; skips where this CPU cannot."""
    if variant.startswith("native") and KERNEL is None:
        pytest.skip("rowgemm did not build here (no C compiler or no AVX2)")
    if variant == "native-bfloat16-products" and not (KERNEL is not None and KERNEL.dot_products):
        pytest.skip("no bfloat16 products here (no AVX512-BF16)")
    if variant == "torch-bfloat16-prepacked" and not bf16_prepacking_available():
        pytest.skip("this CPU cannot prepack bfloat16 (no AVX512-BF16/AMX)")
    directory = REPO / "models/demo-target"
    if variant == "torch-bfloat16-prepacked":
        model = LlamaForCausalLM.from_pretrained(directory, torch.bfloat16)
        assert model.native is None and model.prepacked
        return model
    products: Products = "bfloat16" if variant == "native-bfloat16-products" else "float32"
    model = LlamaForCausalLM.from_pretrained(directory, torch.float32, True, products)
    assert model.fused is not None
    return model


@dataclass
class Forward:
    """One model's forwards over rows, as the engine runs them (native kernel or torch path)."""

    model: LlamaForCausalLM

    @property
    def native(self) -> bool:
        return self.model.fused is not None

    def cache(self, slots: int = 2) -> KVCache:
        dtype = torch.float32 if self.native else torch.bfloat16
        return KVCache.allocate(self.model.cfg, slots, dtype)

    def rows(self, cache: KVCache, tokens: list[list[int]], slots: list[int], starts: list[int],
             trees: Sequence[TreeRow | None] | None = None) -> list[torch.Tensor]:
        """Every token's logits, row by row ((n, V) each)."""
        width = max(map(len, tokens))
        with torch.inference_mode():
            if self.native:
                assert self.model.fused is not None
                idx = [b * width + c for b, row in enumerate(tokens) for c in range(len(row))]
                logits = self.model.fused.run_rows(tokens, cache.k, cache.v, slots, starts, idx, trees=trees)
            else:
                padded = torch.tensor([row + [0] * (width - len(row)) for row in tokens])
                batch = CacheBatch.build(slots, starts, [len(r) for r in tokens], width, cache.k[0].shape[2],
                                         trees=trees)
                rows = torch.tensor([b for b, row in enumerate(tokens) for _ in row])
                cols = torch.tensor([c for row in tokens for c in range(len(row))])
                logits = self.model.forward_cached(padded, cache, batch, rows, cols)
        return list(torch.split(logits.float(), [len(r) for r in tokens]))


def prompt_and_tokens(tree: TreeLayout, seed: int) -> tuple[list[int], list[int]]:
    """A prompt ending with the root at BASE, and a token for every node (the root's first)."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(5, 4000, (BASE + 1,), generator=gen).tolist()
    return prompt, [prompt[-1], *torch.randint(5, 4000, (tree.size - 1,), generator=gen).tolist()]


def prefilled(run: Forward, prompt: list[int], slot: int = 0) -> KVCache:
    """A cache holding the prompt but its last token (the root) in ``slot``."""
    cache = run.cache()
    run.rows(cache, [prompt[:-1]], [slot], [0])
    return cache


def copy(cache: KVCache) -> KVCache:
    return KVCache([k.clone() for k in cache.k], [v.clone() for v in cache.v])


def kv_at(cache: KVCache, slot: int, position: int) -> list[torch.Tensor]:
    return [t[slot, :, position] for t in (*cache.k, *cache.v)]


def plain_paths(run: Forward, tree: TreeLayout, tokens: list[int], start: KVCache, slot: int = 0
                ) -> dict[int, tuple[torch.Tensor, list[torch.Tensor]]]:
    """Each node's logits and K/V when its root-to-node path is decoded one token at a time,
    from the root at BASE (in a copy of ``start`` per leaf)."""
    out: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
    leaves = [n for n in range(tree.size) if not tree.children[n]]
    for leaf in leaves:
        cache = copy(start)
        for depth, node in enumerate((0, *tree.ancestors(leaf))):
            logits = run.rows(cache, [[tokens[node]]], [slot], [BASE + depth])[0][0]
            out.setdefault(node, (logits, kv_at(cache, slot, BASE + depth)))
    return out


def assert_node_matches(node: int, logits: torch.Tensor, kv: list[torch.Tensor],
                        plain: dict[int, tuple[torch.Tensor, list[torch.Tensor]]]) -> None:
    want_logits, want_kv = plain[node]
    assert torch.equal(logits, want_logits), f"node {node}: logits differ from plain decoding"
    assert all(torch.equal(a, b) for a, b in zip(kv, want_kv, strict=True)), f"node {node}: K/V differ"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_tree_verified_in_one_forward_is_plain_decoding_of_each_path(variant: str, shape: str) -> None:
    run = Forward(model_for(variant))
    tree = layout(TreeShape.parse(shape))
    prompt, tokens = prompt_and_tokens(tree, seed=len(shape))
    start = prefilled(run, prompt)
    plain = plain_paths(run, tree, tokens, start)
    cache = copy(start)
    row = TreeRow.for_nodes(tree, BASE, 1, range(1, tree.size))
    logits = run.rows(cache, [tokens], [0], [BASE], [row])[0]
    for node in range(tree.size):
        assert_node_matches(node, logits[node], kv_at(cache, 0, BASE + node), plain)


@pytest.mark.parametrize("shape", ["2x2+1", "3x2", "+3"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_draft_levels_fed_one_forward_each_are_plain_decoding(variant: str, shape: str) -> None:
    """How a draft grows a tree: the root decoded, then each level's nodes in a row of their own."""
    run = Forward(model_for(variant))
    tree = layout(TreeShape.parse(shape))
    prompt, tokens = prompt_and_tokens(tree, seed=7)
    start = prefilled(run, prompt)
    plain = plain_paths(run, tree, tokens, start)
    cache = copy(start)
    outs = {0: run.rows(cache, [[tokens[0]]], [0], [BASE])[0][0]}
    for d in range(1, tree.shape.depth + 1):
        level = tree.level(d)
        row = TreeRow.for_nodes(tree, BASE, 0, level)
        logits = run.rows(cache, [[tokens[n] for n in level]], [0], [BASE + level.start], [row])[0]
        outs.update({n: logits[i] for i, n in enumerate(level)})
    for node in range(tree.size):
        assert_node_matches(node, outs[node], kv_at(cache, 0, BASE + node), plain)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_tree_row_beside_an_ordinary_row_changes_neither(variant: str) -> None:
    """A batch of a tree row (slot 1) and an ordinary row of three tokens (slot 0): each row's
    logits and cache are what it gets in a forward alone."""
    run = Forward(model_for(variant))
    tree = layout(TreeShape.parse("2x2+1"))
    prompt, tokens = prompt_and_tokens(tree, seed=3)
    other = [11, 12, 13]
    start = run.cache()
    run.rows(start, [prompt[:40], prompt[:-1]], [0, 1], [0, 0])
    row = TreeRow.for_nodes(tree, BASE, 1, range(1, tree.size))
    alone = copy(start)
    tree_alone = run.rows(alone, [tokens], [1], [BASE], [row])[0]
    other_alone = run.rows(alone, [other], [0], [40])[0]
    both = copy(start)
    together = run.rows(both, [other, tokens], [0, 1], [40, BASE], [None, row])
    assert torch.equal(together[0], other_alone) and torch.equal(together[1], tree_alone)
    assert all(torch.equal(a, b) for a, b in zip(both.k + both.v, alone.k + alone.v, strict=True))


@pytest.mark.parametrize("variant", VARIANTS)
def test_key_maps_out_of_range_are_refused_before_any_kernel_runs(variant: str) -> None:
    run = Forward(model_for(variant))
    cache = run.cache()
    before = [t.clone() for t in cache.k]
    positions = cache.k[0].shape[2]
    bad = {
        "past the positions written": TreeRow((5, 6), ((), (5, 9))),
        "negative": TreeRow((5, 6), ((), (-1, 6))),
        "past the cache": TreeRow((5, 6), ((), (5, positions))),
        "logical past the rotary table": TreeRow((5, positions + 3), ((), (5, 6))),
        "more keys than logical positions": TreeRow((5, 1), ((), (3, 4, 5))),
        "deeper than MAX_TREE_DEPTH": TreeRow((5, 14), ((), tuple(range(-3, 6)))),
        "prefix past the positions written": TreeRow((5, 40), ((), (6,))),
        "one entry short": TreeRow((5,), ((),)),
    }
    for reason, row in bad.items():
        with pytest.raises(ValueError):
            run.rows(cache, [[7, 8]], [0], [5], [row])
            pytest.fail(reason)
    assert all(torch.equal(a, b) for a, b in zip(cache.k, before, strict=True))


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_tree_rows_in_one_forward_are_each_alone(variant: str) -> None:
    """Two sequences' trees of different shapes at different depths of context, in one batch."""
    run = Forward(model_for(variant))
    shapes = [layout(TreeShape.parse(s)) for s in ("3x2", "2+2")]
    (prompt0, tokens0), (prompt1, tokens1) = (prompt_and_tokens(t, seed=11 + i) for i, t in enumerate(shapes))
    start = run.cache()
    run.rows(start, [prompt0[:-1], prompt1[:30]], [0, 1], [0, 0])
    rows = [TreeRow.for_nodes(shapes[0], BASE, 1, range(1, shapes[0].size)),
            TreeRow.for_nodes(shapes[1], 30, 1, range(1, shapes[1].size))]
    tokens = [tokens0, [prompt1[30], *tokens1[1:]]]
    alone = copy(start)
    each = [run.rows(alone, [tokens[b]], [b], [(BASE, 30)[b]], [rows[b]])[0] for b in range(2)]
    both = copy(start)
    together = run.rows(both, tokens, [0, 1], [BASE, 30], rows)
    assert all(torch.equal(a, b) for a, b in zip(together, each, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(both.k + both.v, alone.k + alone.v, strict=True))


@pytest.mark.parametrize("variant", ["native-float32", "native-bfloat16-products"])
def test_forward_cached_with_trees_runs_the_one_call_kernel(variant: str) -> None:
    """A native model's ``forward_cached`` given a batch with trees: ``run_rows``'s bits."""
    run = Forward(model_for(variant))
    tree = layout(TreeShape.parse("2x2+1"))
    prompt, tokens = prompt_and_tokens(tree, seed=5)
    start = prefilled(run, prompt)
    row = TreeRow.for_nodes(tree, BASE, 1, range(1, tree.size))
    via_rows = copy(start)
    want = run.rows(via_rows, [tokens], [0], [BASE], [row])[0]
    cache = copy(start)
    batch = CacheBatch.build([0], [BASE], [tree.size], tree.size, cache.k[0].shape[2], trees=[row])
    with torch.inference_mode():
        got = run.model.forward_cached(torch.tensor([tokens]), cache, batch)[0]
        last = run.model.forward_cached(torch.tensor([tokens]), copy(start), batch, torch.tensor([0, 0]),
                                        torch.tensor([3, tree.size - 1]))
    assert torch.equal(got, want) and torch.equal(last, want[[3, tree.size - 1]])
    assert all(torch.equal(a, b) for a, b in zip(cache.k + cache.v, via_rows.k + via_rows.v, strict=True))


@pytest.mark.parametrize("threads", [2, 3])
def test_a_tree_forward_split_across_threads_is_one_threads_bits(threads: int) -> None:
    run = Forward(model_for("native-float32"))
    kernel = run.model.native  # the model's own (its pool is the library's)
    assert kernel is not None
    tree = layout(TreeShape.parse("2x2x2"))
    prompt, tokens = prompt_and_tokens(tree, seed=9)
    start = prefilled(run, prompt)
    row = TreeRow.for_nodes(tree, BASE, 1, range(1, tree.size))
    outs = []
    for n in (1, threads):
        kernel.set_threads(n)
        try:
            cache = copy(start)
            outs.append((run.rows(cache, [tokens, [5, 6, 7]], [0, 1], [BASE, 3], [row, None]), cache))
        finally:
            kernel.set_threads(1)
    (one, one_cache), (many, many_cache) = outs
    assert all(torch.equal(a, b) for a, b in zip(one, many, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(one_cache.k + one_cache.v, many_cache.k + many_cache.v, strict=True))
