"""Chaos benchmark: honest sessions while workers die, the policy file churns and a hostile client
pushes degenerate parameters and malformed bodies. Every request must end in exactly one outcome.

    python -m bench.chaos [--json] [--quick | --smoke] [--sessions N] [--duration T] [--kill-every S] [--policy-every R]

A real gateway (``python -m gateway``) with two embedded workers serves N honest sessions for T
seconds, each sending greedy requests (completions and chats, streamed and not) whose undisturbed
answers were recorded first. Every S seconds a random worker is killed with SIGKILL (only once
all workers are ready again, so another worker is always up); every R seconds the config file's
policy is rewritten, valid and invalid versions alternating; a hostile client sends degenerate
sampling parameters and malformed bodies throughout.

Figures: requests sent and completed; retried transparently before their first chunk and
migrated mid-stream (the gateway's ``specgate_retries_total`` and ``specgate_migrations_total``);
failed with a clear error (an OpenAI error object or SSE error event: 0 expected while another
worker is up); **lost** (no final outcome at all: a cut stream, a hang, a transport error);
requests with more than one final outcome; outputs that differ from the undisturbed run, and
of those the ones longer than it (text duplicated); the longest time from a kill until every
worker is ready again; hostile requests answered with anything but a 4xx; honest requests
harmed by a hostile one (failed or wrong while a hostile request was in flight, with no kill
during them and no outage: 0 expected; "wrong" where the workers serve an exact precision, whose
greedy output does not depend on the batch, K or mode; ``exact_precision`` says whether they
did); **outages**: failures while no worker was ready (the gateway said so, or its
``/admin/workers``, polled throughout, showed none ready during the request), counted apart
from harm. Every failure and wrong output is listed in ``failure_reasons`` with the class it was
counted under and why (``outage``, ``killed``: a kill during it, ``hostile``, ``unexplained``);
the text output prints one line each. Requests that waited for a ready worker rather than
failing are ``admission_waited`` (the gateway's ``specgate_admission_waits_total``).
For a failed run's reader: each worker's precision before and after the chaos, up to five
mismatched requests (who served them and the reference, the time since the last kill, where the
texts part) and the gateway log's path. ``--json`` prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.procs import free_port, sse_data

REPO = Path(__file__).resolve().parent.parent
MODEL = "specgate-demo"
PROMPTS = ["import os\n\n\ndef list_files(root):\n    ", "class Queue:\n    def __init__(self):\n        ",
           "def merge_sorted(a, b):\n    ", "import re\n\n\ndef tokenize(text):\n    "]
QUESTIONS = ["Write a Python function `flatten`.", "Write a function that checks for palindromes."]
HOSTILE_FIELDS: list[dict[str, Any]] = [
    {"temperature": 0.7, "top_p": 0}, {"temperature": -0.5}, {"temperature": 1e308}, {"top_k": 10**12},
    {"seed": 2**70}, {"max_tokens": 2**40}, {"top_p": 1.5}, {"n": 3}, {"logit_bias": {"1": 100}},
    {"stop": [""]}, {"max_tokens": 0}, {"temperature": "hot"},
]
HOSTILE_BODIES = [b"{", b"[]", b"\xff\xfe{}", b'{"model": "specgate-demo", "prompt": ' + b"[" * 200 + b"]" * 200 + b"}",
                  b'{"model": "specgate-demo", "prompt": "x", "temperature": NaN}', b"null", b'{"model": 5}']
POLICIES_VALID = [{"num_speculative_tokens": 4, "max_temperature": 0.8}, {"num_speculative_tokens": 6}]
POLICIES_INVALID = [{"acceptance_floor": 2.0}, {"num_speculative_tokens": "six"}, {"max_batch": -1}]


@dataclass
class Variant:
    path: str
    body: dict[str, Any]
    chat: bool
    reference: str = ""
    reference_worker: str = ""
    reference_mode: str = ""


@dataclass
class Outcome:
    kind: str  # completed | failed | lost
    text: str = ""
    finals: int = 0  # final outcomes seen ([DONE], an error event, a whole answer, an error object)
    started: float = 0.0
    ended: float = 0.0
    detail: str = ""
    session: str = ""
    worker: str = ""  # X-Specgate-Worker: who served it (the first worker, for a migrated stream)
    mode: str = ""  # X-Specgate-Mode: the policy's decision


@dataclass
class Chaos:
    url: str
    pids: dict[str, int] = field(default_factory=dict)
    kills: list[float] = field(default_factory=list)
    recoveries: list[float] = field(default_factory=list)
    hostile: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, status)
    # Spans with no worker ready, as /admin/workers showed them: from the last poll that saw one
    # ready (the change came after it) to the first that saw one again.
    outages: list[tuple[float, float]] = field(default_factory=list)
    policy_writes: dict[str, int] = field(default_factory=lambda: {"valid": 0, "invalid": 0})


def variants(max_tokens: int) -> list[Variant]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        for stream in (True, False):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
            if i % 2:
                body["stop"] = ["\n\n\n\n"]  # holdback across a migration
            out.append(Variant("/v1/completions", body, False))
    for question in QUESTIONS:
        for stream in (True, False):
            out.append(Variant("/v1/chat/completions", {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
                                                         "stream": stream,
                                                         "messages": [{"role": "user", "content": question}]}, True))
    return out


async def send(http: aiohttp.ClientSession, url: str, variant: Variant, session: str) -> Outcome:
    outcome = Outcome("lost", started=time.monotonic(), session=session)
    try:
        async with http.post(url + variant.path, json=variant.body, headers={"X-Session-ID": session}) as response:
            outcome.worker = response.headers.get("X-Specgate-Worker", "")
            outcome.mode = response.headers.get("X-Specgate-Mode", "")
            if not variant.body["stream"]:
                payload = await response.json(content_type=None)
                outcome.finals = 1
                if response.status == 200:
                    choice = payload["choices"][0]
                    outcome.kind = "completed"
                    outcome.text = choice["message"]["content"] if variant.chat else choice["text"]
                elif isinstance(payload, dict) and "error" in payload:
                    outcome.kind, outcome.detail = "failed", str(payload["error"].get("message"))
                return outcome
            if response.status != 200:
                payload = await response.json(content_type=None)
                outcome.finals = 1
                outcome.kind, outcome.detail = "failed", str(payload["error"].get("message"))
                return outcome
            done = error = False
            async for data in sse_data(response):
                if data == "[DONE]":
                    done, outcome.finals = True, outcome.finals + 1
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    error, outcome.finals = True, outcome.finals + 1
                    outcome.detail = str(chunk["error"].get("message"))
                    continue
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    outcome.text += (delta.get("content") or "") if variant.chat else (choice.get("text") or "")
            outcome.kind = "completed" if done and not error else "failed" if error else "lost"
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
        outcome.kind, outcome.detail = "lost", f"{exc.__class__.__name__}: {exc}"
    finally:
        outcome.ended = time.monotonic()
    return outcome


async def honest(http: aiohttp.ClientSession, chaos: Chaos, pool: list[Variant], index: int, until: float,
                 rng: random.Random, out: list[tuple[Variant, Outcome]]) -> None:
    while time.monotonic() < until:
        variant = rng.choice(pool)
        out.append((variant, await send(http, chaos.url, variant, f"chaos-{index}")))


async def hostile(http: aiohttp.ClientSession, chaos: Chaos, until: float, rng: random.Random) -> None:
    while time.monotonic() < until:
        started = time.monotonic()
        headers = {"Content-Type": "application/json"}
        if rng.random() < 0.5:
            data = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 4, **rng.choice(HOSTILE_FIELDS)}).encode()
        else:
            data = rng.choice(HOSTILE_BODIES)
        try:
            async with http.post(chaos.url + "/v1/completions", data=data, headers=headers) as response:
                await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError):
            status = 0
        chaos.hostile.append((started, time.monotonic(), status))
        await asyncio.sleep(0.05)


async def workers(http: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    async with http.get(url + "/admin/workers") as response:
        listed: list[dict[str, Any]] = (await response.json())["workers"]
        return listed


async def killer(http: aiohttp.ClientSession, chaos: Chaos, every_s: float, until: float, rng: random.Random) -> None:
    """Kills a random worker every ``every_s``, once every worker is ready again."""
    while True:
        await asyncio.sleep(every_s)
        if time.monotonic() >= until:
            return
        listed = await workers(http, chaos.url)
        if not all(w["status"] == "ready" for w in listed):
            continue
        victim = rng.choice(listed)
        killed_at = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        chaos.kills.append(killed_at)
        while True:  # until the victim is back (a new process) and every worker is ready
            await asyncio.sleep(0.1)
            listed = await workers(http, chaos.url)
            back = next(w for w in listed if w["worker_id"] == victim["worker_id"])
            if back["pid"] != victim["pid"] and all(w["status"] == "ready" for w in listed):
                chaos.recoveries.append(time.monotonic() - killed_at)
                break


async def watch_readiness(http: aiohttp.ClientSession, chaos: Chaos, until: float, every_s: float = 0.1) -> None:
    """Polls /admin/workers, recording the spans in which no worker was ready (``Chaos.outages``)."""
    last_ready = time.monotonic()
    down_since: float | None = None
    while True:
        polled = time.monotonic()
        try:
            ready = sum(w["status"] == "ready" for w in await workers(http, chaos.url))
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            ready = None  # no answer: no evidence either way
        now = time.monotonic()
        if ready == 0 and down_since is None:
            down_since = last_ready
        elif ready and down_since is not None:
            chaos.outages.append((down_since, now))
            down_since = None
        if ready:
            last_ready = polled
        if now >= until and (down_since is None or now >= until + 60):  # a span still open after 60 s ends here
            if down_since is not None:
                chaos.outages.append((down_since, now))
            return
        await asyncio.sleep(every_s)


async def rewrite_policy(config: Path, chaos: Chaos, every_s: float, until: float) -> None:
    raw = yaml.safe_load(await asyncio.to_thread(config.read_text))
    valid = True
    i = 0
    while time.monotonic() < until:
        await asyncio.sleep(every_s)
        pool = POLICIES_VALID if valid else POLICIES_INVALID
        raw["policy"] = pool[i % len(pool)]
        await asyncio.to_thread(config.write_text, yaml.safe_dump(raw))
        chaos.policy_writes["valid" if valid else "invalid"] += 1
        valid, i = not valid, i + 1


async def metric(http: aiohttp.ClientSession, url: str, name: str) -> float:
    async with http.get(url + "/metrics") as response:
        text = await response.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def start_gateway(config: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR" and not k.startswith("SPECGATE_")}
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "gateway", "--config", str(config), "--port", str(port)],
                                   cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    return process, f"http://127.0.0.1:{port}"


async def wait_ready(http: aiohttp.ClientSession, url: str, count: int, process: subprocess.Popen[bytes],
                     timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"gateway exited with {process.returncode}")
        try:
            if sum(w["status"] == "ready" for w in await workers(http, url)) >= count:
                return
        except (aiohttp.ClientError, ValueError):
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"workers not ready within {timeout_s}s")


def precisions(listed: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each worker's served precision, as /admin/workers reports it: workers whose arithmetic
    differs answer a near-tie differently, so a mismatch is read beside them."""
    out = {}
    for w in listed:
        p = w.get("precision") or {}
        out[w["worker_id"]] = {"target": p.get("target"), "prepacked": p.get("target_prepacked"),
                               "products": p.get("products"), "exact": p.get("exact"),
                               "kernels": (p.get("kernels") or {}).get("build")}
    return out


def mismatch_sample(chaos: Chaos, pool: list[Variant], variant: Variant, outcome: Outcome) -> dict[str, Any]:
    """What a run that failed on a mismatch needs to say: which request, who served it and the
    reference, when the last kill was, and where the texts part."""
    common = next((i for i, (a, b) in enumerate(zip(variant.reference, outcome.text, strict=False)) if a != b),
                  min(len(variant.reference), len(outcome.text)))
    before = [outcome.started - k for k in chaos.kills if k < outcome.started]
    return {"variant": pool.index(variant), "path": variant.path, "stream": variant.body["stream"],
            "session": outcome.session, "worker": outcome.worker, "mode": outcome.mode,
            "reference_worker": variant.reference_worker, "reference_mode": variant.reference_mode,
            "since_last_kill_s": round(min(before), 2) if before else None,
            "reference_chars": len(variant.reference), "chars": len(outcome.text), "same_prefix_chars": common,
            "reference_then": variant.reference[common:common + 40], "then": outcome.text[common:common + 40]}


# What the gateway says when no worker can take a request (gateway/admission.py NoWorkerReady, a
# migration given up for want of a worker).
NO_WORKER_MESSAGES = ("no worker is ready", "no worker could take")
WAITED_SERIES = 'specgate_admission_waits_total{result="served"}'  # requests that waited for a worker, then ran


def classify(chaos: Chaos, outcome: Outcome, started: float, wrong: bool = False) -> tuple[str, str]:
    """Why a failed (or ``wrong``: completed with another text) request is counted where it is:
    ``outage`` (no worker was ready; a failure only: an outage makes no wrong text), ``killed`` (a
    worker was killed during it), ``hostile`` (a hostile request was in flight, and neither of
    those: harm), else ``unexplained``; and the evidence, for a reader."""
    span = f"{outcome.started - started:.2f}-{outcome.ended - started:.2f}s"
    down = [(s, e) for s, e in chaos.outages if s < outcome.ended and e > outcome.started]
    said = next((m for m in NO_WORKER_MESSAGES if m in outcome.detail), None)
    if not wrong and (down or said):
        seen = ", ".join(f"{s - started:.2f}-{e - started:.2f}s" for s, e in down)
        return "outage", (f"no worker ready during it ({span}; none ready {seen})" if down
                          else f"the gateway said '{said}' ({span})")
    kills = [k for k in chaos.kills if outcome.started <= k <= outcome.ended]
    if kills:
        return "killed", f"a worker was killed at {kills[0] - started:.2f}s, during it ({span})"
    hostile = sum(s < outcome.ended and e > outcome.started for s, e, _ in chaos.hostile)
    if hostile:
        return "hostile", f"{hostile} hostile requests in flight during it ({span}), no kill, no outage"
    return "unexplained", f"no kill, outage or hostile request during it ({span})"


def failure_reasons(chaos: Chaos, counted: list[tuple[Variant, Outcome, str]], started: float,
                    pool: list[Variant]) -> list[dict[str, Any]]:
    """Each counted failure (or wrong output): what it was, the class it was counted under, and why."""
    out = []
    for variant, outcome, what in counted:
        cls, why = classify(chaos, outcome, started, wrong=what == "wrong_output")
        out.append({"what": what, "class": cls, "why": why, "detail": outcome.detail[:200],
                    "session": outcome.session, "variant": pool.index(variant), "stream": variant.body["stream"]})
    return out


def write_config(tmp: Path, args: argparse.Namespace) -> Path:
    """The chaos gateway's config.yaml in ``tmp``: the demo models, ``args.workers`` workers."""
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"target": str(REPO / "models/demo-target"), "draft": str(REPO / "models/demo-draft")},
        "server": {"worker_timeout_s": 120, "migration_wait_s": 60, "drain_timeout_s": 5},
        "workers": {"count": args.workers, "max_slots": 16, "poll_interval_s": 0.2, "restart_backoff_s": 0.2,
                    "dtype": args.dtype},
        "policy": POLICIES_VALID[1]}))
    return config


async def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="specgate-chaos-"))
    config = write_config(tmp, args)
    process, url = start_gateway(config, tmp / "gateway.log")
    chaos = Chaos(url)
    rng = random.Random(args.seed)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout)) as http:
            await wait_ready(http, url, args.workers, process)
            pool = variants(args.max_tokens)
            for variant in pool:  # the undisturbed answers
                reference = await send(http, url, variant, "reference")
                if reference.kind != "completed":
                    raise RuntimeError(f"reference run failed: {reference}")
                variant.reference, variant.reference_worker, variant.reference_mode = (
                    reference.text, reference.worker, reference.mode)
            precisions_before = precisions(await workers(http, url))
            retries0, migrations0, waited0 = (await metric(http, url, "specgate_retries_total"),
                                              await metric(http, url, "specgate_migrations_total"),
                                              await metric(http, url, WAITED_SERIES))
            started = time.monotonic()
            until = started + args.duration
            results: list[tuple[Variant, Outcome]] = []
            await asyncio.gather(
                *(honest(http, chaos, pool, i, until, random.Random(args.seed + i), results)
                  for i in range(args.sessions)),
                hostile(http, chaos, until, rng), killer(http, chaos, args.kill_every, until, rng),
                rewrite_policy(config, chaos, args.policy_every, until), watch_readiness(http, chaos, until))
            elapsed = time.monotonic() - started
            retries = await metric(http, url, "specgate_retries_total") - retries0
            migrations = await metric(http, url, "specgate_migrations_total") - migrations0
            waited = await metric(http, url, WAITED_SERIES) - waited0
            async with http.get(url + "/admin/policy") as response:
                policy_view = await response.json()
            precisions_after = precisions(await workers(http, url))
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            exit_code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            exit_code = process.wait()
    # Greedy output is the undisturbed run's whatever the batch, K or mode only where verification
    # is bit-identical (workers.exact; docs/engine.md section 2); elsewhere the engine is close to
    # exact by design, and a different output is no harm.
    # (A worker caught between a restart and its first self-description reports none: no evidence.)
    reported = [p["exact"] for p in (*precisions_before.values(), *precisions_after.values()) if p["exact"] is not None]
    exact = bool(reported) and all(reported)
    completed = [(v, o) for v, o in results if o.kind == "completed"]
    mismatched = [(v, o) for v, o in completed if o.text != v.reference]
    # Failures, and where the precision is exact wrong outputs, each with the class it counts under.
    counted = [(v, o, o.kind) for v, o in results if o.kind != "completed"]
    counted += [(v, o, "wrong_output") for v, o in mismatched] if exact else []
    reasons = failure_reasons(chaos, counted, started, pool)
    return {
        "duration_s": round(elapsed, 1), "sessions": args.sessions, "workers": args.workers,
        "requests_sent": len(results), "completed": len(completed),
        "retried_transparently": int(retries), "migrated_mid_stream": int(migrations),
        "failed_clear_error": sum(o.kind == "failed" for _, o in results),
        "lost": sum(o.kind == "lost" for _, o in results),
        "multiple_outcomes": sum(o.finals > 1 for _, o in results),
        "mismatched_outputs": len(mismatched),
        "duplicated_outputs": sum(len(o.text) > len(v.reference) for v, o in mismatched),
        "kills": len(chaos.kills), "max_kill_to_ready_s": round(max(chaos.recoveries, default=0.0), 2),
        "policy_writes_valid": chaos.policy_writes["valid"], "policy_writes_invalid": chaos.policy_writes["invalid"],
        "policy_after": policy_view["policy"].get("num_speculative_tokens"),
        "hostile_sent": len(chaos.hostile), "hostile_not_4xx": sum(not 400 <= s < 500 for _, _, s in chaos.hostile),
        "honest_harmed_by_hostile": sum(r["class"] == "hostile" for r in reasons),
        "outages": sum(r["class"] == "outage" for r in reasons),
        "outage_spans_s": [round(e - s, 2) for s, e in chaos.outages],
        "admission_waited": int(waited),
        "exact_precision": exact,
        "gateway_exit_code": exit_code,
        "failures": sorted({o.detail for _, o in results if o.kind != "completed"})[:5],
        "precisions_before": precisions_before, "precisions_after": precisions_after,
        "mismatch_samples": [mismatch_sample(chaos, pool, v, o) for v, o in mismatched[:5]],
        "failure_reasons": reasons,
        "gateway_log": str(tmp / "gateway.log"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=12, help="concurrent honest sessions (N)")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of chaos (T)")
    parser.add_argument("--kill-every", type=float, default=20.0, help="seconds between worker kills (S)")
    parser.add_argument("--policy-every", type=float, default=5.0, help="seconds between policy rewrites (R)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="the workers' workers.dtype (auto: what their start-up measurement picks)")
    parser.add_argument("--quick", action="store_true", help="a short run (30 s)")
    parser.add_argument("--smoke", action="store_true",
                        help="shorter still (16 s, kills every 6 s): for the smoke test; its figures mean nothing")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.duration, args.kill_every, args.policy_every, args.max_tokens = 4, 30.0, 10.0, 2.0, 24
    if args.smoke:
        args.sessions, args.duration, args.kill_every, args.policy_every, args.max_tokens = 4, 16.0, 6.0, 2.0, 16
    result = asyncio.run(run(args))
    for key, value in result.items():
        if key != "failure_reasons":
            print(f"{key:>28}: {value}")
    for reason in result["failure_reasons"]:  # why each counted failure was counted
        print(f"{reason['what']:>12} {reason['class']:>11}: {reason['why']}; {reason['detail']!r}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
