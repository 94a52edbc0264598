"""What the policy is worth: a simulated GPU fleet under mixed traffic, policy by policy.

    python -m bench.policy [--quick | --smoke] [--json] [--out DIR] [--seed N]   # virtual time (bench/fleet_sim.py)
    python -m bench.policy --real [--quick] [--json]                   # a real gateway over sim workers
    python -m bench.policy --trees-only [--quick] [--json]             # where token trees pay (bench/policy_trees.py)

Virtual time: two replicas of the simulated deployment (workers/engines/sim/roofline.py: Llama-3.3-70B
+ 1B draft, TP4 on H100s, docs/sim.md), closed-loop sessions of three kinds (code at T=0.2,
reasoning at T=0.7 with α≈0.6, chat at T=1.0) in phases, the burst phase pushing each replica's
batch well past 64. Every policy meets the same seeded traffic. Per phase and overall: goodput
(output tokens/s), p50/p99 inter-token latency and TTFT, the share of tokens from speculative
steps, and mode switches (a session's decision changing mode between requests). A PNG of
goodput over time goes into ``--out``. ``--json``: the last line is one JSON object.

Adding a policy is one entry in ``policies()``. ``--trees`` adds, and ``--trees-only`` runs alone,
K auto with token trees against K auto with chains only (bench/policy_trees.py, docs/trees.md):
the JSON's ``trees`` object, with its own ``targets``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.fleet_sim import DEFAULT_PHASES, FleetPolicy, FleetResult, FleetSim, PhaseStats, vllm_k_table
from policies import PolicyConfig, PolicyConfigError
from workers.api.sim_config import Facts, SimConfig, alpha_from_rate

K = 5  # the deployment's K: every speculative policy drafts this many, so the rules are what differ
TOLERANCE = 0.03  # "specgate ≥ the best static policy in every phase, within 3%"
GPU_FREE_BATCH, GPU_MAX_STEP_DRAFTS = 32, 48  # docs/sim.md: where a GPU step is memory-bound


def policies(sim: SimConfig) -> list[tuple[str, FleetPolicy]]:
    """(json key, policy). The simulator's parameters are frozen before any of these runs."""
    facts = Facts()
    table = vllm_k_table(sim, alpha_from_rate(facts.rate, facts.k), K, facts.context)
    out = [
        ("always", FleetPolicy("always speculative K=5", k=K)),
        ("never", FleetPolicy("never speculative", k=0)),
        ("vllm_rule", FleetPolicy("vLLM: K by batch size", k=K, k_by_depth=table)),
        # The rules alone: no hysteresis, no probing, the bare estimate against the floor.
        ("bare_thresholds", FleetPolicy("bare thresholds 60%/64/0.8", PolicyConfig(
            acceptance_floor=0.6, acceptance_resume=0.6, max_batch=64, batch_resume=64, max_temperature=0.8,
            probe_every=1 << 30, num_speculative_tokens=K, free_batch=0, max_step_drafts=0,
            acceptance_latch_stderrs=0.0))),
        ("specgate", FleetPolicy("specgate (config defaults, K=5)", PolicyConfig(num_speculative_tokens=K))),
        # The GPU profile: the shallow-batch waiver and the per-step draft budget, which the
        # defaults leave off so the configured thresholds (0.60 / 64 / 0.8) are the rules.
        ("specgate_gpu", FleetPolicy("specgate GPU profile (free_batch 32, max_step_drafts 48, K=5)", PolicyConfig(
            num_speculative_tokens=K, free_batch=GPU_FREE_BATCH, max_step_drafts=GPU_MAX_STEP_DRAFTS))),
    ]
    # K from the workers' costs, priced at each step's draft mix (policies/cost.py); on the
    # defaults, and on the GPU profile. (Left out where the config refuses "auto".)
    with contextlib.suppress(PolicyConfigError, TypeError, ValueError):
        out.append(("specgate_auto", FleetPolicy("specgate K=auto", PolicyConfig.from_mapping(
            {"num_speculative_tokens": "auto"}))))
        out.append(("specgate_gpu_auto", FleetPolicy("specgate GPU profile, K=auto", PolicyConfig.from_mapping(
            {"num_speculative_tokens": "auto", "free_batch": GPU_FREE_BATCH, "max_step_drafts": GPU_MAX_STEP_DRAFTS}))))
        # Everything from the costs: K auto, and the rules waived where the cost model says the
        # session's acceptance pays at the worker's depth (free_batch: auto), no number read off a table.
        out.append(("specgate_cost", FleetPolicy("specgate K=auto, free_batch auto", PolicyConfig.from_mapping(
            {"num_speculative_tokens": "auto", "free_batch": "auto"}))))
    return out


STATIC = ("always", "never")


def phase_row(stats: PhaseStats, seconds: float) -> dict[str, Any]:
    def ms(value: float | None) -> float | None:
        return None if value is None else round(1000 * value, 1)
    return {"goodput": round(stats.tokens / seconds, 1) if seconds else 0.0,
            "itl_p50_ms": ms(stats.itl.quantile(0.5)), "itl_p99_ms": ms(stats.itl.quantile(0.99)),
            "ttft_p50_ms": ms(stats.ttft.quantile(0.5)), "ttft_p99_ms": ms(stats.ttft.quantile(0.99)),
            "spec_share": round(stats.spec_tokens / stats.tokens, 3) if stats.tokens else 0.0,
            "switches": stats.switches, "requests": stats.requests}


def summarize(result: FleetResult) -> dict[str, dict[str, Any]]:
    rows = {name: phase_row(result.phases[name], hi - lo) for name, lo, hi in result.phase_bounds}
    rows["overall"] = phase_row(result.overall, result.phase_bounds[-1][2])
    return rows


def print_table(key: str, label: str, rows: dict[str, dict[str, Any]]) -> None:
    print(f"\n{label} [{key}]")
    print(f"  {'phase':<10}{'tok/s':>9}{'ITL p50':>9}{'p99':>8}{'TTFT p50':>10}{'p99':>8}{'spec':>7}{'switch':>8}")
    for phase, r in rows.items():
        print(f"  {phase:<10}{r['goodput']:>9.1f}{r['itl_p50_ms'] or 0:>9.1f}{r['itl_p99_ms'] or 0:>8.1f}"
              f"{r['ttft_p50_ms'] or 0:>10.1f}{r['ttft_p99_ms'] or 0:>8.1f}{r['spec_share']:>7.2f}{r['switches']:>8}")


def check_targets(goodput: dict[str, dict[str, float]], key: str = "specgate") -> dict[str, Any]:
    """specgate ≥ best static (within TOLERANCE) in every phase; > every other non-specgate overall."""
    spec = goodput[key]
    per_phase = {}
    for phase, value in spec.items():
        best = max(goodput[s][phase] for s in STATIC)
        per_phase[phase] = {"specgate": value, "best_static": best, "ratio": round(value / best, 4) if best else None,
                            "met": value >= (1 - TOLERANCE) * best}
    others = {k: v["overall"] for k, v in goodput.items() if not k.startswith("specgate")}
    return {"phases": per_phase, "every_phase_met": all(p["met"] for p in per_phase.values()),
            "overall_beats_all_others": all(spec["overall"] > v for v in others.values())}


def plot(results: list[tuple[str, FleetResult]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    for key, result in results:
        xs = [(i + 0.5) * result.bucket_s for i in range(len(result.timeline))]
        ax.plot(xs, [t / result.bucket_s for t in result.timeline], label=key, linewidth=1.2)
    for name, lo, _ in results[0][1].phase_bounds:
        ax.axvline(lo, color="grey", linewidth=0.6, linestyle=":")
        ax.text(lo, ax.get_ylim()[1] * 0.98, f" {name}", va="top", fontsize=8, color="grey")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("goodput (output tokens/s, fleet)")
    ax.set_title("bench.policy: goodput over time, 2 simulated replicas (70B + 1B draft, TP4 H100)")
    ax.legend(fontsize=8)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "policy_goodput.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def run_virtual(args: argparse.Namespace) -> dict[str, Any]:
    sim = SimConfig()
    phases = [replace(p, duration_s=p.duration_s * args.scale) for p in DEFAULT_PHASES]
    print(f"virtual time: {sum(p.duration_s for p in phases):.0f} simulated s per policy; phases "
          + ", ".join(f"{p.name} {p.duration_s:.0f}s × {p.sessions_per_kind} sessions per kind" for p in phases))
    results: list[tuple[str, FleetResult]] = []
    summaries: dict[str, dict[str, dict[str, Any]]] = {}
    for key, policy in policies(sim):
        started = time.perf_counter()

        def progress(frac: float, key: str = key) -> None:
            print(f"  {key}: {100 * frac:.0f}%", file=sys.stderr, end="\r", flush=True)
        result = FleetSim(sim, policy, phases, seed=args.seed, progress=progress).run()
        print(f"  {key}: done in {time.perf_counter() - started:.1f}s", file=sys.stderr)
        results.append((key, result))
        summaries[key] = summarize(result)
        print_table(key, policy.name, summaries[key])
    goodput = {k: {phase: row["goodput"] for phase, row in rows.items()} for k, rows in summaries.items()}
    targets = {key: check_targets(goodput, key) for key in goodput if key.startswith("specgate")}
    winner = max(goodput, key=lambda k: goodput[k]["overall"])
    print("\ngoodput (output tokens/s, fleet of 2):")
    phase_names = list(next(iter(goodput.values())))
    print(f"  {'policy':<17}" + "".join(f"{p:>10}" for p in phase_names))
    for key, row in goodput.items():
        print(f"  {key:<17}" + "".join(f"{row[p]:>10.1f}" for p in phase_names))
    for key, target in targets.items():
        for phase, t in target["phases"].items():
            print(f"  target {key} {phase}: {t['specgate']:.1f} vs best static {t['best_static']:.1f} "
                  f"(×{t['ratio']}) {'met' if t['met'] else 'MISSED'}")
        print(f"  target {key} overall: beats every non-specgate policy: {target['overall_beats_all_others']}")
    print(f"  winner overall: {winner}")
    png = plot(results, Path(args.out))
    print(f"  plot: {png}")
    return {"mode": "virtual", "seed": args.seed, "scale": args.scale, "goodput": goodput, "winner_overall": winner,
            "targets": targets, "detail": summaries, "plot": str(png)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.policy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    parser.add_argument("--quick", action="store_true", help="a tenth of the traffic (virtual), or a short real run")
    parser.add_argument("--smoke", action="store_true",
                        help="--quick with 3%% of the traffic (virtual): for the smoke test; its figures mean nothing")
    parser.add_argument("--real", action="store_true", help="through a real gateway and sim workers")
    parser.add_argument("--out", default="bench-out", help="where the PNG goes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=None,
                        help="phase durations × this (default 1, quick 0.1, smoke 0.03)")
    parser.add_argument("--trees", action="store_true", help="also: trees vs chains only (bench/policy_trees.py)")
    parser.add_argument("--trees-only", action="store_true", help="only the trees vs chains comparison")
    parser.add_argument("--time-scale", type=float, default=2.0,
                        help="--real: wall seconds per simulated second (slower than the GPUs: fewer chunks/s)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.quick = True
        args.scale = 0.03 if args.scale is None else args.scale
    if args.scale is None:
        args.scale = 0.1 if args.quick else 1.0
    if args.trees_only:
        from bench.policy_trees import run_trees

        result = {"mode": "trees", "seed": args.seed, "scale": args.scale, **run_trees(args)}
    elif args.real:
        from bench.policy_real import run_real

        result = run_real(args)
    else:
        result = run_virtual(args)
        if args.trees:
            from bench.policy_trees import run_trees

            result["trees"] = run_trees(args)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
