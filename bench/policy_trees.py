"""``python -m bench.policy --trees``: where token trees pay on the simulated GPU fleet.

Three figures (docs/trees.md):

- **table**: the best tree's modelled gain over the best chain, by the session's per-token α
  (band midpoints) and the batch depth, every sequence of the batch running the same plan, on
  the sim's own step times (``StepCost``) and its calibrated rank acceptances (``trees.py``).
  Every tree of at most ``tree_max_nodes`` nodes and depth ``MAX_TREE_DEPTH`` competes against
  chains of K = 1..8. Pure arithmetic: no fleet, no noise.
- **mixed**: bench.policy's mixed workload (its phases and session kinds), policy K auto with
  trees against K auto with chains only (``tree_shapes: []``). Target: trees ≥ 0.99 × chains.
- **must_win**: middling acceptance (the three kinds at α 0.78 / 0.62 / 0.70, every
  temperature, ``max_temperature`` 1.0) at shallow batches (1, 2 and 4 sessions per kind over
  two replicas). Target: trees > chains.

How a tree is chosen: ``decide`` prices it (``Decision.tree``, policies/tree_choice.py), told the
worker's ``tree_max_nodes``, and every tree step's path is folded with ``observe_path``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import replace
from functools import cache
from typing import Any

from bench.fleet_sim import DEFAULT_PHASES, FleetPolicy, FleetResult, FleetSim, Phase
from policies import PolicyConfig
from policies.tree import MAX_BRANCHING, MAX_TREE_DEPTH, TreeShape, expected_tree_tokens
from workers.api.sim_config import AcceptanceTable, SimConfig
from workers.engines.sim.engine import COST_CONTEXT
from workers.engines.sim.roofline import StepCost, expected_tokens
from workers.engines.sim.trees import betas_for

ALPHA_BANDS = ((0.5, 0.6), (0.6, 0.7), (0.7, 0.8), (0.8, 0.9), (0.9, 1.0))
TABLE_DEPTHS = (1, 2, 4, 8, 16, 32, 64)
MAX_K = 8
MIXED_TARGET = 0.99


# -- the table ------------------------------------------------------------------------------------------
def all_shapes(max_nodes: int) -> Iterator[TreeShape]:
    """Every tree (not chain) of branching 2..MAX_BRANCHING on top, a chain below, within bounds."""
    for top in range(1, MAX_TREE_DEPTH + 1):
        for factors in itertools.product(range(2, MAX_BRANCHING + 1), repeat=top):
            for chain in range(0, MAX_TREE_DEPTH - top + 1):
                if _fits(factors, chain, max_nodes):
                    yield TreeShape((*factors, *([1] * chain)))


def _fits(factors: Sequence[int], chain: int, max_nodes: int) -> bool:
    width, nodes = 1, 0
    for k in factors:
        width *= k
        nodes += width
    return nodes + chain * width <= max_nodes


class Gains:
    """Gain over plain of a batch of ``depth`` sequences all running one plan, on the sim's step times."""

    def __init__(self, sim: SimConfig) -> None:
        self.cost = StepCost(sim)

    @cache  # noqa: B019 - one instance per run, a few hundred keys
    def step(self, depth: int, k: int, shape: TreeShape | None) -> float:
        contexts = [COST_CONTEXT] * depth
        return self.cost.step_time([k] * depth, contexts, 0, None if shape is None else [shape] * depth)[0]

    def chain(self, alpha: float, depth: int, k: int) -> float:
        return expected_tokens(alpha, k) * self.step(depth, 0, None) / self.step(depth, k, None)

    def tree(self, betas: Sequence[float], depth: int, shape: TreeShape) -> float:
        tokens = expected_tree_tokens(shape, [betas])
        return tokens * self.step(depth, 0, None) / self.step(depth, shape.depth, shape)


def tree_table(sim: SimConfig) -> dict[str, Any]:
    """Per α band × depth: the best chain and best tree, their gains over plain, and the ratio."""
    gains = Gains(sim)
    shapes = list(all_shapes(sim.tree_max_nodes))
    rows: dict[str, dict[str, Any]] = {}
    for lo, hi in ALPHA_BANDS:
        alpha = (lo + hi) / 2
        betas = betas_for(alpha)
        row: dict[str, Any] = {}
        for depth in TABLE_DEPTHS:
            k = max(range(1, MAX_K + 1), key=lambda k: gains.chain(alpha, depth, k))
            shape = max(shapes, key=lambda s: gains.tree(betas, depth, s))
            chain_gain, tree_gain = gains.chain(alpha, depth, k), gains.tree(betas, depth, shape)
            winner = "tree" if tree_gain > max(chain_gain, 1.0) else "chain" if chain_gain > 1.0 else "plain"
            row[str(depth)] = {"chain_k": k, "chain_gain": round(chain_gain, 3), "tree": str(shape),
                               "tree_gain": round(tree_gain, 3), "tree_over_chain": round(tree_gain / chain_gain, 3),
                               "winner": winner}
        rows[f"{lo:.1f}-{hi:.1f}" if hi < 1.0 else f"{lo:.1f}+"] = row
    return {"alpha_at": "band midpoint", "depths": list(TABLE_DEPTHS), "shapes_compared": len(shapes),
            "chains_compared": f"K=1..{MAX_K}", "rows": rows}


def print_table(table: dict[str, Any]) -> None:
    print(f"\nwhere trees win: best tree's gain ÷ best chain's ({table['shapes_compared']} trees vs "
          f"{table['chains_compared']}; whole batch on one plan; α at the band's midpoint)")
    print(f"  {'α band':<9}" + "".join(f"{'b=' + str(d):>17}" for d in table["depths"]))
    for band, row in table["rows"].items():
        cells = []
        for d in table["depths"]:
            c = row[str(d)]
            mark = {"tree": "T", "chain": "c", "plain": "-"}[c["winner"]]
            cells.append(f"{c['tree_over_chain']:>6.3f} {mark} {c['tree']:>7}" if c["winner"] == "tree"
                         else f"{c['tree_over_chain']:>6.3f} {mark} {'K=' + str(c['chain_k']):>7}")
        print(f"  {band:<9}" + "".join(f"{cell:>17}" for cell in cells))
    print("  T: the tree shown wins; c: the chain K shown wins; -: plain wins (no plan gains)")



MUST_WIN_ACCEPTANCE = {"code": ((float("inf"), 0.78),), "math": ((float("inf"), 0.62),),
                       "chat": ((float("inf"), 0.70),)}
MUST_WIN_PHASES = (Phase("b1", 300, 1), Phase("b2", 300, 2), Phase("b4", 300, 4))


def _policy(trees: bool, **fields: Any) -> FleetPolicy:
    mapping: dict[str, Any] = {"num_speculative_tokens": "auto", **fields}
    if not trees:
        mapping["tree_shapes"] = []
    return FleetPolicy("K auto, trees" if trees else "K auto, chains only", PolicyConfig.from_mapping(mapping))


def run_pair(sim: SimConfig, phases: Sequence[Phase], seed: int, **fields: Any) -> dict[str, Any]:
    """Chains only, then trees, on the same seeded traffic: goodput per phase and the ratio."""
    out: dict[str, Any] = {}
    results: dict[str, FleetResult] = {}
    for trees in (False, True):
        fleet = FleetSim(sim, _policy(trees, **fields), phases, seed=seed, trees=True)
        results["trees" if trees else "chains"] = fleet.run()
        out["tree_requests" if trees else "chain_tree_requests"] = fleet.tree_requests
        if trees:
            out["tree_steps"] = fleet.tree_steps
    goodput = {key: {name: round(r.phases[name].tokens / (hi - lo), 1) for name, lo, hi in r.phase_bounds}
               | {"overall": round(r.overall.tokens / r.phase_bounds[-1][2], 1)} for key, r in results.items()}
    out["goodput"] = goodput
    out["ratio"] = {p: round(goodput["trees"][p] / goodput["chains"][p], 4) if goodput["chains"][p] else None
                    for p in goodput["chains"]}
    return out


def run_trees(args: Any) -> dict[str, Any]:
    """The table, the mixed workload and the must-win workload; printed, and returned for --json."""
    sim = SimConfig()
    print(f"trees: policies/tree_choice.py (decide) chooses trees; sim tree_max_nodes {sim.tree_max_nodes}")
    table = tree_table(sim)
    print_table(table)
    scale = args.scale
    mixed = run_pair(sim, [replace(p, duration_s=p.duration_s * scale) for p in DEFAULT_PHASES], args.seed)
    mid_sim = replace(sim, acceptance=AcceptanceTable(MUST_WIN_ACCEPTANCE, "chat"))
    must = run_pair(mid_sim, [replace(p, duration_s=p.duration_s * scale) for p in MUST_WIN_PHASES], args.seed,
                    max_temperature=1.0)
    for name, pair in (("mixed workload (bench.policy's phases)", mixed),
                       ("must-win workload (α 0.62-0.78, 1-4 sessions per kind)", must)):
        print(f"\n{name}: goodput, tokens/s (fleet of 2); tree requests {pair['tree_requests']}, "
              f"tree steps {pair['tree_steps']}")
        phases = list(pair["goodput"]["chains"])
        print(f"  {'policy':<14}" + "".join(f"{p:>10}" for p in phases))
        for key in ("chains", "trees"):
            print(f"  {key:<14}" + "".join(f"{pair['goodput'][key][p]:>10.1f}" for p in phases))
        print(f"  {'trees÷chains':<14}" + "".join(f"{pair['ratio'][p] or 0:>10.4f}" for p in phases))
    targets = {"mixed_ratio": mixed["ratio"]["overall"], "mixed_target": MIXED_TARGET,
               "mixed_met": mixed["ratio"]["overall"] >= MIXED_TARGET,
               "must_win_ratio": must["ratio"]["overall"], "must_win_met": must["ratio"]["overall"] > 1.0}
    print(f"\n  target mixed: trees ÷ chains {targets['mixed_ratio']} (≥ {MIXED_TARGET}) "
          f"{'met' if targets['mixed_met'] else 'MISSED'}")
    print(f"  target must-win: trees ÷ chains {targets['must_win_ratio']} (> 1) "
          f"{'met' if targets['must_win_met'] else 'MISSED'}")
    return {"chooser": "policies", "table": table, "mixed": mixed, "must_win": must,
            "targets": targets}
