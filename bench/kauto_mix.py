"""Why K auto under-picks K in the simulated fleet: the cost model prices a step of d sequences
as if all d drafted the same K, while in a mixed batch only some draft.

    python -m bench.kauto_mix [--json]

For the sim engine's derived cost model (workers/engines/sim.py) at α = 0.9, it prints the gain
of each K (tokens per unit of time relative to plain) at depths 16, 24 and 32 two ways: as the
cost model has it (every sequence drafts K), and from the sim's own step time when a third of
the batch drafts K and the rest decode plain (the steady phase of ``bench.policy``, where only
the code sessions speculate). Pure arithmetic on the model: no timing, no noise.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from policies.cost import CostModel, expected_tokens, gain
from workers.engines.sim import COST_CONTEXT, derived_cost_report
from workers.engines.sim_model import SimConfig, StepCost

ALPHA = 0.9
MAX_K = 8


def run() -> dict[str, Any]:
    config = SimConfig()
    model = CostModel.from_json(derived_cost_report(config, MAX_K, 256).to_json())
    cost = StepCost(config)
    out: dict[str, Any] = {"alpha": ALPHA, "depths": {}}
    for depth in (16, 24, 32):
        uniform = {k: gain(model, ALPHA, k, depth) for k in range(MAX_K + 1)}
        drafting = depth // 3
        contexts = [COST_CONTEXT] * depth
        plain = cost.step_time([0] * depth, contexts)[0]
        mixed = {k: expected_tokens(ALPHA, k) * plain / cost.step_time([k] * drafting + [0] * (depth - drafting),
                                                                       contexts)[0]
                 for k in range(MAX_K + 1)}
        row: dict[str, Any] = {"drafting": drafting}
        for key, name, gains in (("uniform", "all draft K (cost model)", uniform),
                                 ("mixed", f"{drafting} of {depth} draft K (sim)", mixed)):
            best = max(gains, key=lambda k: gains[k])
            row[f"best_k_{key}"] = best
            row[f"gain_{key}"] = [round(g, 3) for g in gains.values()]
            print(f"depth {depth:>2}, {name:<26} best K {best}  gains "
                  + " ".join(f"{k}:{g:.2f}" for k, g in gains.items()))
        out["depths"][str(depth)] = row
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kauto_mix", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args(argv)
    result = run()
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
