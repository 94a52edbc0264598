"""The acceptance estimator checked against ground truth: simulated streams, then real sessions.

    python -m bench.estimator [--quick] [--json] [--sessions N] [--seed N]

1. **Calibration on simulated streams** (``EstimatorSim``): sessions of true α with K drafts a
   step (K uniform in 1..8 per session) draw each step from the truncated geometric (n < K
   accepted with probability αⁿ(1−α), all K with α^K) and fold it through the policy's own
   arithmetic (``policies.acceptance``: the same functions the gateway runs, here on numpy arrays,
   10,000 sessions at once). Reported per α: the mean estimate after 32 and 128 tested drafts;
   the share of sessions latched on low acceptance within 512 and 2,048 tested drafts (a false
   fallback where α ≥ 0.70) and the median detection delay; the same with the bare estimate
   compared with the floor (``acceptance_latch_stderrs: 0``), which is what the margin buys.
2. **Real sessions**: a gateway with two embedded workers on the demo pair, 50 sessions of 4
   requests (T=0, 64 tokens, ``bench/data/code_prompts.jsonl``). Each session's true α is what
   its workers counted (``bench.sessions``); reported: false fallbacks by true-α band and the
   median absolute error of the gateway's estimate.

``--json``: the last line is one JSON object. Every figure is labelled with the CPU it ran on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.estimator_sim import CALIBRATION_ALPHAS, CHECKPOINTS, LATCH_ALPHAS, MAX_K, EstimatorSim
from bench.procs import start_local_gateway, stop
from bench.prompts import load_prompts, sessions_of
from bench.sessions import run_sessions, summary
from policies import PolicyConfig
from workers.costs.cache import cpu_label


def calibration(policy: PolicyConfig, sessions: int, seed: int) -> dict[str, Any]:
    """The tables: mean estimates by α and K, and latch rates by α (with and without the margin)."""
    means: list[dict[str, Any]] = []
    for alpha in CALIBRATION_ALPHAS:
        for k in range(1, MAX_K + 1):
            sim = EstimatorSim(policy, sessions // 4, seed + k)
            result = sim.run(alpha, max(CHECKPOINTS), ks=np.full(sessions // 4, k), stop_on_latch=False)
            means.append({"alpha": alpha, "k": k, **{f"mean_at_{c}": round(result.mean_at[c], 4)
                                                    for c in CHECKPOINTS}})
    latches: list[dict[str, Any]] = []
    bare = replace(policy, acceptance_latch_stderrs=0.0)
    for alpha in LATCH_ALPHAS:
        row: dict[str, Any] = {"alpha": alpha}
        for name, rule in (("margin", policy), ("bare", bare)):
            result = EstimatorSim(rule, sessions, seed).run(alpha, 2048)
            row[name] = {"latched_within_96": round(result.latched_within(96), 4),
                         "latched_within_256": round(result.latched_within(256), 4),
                         "latched_within_512": round(result.latched_within(512), 4),
                         "latched_within_2048": round(result.latched_within(2048), 4),
                         "median_delay_drafts": result.median_delay()}
        latches.append(row)
    worst_bias = max(abs(row[f"mean_at_{c}"] - row["alpha"]) for row in means for c in CHECKPOINTS)
    high = [row for row in latches if row["alpha"] >= 0.70]
    low = [row for row in latches if row["alpha"] <= 0.45]
    return {
        "sessions": sessions, "means": means, "latches": latches,
        "targets": {
            "mean_estimate_within_0.02": {"worst": round(worst_bias, 4), "met": worst_bias <= 0.02},
            "false_fallback_512_le_1pct": {"worst": max(r["margin"]["latched_within_512"] for r in high),
                                           "met": all(r["margin"]["latched_within_512"] <= 0.01 for r in high)},
            "detected_within_96_ge_95pct": {"worst": min(r["margin"]["latched_within_96"] for r in low),
                                            "met": all(r["margin"]["latched_within_96"] >= 0.95 for r in low)},
        },
    }


def real_sessions(sessions: int, requests: int, max_tokens: int, log_dir: Path) -> dict[str, Any]:
    """A gateway with two embedded demo workers on loopback, the default policy, real sessions."""
    process, port = start_local_gateway(log_dir)
    try:
        plan = sessions_of(load_prompts(), sessions, requests)
        runs = asyncio.run(run_sessions(f"http://127.0.0.1:{port}", plan, model="specgate-demo",
                                        max_tokens=max_tokens, temperature=0.0, concurrency=4))
    finally:
        stop(process)
    out = summary(runs)
    out["per_session"] = [{"session": r.session_id, "true_alpha": None if r.true_alpha is None
                           else round(r.true_alpha, 4), "estimate": r.estimate, "tested": r.tested,
                           "latched": r.latched} for r in runs]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1,000 simulated sessions and 12 real ones")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sessions", type=int, default=10_000, help="simulated sessions per α")
    parser.add_argument("--seed", type=int, default=40)
    parser.add_argument("--no-real", action="store_true", help="the simulated part only")
    args = parser.parse_args(argv)
    policy = PolicyConfig()
    sim_sessions = 1000 if args.quick else args.sessions
    out: dict[str, Any] = {"cpu": cpu_label(), "policy": {k: v for k, v in policy.as_dict().items()
                                                         if k.startswith(("acceptance", "min_proposals"))}}
    out["calibration"] = calibration(policy, sim_sessions, args.seed)
    print_calibration(out["calibration"])
    if not args.no_real:
        with tempfile.TemporaryDirectory(prefix="bench-estimator-") as tmp:
            out["real"] = real_sessions(12 if args.quick else 50, 4, 64, Path(tmp))
        print_real(out["real"])
    if args.json:
        print(json.dumps(out))


def print_calibration(table: dict[str, Any]) -> None:
    print(f"simulated: {table['sessions']} sessions per alpha, K uniform 1..{MAX_K}")
    print("alpha  mean@32 (K=1..8)                          mean@128 (K=1..8)")
    for alpha in CALIBRATION_ALPHAS:
        rows = [r for r in table["means"] if r["alpha"] == alpha]
        print(f"{alpha:4.2f}  " + " ".join(f"{r['mean_at_32']:.3f}" for r in rows) + "   "
              + " ".join(f"{r['mean_at_128']:.3f}" for r in rows))
    print("alpha  latched<=96  <=512  <=2048  median delay | bare: <=96  <=256  <=512  <=2048")
    for row in table["latches"]:
        m, b = row["margin"], row["bare"]
        print(f"{row['alpha']:4.2f}   {m['latched_within_96']:6.4f}  {m['latched_within_512']:6.4f} "
              f"{m['latched_within_2048']:6.4f}  {m['median_delay_drafts']}  |  {b['latched_within_96']:6.4f} "
              f"{b['latched_within_256']:6.4f} {b['latched_within_512']:6.4f} {b['latched_within_2048']:6.4f}")
    for name, target in table["targets"].items():
        print(f"target {name}: {target}")


def print_real(real: dict[str, Any]) -> None:
    print("real sessions: " + ", ".join(f"{k} {v}" for k, v in real.items() if k != "per_session"))


if __name__ == "__main__":
    main()
