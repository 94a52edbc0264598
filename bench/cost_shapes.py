"""How well the start-up cost measurement's budget prices verification at depth.

    python -m bench.cost_shapes [--json] [--budgets 4 90] [--target DIR] [--draft DIR]

Measures the worker's cost model (``workers/engines/embedded/measurement/measure.py``) on the
real pair at each budget, as a worker with the default config does (max_slots 16, max_k 8, dtype
auto, one thread), and prints each depth's verification ratios (an n-token forward over a plain
step). The longest budget times the most points: its ratios are the reference the shorter
budgets' filled-in ones (``measure.shape_by_rows``) are compared with, n = 2 and 3 at each depth.
Nothing is cached: each budget measures afresh.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from bench.procs import print_result
from workers.costs.cache import cpu_label
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.measurement.measure import measure
from workers.engines.embedded.measurement.settings import MeasureSettings

REPO = Path(__file__).resolve().parent.parent
COMPARED_N = (2, 3)  # the verifications K auto weighs most at depth (K = 1, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--budgets", type=float, nargs="+", default=[4.0, 90.0], help="measurement budgets (s)")
    parser.add_argument("--target", type=Path, default=REPO / "models/smollm2-135m-instruct-q4_1")
    parser.add_argument("--draft", type=Path, default=REPO / "models/smollm2-draft")
    parser.add_argument("--max-slots", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rowgemm.set_threads(1)
    runs: dict[str, Any] = {}
    for budget in sorted(args.budgets):
        report = measure(MeasureSettings(args.target, args.draft, args.max_slots, 8, "auto", "float32", True,
                                         budget, 1))
        assert report.verify_cost is not None
        ratios = {str(d): [round(x, 3) for x in row] for d, row in zip(report.depths, report.verify_cost,
                                                                        strict=True)}
        runs[str(budget)] = {"measured_points": report.measured_points, "total_points": report.total_points,
                             "measure_s": report.measure_s, "plain_step_ms": list(report.plain_step_ms),
                             "verify_ratio": ratios}
        print(f"budget {budget:g} s: {report.measured_points}/{report.total_points} points in "
              f"{report.measure_s:.1f} s", flush=True)
        for depth, row in ratios.items():
            print(f"  depth {depth:>3}: " + " ".join(f"n={n} {row[n - 1]:.3f}" for n in range(1, min(5, len(row)) + 1)))
    reference = runs[str(max(args.budgets))]["verify_ratio"]
    errors = {budget: {depth: [round(run["verify_ratio"][depth][n - 1] / reference[depth][n - 1], 3)
                               for n in COMPARED_N] for depth in reference}
              for budget, run in runs.items() if budget != str(max(args.budgets))}
    for budget, by_depth in errors.items():
        print(f"budget {float(budget):g} s over the reference, n = {COMPARED_N}: "
              + ", ".join(f"depth {d} {r}" for d, r in by_depth.items()))
    print(f"CPU: {cpu_label()}")
    print_result({"bench": "cost_shapes", "cpu": cpu_label(), "runs": runs, "over_reference": errors}, args.json)


if __name__ == "__main__":
    main()
