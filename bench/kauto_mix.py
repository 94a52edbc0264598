"""Why K auto prices a step at its worker's draft mix: the cost model's two prices of K next to
the simulated GPU's own step times.

    python -m bench.kauto_mix [--json]

For the sim engine's derived cost model (workers/engines/sim/engine.py) at α = 0.9, at depths 16, 24
and 32, where a third of the batch drafts and the rest decode plain (the steady phase of
``bench.policy``: only the code sessions speculate), it prints the gain of each K (tokens per
unit of time relative to plain) three ways:

- ``uniform``: as the cost model priced a step before the mix was known, every sequence
  drafting K (``policies.cost.gain`` without a mix);
- ``mixed``: as K auto prices it now, the drafting third at K and the rest plain, as the batch's
  goodput per drafting sequence (``policies.cost.gain`` with a ``StepMix``);
- ``sim``: the same objective on the sim's own step times for that batch
  (``workers.engines.sim.roofline.StepCost``), which the mixed price should match.

Pure arithmetic on the models: no timing, no noise.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from policies.cost import CostModel, StepMix, expected_tokens, gain
from workers.api.sim_config import SimConfig
from workers.engines.sim.engine import COST_CONTEXT, derived_cost_report
from workers.engines.sim.roofline import StepCost

ALPHA = 0.9
MAX_K = 8


def sim_gain(cost: StepCost, depth: int, drafting: int, k: int) -> float:
    """The batch's goodput per drafting sequence with ``drafting`` of ``depth`` sequences at K,
    relative to the whole batch plain, on the sim's step times (``policies.cost``'s objective)."""
    contexts = [COST_CONTEXT] * depth
    plain = cost.step_time([0] * depth, contexts)[0]
    spec = cost.step_time([k] * drafting + [0] * (depth - drafting), contexts)[0]
    others = depth - drafting
    return ((others + drafting * expected_tokens(ALPHA, k)) * plain / spec - others) / drafting


def run() -> dict[str, Any]:
    config = SimConfig()
    model = CostModel.from_json(derived_cost_report(config, MAX_K, 256).to_json())
    cost = StepCost(config)
    out: dict[str, Any] = {"alpha": ALPHA, "depths": {}}
    for depth in (16, 24, 32):
        drafting = depth // 3
        mix = StepMix(depth - 1, drafting - 1, 0, ALPHA)  # the others, as the session priced sees them
        ks = range(MAX_K + 1)
        prices = {
            "uniform": ("all draft K (cost model, before)", {k: gain(model, ALPHA, k, depth) for k in ks}),
            "mixed": (f"{drafting} of {depth} draft K (cost model)",
                      {k: gain(model, ALPHA, k, depth, mix) for k in ks}),
            "sim": (f"{drafting} of {depth} draft K (sim)", {k: sim_gain(cost, depth, drafting, k) if k else 1.0
                                                           for k in ks}),
        }
        row: dict[str, Any] = {"drafting": drafting}
        for key, (name, gains) in prices.items():
            best = max(gains, key=lambda k: gains[k])
            row[f"best_k_{key}"] = best
            row[f"gain_{key}"] = [round(g, 3) for g in gains.values()]
            print(f"depth {depth:>2}, {name:<33} best K {best}  gains "
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
