"""bench.engine's token trees (issue #36), in one interleaved run at batch 1, T = 0:

- per-depth acceptance: for every chain and tree run, each depth's rank-1 acceptance and the
  rank-r acceptances β_r (rank r accepted given ranks < r rejected), from the steps' paths;
- each tree's effective acceptance: accepted tokens per step over the chain's of the same depth
  (the same sequential draft forwards), and each one's tokens/s;
- tokens/s for the best chain and the best tree, and K auto with trees allowed: the gateway's
  policy (``policies.decide``) choosing plain, a chain or a tree per request on the worker's
  live cost model, learning from each request's steps as a session's estimate does; the
  target is ≥ 0.97 × the better of the best chain and the best tree, and the run says what auto
  chose;
- at batch 8/32/64, what the policy with trees allowed chooses at that depth for the measured
  acceptance: where it is no tree, the K auto run of ``compare_at_batch`` is what it runs.
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass, field

from bench.engine_runs import run_interleaved
from policies import Decision, PolicyConfig, RequestFacts, SessionState, WorkerState, decide, record_decision
from policies.speculation import observe, observe_path
from policies.tree import StepPath, TreeShape
from workers.costs.online import OnlineCosts
from workers.engines.embedded.engine import SpeculativeEngine, StepEvent
from workers.engines.embedded.llama import LlamaForCausalLM

# Small trees: verifying a node costs a CPU a sizeable share of a token (docs/engine.md), so
# only shallow, narrow trees stand a chance here; each is also a candidate of auto's.
TREE_SHAPES = ("2", "3", "2+1", "2+2", "3+1", "2x2", "2+3", "2x2+1")
AUTO = 99  # run_interleaved's key for K auto with trees allowed
TREE_KEY = 100  # ... and TREE_KEY + i for TREE_SHAPES[i]


@dataclass
class Paths:
    """A run's step paths (a chain step as ``StepPath.of_chain``)."""

    k: int = 0
    tree: TreeShape | None = None
    paths: list[StepPath] = field(default_factory=list)

    def request(self, index: int, ids: list[int]) -> tuple[int, TreeShape | None]:
        return (self.k if self.tree is None else self.tree.depth), self.tree

    def observe(self, event: StepEvent) -> None:
        if event.path is not None:
            self.paths.append(event.path)
        elif event.proposed > 0:
            self.paths.append(StepPath.of_chain(event.proposed, event.accepted))

    def accepted_per_step(self) -> float:
        return sum(p.accepted for p in self.paths) / max(1, len(self.paths))

    def by_depth(self) -> dict[str, dict[str, float | int]]:
        """Per depth: rank r's tests and its acceptance β_r (rank 1: the per-depth acceptance)."""
        tests: Counter[tuple[int, int]] = Counter()
        passed: Counter[tuple[int, int]] = Counter()
        for path in self.paths:
            for depth, rank, accepted in path.tests():
                tests[depth, rank] += 1
                passed[depth, rank] += int(accepted)
        out: dict[str, dict[str, float | int]] = {}
        for depth, rank in sorted(tests):
            row = out.setdefault(str(depth), {})
            row[f"beta{rank}"] = round(passed[depth, rank] / tests[depth, rank], 4)
            row[f"tests{rank}"] = tests[depth, rank]
        return out


class AutoWithTrees(Paths):
    """K auto with trees allowed, as the gateway runs it for one session: each request's plan
    from ``decide`` on the worker's live cost model, each step folded into the session."""

    def __init__(self, online: OnlineCosts, kmax: int) -> None:
        super().__init__()
        self.online, self.kmax = online, kmax
        self.policy = PolicyConfig(num_speculative_tokens="auto", tree_shapes=TREE_SHAPES)
        self.session = SessionState()
        self.chosen: Counter[str] = Counter()

    def worker(self, depth: int = 0) -> WorkerState:
        return WorkerState(batch_depth=depth, batch_full=False, max_k=self.kmax,
                           cost=self.online.report().policy_model(), tree_max_nodes=32)

    def decision(self, depth: int = 0) -> Decision:
        return decide(self.session, self.worker(depth), RequestFacts(temperature=0.0), self.policy)

    def request(self, index: int, ids: list[int]) -> tuple[int, TreeShape | None]:
        decision = self.decision()
        self.session = record_decision(self.session, decision, auto_k=True)
        self.chosen[label(decision)] += 1
        return decision.k, decision.tree

    def observe(self, event: StepEvent) -> None:
        super().observe(event)
        if event.path is not None:
            self.session = observe_path(self.session, event.path, self.policy)
        elif event.proposed > 0:
            self.session = observe(self.session, event.proposed, event.accepted, self.policy)


def label(decision: Decision) -> str:
    if decision.mode == "plain":
        return "plain"
    return f"tree {decision.tree}" if decision.tree is not None else f"chain K={decision.k}"


def measure_trees(args: argparse.Namespace, models: tuple[LlamaForCausalLM, LlamaForCausalLM], online: OnlineCosts,
                  prompts: list[list[int]], best_k: int) -> dict[str, object]:
    """The trees' runs beside plain and the chains (``models``: target and draft as served;
    ``online``: the worker's live cost model, which hears every step; ``best_k``: the best
    chain of bench.engine's batch-1 run, run again here)."""
    shapes = [TreeShape.parse(s) for s in TREE_SHAPES]
    chains = sorted({best_k, *(s.depth for s in shapes)})
    plans: dict[int, Paths] = {k: Paths(k=k) for k in chains}
    plans |= {TREE_KEY + i: Paths(tree=s) for i, s in enumerate(shapes)}
    auto = plans[AUTO] = AutoWithTrees(online, args.kmax)
    engines = {key: SpeculativeEngine(*models, max_slots=1, max_k=args.kmax, max_positions=args.max_positions)
               for key in [0, *plans]}
    results, outputs = run_interleaved(engines, [[ids] for ids in prompts], args.max_tokens, 0.0, costs=online,
                                       plans=plans)
    plain = results[0].tok_s
    identical = sum(outputs[key] == outputs[0] for key in plans)
    tok_s = {key: round(results[key].tok_s, 1) for key in results}
    best_chain = max(chains, key=lambda k: results[k].tok_s)
    best_tree_i = max(range(len(shapes)), key=lambda i: results[TREE_KEY + i].tok_s)
    best_tree = shapes[best_tree_i]
    better = max(results[best_chain].tok_s, results[TREE_KEY + best_tree_i].tok_s)
    trees = {}
    for i, shape in enumerate(shapes):
        mine, chain = plans[TREE_KEY + i], plans[shape.depth]
        trees[str(shape)] = {"nodes": shape.nodes, "depth": shape.depth, "tok_s": tok_s[TREE_KEY + i],
                             "speedup": round(results[TREE_KEY + i].tok_s / plain, 3),
                             "accepted_per_step": round(mine.accepted_per_step(), 3),
                             "effective_acceptance": round(mine.accepted_per_step()
                                                           / max(1e-9, chain.accepted_per_step()), 3),
                             "by_depth": mine.by_depth()}
    at_batch = {}
    for size in [int(b) for b in args.batches.split(",") if b]:
        at_batch[str(size)] = label(auto.decision(size - 1))
    out: dict[str, object] = {
        "tree_shapes": list(TREE_SHAPES), "tok_s_plain": round(plain, 1),
        "tok_s_chain_by_k": {str(k): tok_s[k] for k in chains},
        "acceptance_by_depth_chain": {str(k): plans[k].by_depth() for k in chains},
        "trees": trees, "best_chain_k": best_chain, "tok_s_best_chain": tok_s[best_chain],
        "best_tree": str(best_tree), "tok_s_best_tree": tok_s[TREE_KEY + best_tree_i],
        "tok_s_auto_trees": tok_s[AUTO], "auto_chose": dict(auto.chosen),
        "auto_trees_over_better_fixed": round(results[AUTO].tok_s / better, 3),
        "greedy_identical_runs": identical, "greedy_compared_runs": len(plans),
        "auto_trees_chooses_at_batch": at_batch,
    }
    print(f"trees at batch 1, T=0: plain {plain:.1f} tok/s; best chain K={best_chain} {tok_s[best_chain]} tok/s; "
          f"best tree {best_tree} {tok_s[TREE_KEY + best_tree_i]} tok/s; K auto with trees {tok_s[AUTO]} tok/s "
          f"({out['auto_trees_over_better_fixed']}x the better fixed one; chose {dict(auto.chosen)}); output "
          f"identical to plain in {identical}/{len(plans)} runs", flush=True)
    for name, t in trees.items():
        print(f"  tree {name} ({t['nodes']} nodes): {t['tok_s']} tok/s ({t['speedup']}x plain), accepted/step "
              f"{t['accepted_per_step']}, effective acceptance {t['effective_acceptance']}x the chain of its depth",
              flush=True)
    print(f"  K auto with trees allowed chooses at batch depth: {at_batch}", flush=True)
    return out
