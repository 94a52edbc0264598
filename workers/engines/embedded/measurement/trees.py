"""What token trees cost at batch 1: the start-up measurement behind ``CostReport.tree_verify_cost``
and ``tree_draft_cost`` (policies/tree.py prices a tree from them).

The target's verification of a tree is one forward of a row of n tokens: the root and n - 1
nodes, each attending to the prefix and its ancestors (``tree.TreeRow``); the draft's level is
one forward of the level's nodes. Both are timed as the engine runs them (``native_forward``
or ``forward_cached``), after CONTEXT tokens, taking turns with a plain target step, and given
relative to that plain step, as every other point of the cost model is (measure.py says why
points timed seconds apart are joined through a plain step's ratio).

n runs over a sparse plan; the points between are on the line through the measured ones.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from workers.engines.embedded.forwards import native_forward
from workers.engines.embedded.kv_cache import CacheBatch, KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.measurement.common import fill_line, scratch_cache, timed
from workers.engines.embedded.trees.tree import TreeRow

CONTEXT = 128  # tokens of context before the timed forwards (measure.CONTEXT's order of magnitude)
CHAINS = 4  # the synthetic tree timed: this many branches from the root, nodes spread over them
REPS = 9
# Levels priced up to this many nodes; a wider one (a 4x4 tree's second) is priced at this width's slope.
TREE_LEVEL_WIDTH = 16


def synthetic_tree(base: int, real: int, nodes: int) -> TreeRow:
    """``real`` real tokens ending at ``base``, then ``nodes`` nodes in CHAINS branches (node i's
    parent is node i - CHAINS, or the root), written at base + i: any tree of that many nodes
    costs about the same forward; only the keys each node reads differ, by a few."""
    logical = [base - real + 1 + t for t in range(real)]
    keymap: list[tuple[int, ...]] = [() for _ in range(real)]
    for i in range(1, nodes + 1):
        chain = [i - CHAINS * j for j in range((i - 1) // CHAINS, -1, -1)]
        logical.append(base + len(chain))
        keymap.append(tuple(base + c for c in chain))
    return TreeRow(tuple(logical), tuple(keymap))


def _tree_forward(model: LlamaForCausalLM, cache: KVCache, real: int, nodes: int, start: int,
                  logits: int, row_invariant: bool) -> Callable[[], None]:
    """One forward of ``real`` real tokens and ``nodes`` tree nodes at ``start``, as the engine runs it."""
    n = real + nodes
    tree = synthetic_tree(start + real - 1, real, nodes)
    tokens = [7 + t % 64 for t in range(n)]
    positions = cache.k[0].shape[2]

    def run() -> None:
        if native_forward(model, cache, [tokens], [0], [start], list(range(n - logits, n)), row_invariant,
                          [tree]) is not None:
            return
        batch = CacheBatch.build([0], [start], [n], n, positions, row_invariant=row_invariant, trees=[tree])
        wanted = torch.arange(n - logits, n)
        model.forward_cached(torch.tensor([tokens]), cache, batch, torch.zeros_like(wanted), wanted)
    return run


def _plain(model: LlamaForCausalLM, cache: KVCache) -> Callable[[], None]:
    return _tree_forward(model, cache, 1, 0, CONTEXT, 1, True)


@torch.inference_mode()
def _relative(runs: dict[int, Callable[[], None]], plain: Callable[[], None], until: float) -> dict[int, float]:
    """Each run's median seconds over the plain step's, the runs taking turns with it."""
    for run in (plain, *runs.values()):
        run()
    samples: dict[int, list[float]] = {n: [] for n in runs}
    plain_s: list[float] = []
    for rep in range(REPS):
        if rep > 0 and time.perf_counter() > until:
            break
        for n, run in runs.items():
            plain()
            plain_s.append(timed(plain))
            samples[n].append(timed(run))
    base = statistics.median(plain_s)
    return {n: statistics.median(s) / base for n, s in samples.items()}


def _line(measured: dict[int, float], size: int) -> tuple[float, ...]:
    """Values for n = 1..size on the line through the measured points (``fill_line``; both ends
    are measured), never falling as n grows (a forward of more tokens costs no less)."""
    out: list[float] = []
    for value in fill_line(measured, size):
        out.append(round(max(value, out[-1] if out else 0.0), 4))
    return tuple(out)


def measure_tree_costs(target: LlamaForCausalLM, draft: LlamaForCausalLM, max_nodes: int, max_width: int,
                       until: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(tree_verify_cost for n = 1..max_nodes + 1, tree_draft_cost for n = 1..max_width), each
    relative to the target's plain step at batch 1."""
    positions = CONTEXT + max_nodes + 64
    target_cache, draft_cache = scratch_cache(target, 1, positions), scratch_cache(draft, 1, positions)
    plain = _plain(target, target_cache)
    verify_plan = sorted({n for n in (2, 4, 8, 12, 16, 24, max_nodes + 1) if 2 <= n <= max_nodes + 1})
    verify = {1: 1.0, **_relative({n: _tree_forward(target, target_cache, 1, n - 1, CONTEXT, n, True)
                                   for n in verify_plan}, plain, until)}
    draft_plan = sorted({n for n in (1, 2, 4, 8, 16, max_width) if 1 <= n <= max_width})
    level = _relative({n: _tree_forward(draft, draft_cache, 0, n, CONTEXT + 1, n, False) for n in draft_plan},
                      plain, until)
    return _line(verify, max_nodes + 1), _line(level, max_width)

