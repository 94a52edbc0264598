"""The sim's calibration: fitted efficiencies, the facts they reproduce, and their sensitivity.

    python -m bench.sim_fit [--json]

Fits achieved bandwidth, achieved FLOP/s and the per-forward overhead of the simulated
deployment (workers/engines/sim/roofline.py) to the three published facts, prints the fit, the
per-token α of each acceptance band, speculation's gain by batch depth and α (K=5 and the best
K), and how the break-even batch moves when each fitted value is off by a factor of two.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from typing import Any

from workers.api.sim_config import PUBLISHED_K, Facts, SimConfig, alpha_from_rate, vllm_rate
from workers.engines.sim.roofline import StepCost, expected_tokens, fit_efficiency, gain

ALPHAS = (0.6, 0.71, 0.78, 0.86, 0.93, 0.96)
DEPTHS = (1, 8, 16, 24, 32, 48, 64, 96)


def breakeven(config: SimConfig, alpha: float, k: int, context: int) -> int | None:
    """The first batch depth (1..512) at which speculating at K no longer gains."""
    return next((b for b in range(1, 513) if gain(config, alpha, b, k, context) <= 1.0), None)


def best_k(config: SimConfig, alpha: float, depth: int, context: int, k_max: int = 5) -> int:
    """The K in 0..k_max with the highest modelled throughput (0: plain)."""
    return max(range(k_max + 1), key=lambda k: 1.0 if k == 0 else gain(config, alpha, depth, k, context))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sim_fit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    parser.add_argument("--quick", action="store_true", help="accepted for uniformity: the fit takes a second")
    args = parser.parse_args(argv)
    facts = Facts()
    base = SimConfig()
    fitted = fit_efficiency(base, facts)
    config = replace(base, efficiency=fitted)
    cost = StepCost(config)
    alpha = alpha_from_rate(facts.rate, facts.k)
    ctx = facts.context
    plain, _ = cost.step_time([0], [ctx])
    spec, _ = cost.step_time([facts.k], [ctx])
    out: dict[str, Any] = {
        "fitted": {"bandwidth_fraction": round(fitted.bandwidth_fraction, 4),
                   "achieved_bandwidth_tb_s": round(cost.bandwidth / 1e12, 2),
                   "flops_fraction": round(fitted.flops_fraction, 4),
                   "achieved_tflops": round(cost.flops / 1e12, 1),
                   "forward_overhead_ms": round(fitted.forward_overhead_ms, 3)},
        "reproduced": {"plain_tok_s_b1": round(1 / plain, 2),
                       "spec_tok_s_b1": round(expected_tokens(alpha, facts.k) / spec, 2),
                       "gain_at_64": round(gain(config, alpha, facts.breakeven_batch, facts.k, ctx), 3),
                       "calibration_alpha": round(alpha, 4)},
        "acceptance": {c: [[t if math.isfinite(t) else None, round(a, 4), round(vllm_rate(a, PUBLISHED_K), 3)]
                           for t, a in b] for c, b in base.acceptance.bands.items()},
        "gain_k5": {str(d): [round(gain(config, a, d, 5, ctx), 2) for a in ALPHAS] for d in DEPTHS},
        "best_k": {str(d): [best_k(config, a, d, ctx) for a in ALPHAS] for d in DEPTHS},
    }
    sensitivity = {}
    for name in ("bandwidth_fraction", "flops_fraction", "forward_overhead_ms"):
        for factor in (0.5, 2.0):
            varied = replace(config, efficiency=replace(fitted, **{name: getattr(fitted, name) * factor}))
            sensitivity[f"{name}×{factor}"] = {str(a): breakeven(varied, a, 5, ctx) for a in (0.6, 0.71, 0.93)}
    sensitivity["fitted"] = {str(a): breakeven(config, a, 5, ctx) for a in (0.6, 0.71, 0.93)}
    out["breakeven_batch_k5"] = sensitivity
    f, r = out["fitted"], out["reproduced"]
    print(f"fitted: bandwidth {f['bandwidth_fraction']:.1%} of datasheet ({f['achieved_bandwidth_tb_s']} TB/s over "
          f"{base.hardware.gpus} GPUs), FLOP/s {f['flops_fraction']:.1%} ({f['achieved_tflops']} TFLOP/s), "
          f"overhead {f['forward_overhead_ms']} ms per forward")
    print(f"reproduces: plain {r['plain_tok_s_b1']} tok/s at batch 1 (34), K=5 {r['spec_tok_s_b1']} tok/s (109) at "
          f"α={r['calibration_alpha']}, gain at batch 64 {r['gain_at_64']} (1.0)")
    print("acceptance bands [max T, per-token α, vLLM rate at K=5]:")
    for category, bands in out["acceptance"].items():
        print(f"  {category:<5} {bands}")
    print("gain of K=5 by batch depth, α = " + ", ".join(map(str, ALPHAS)))
    for depth, row in out["gain_k5"].items():
        print(f"  {depth:>4}: {row}   best K {out['best_k'][depth]}")
    print("break-even batch at K=5 (α = 0.6 / 0.71 / 0.93) when one fitted value is off:")
    for name, row in sensitivity.items():
        print(f"  {name:<26} {list(row.values())}")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
