"""Prefix reuse in the embedded engine, on the real pair: multi-turn chat with and without it.

``python -m bench.prefix --engine embedded [--json] [--quick]`` (this module's ``run``):
``specgate serve`` on config.yaml's model (SmolLM2-135M-Instruct and its distilled draft),
workers and policy sections, 2 embedded workers, twice: ``reuse`` (config.yaml's
``workers.prefix_cache_mb``) and ``no_reuse`` (``prefix_cache_mb: 0``), the same sessions to
each. A session is 5 turns of chat at T=0: a system prompt of a few hundred tokens, each turn
appending the model's answer and a new user message to the history, so turn 5 prefills the
whole conversation unless the worker kept its KV. Sessions run ``CONCURRENCY`` at a time.

Reported per config: TTFT (to the first streamed content chunk) p50 by turn, output tokens/s
over the whole run, the share of prompt tokens the workers served from their caches
(``usage.prompt_tokens_details.cached_tokens``), and whether every answer was the same text in
both configs (reuse must not change a token). Targets (issue 44): turn 5's TTFT p50 with reuse
≤ 0.5 × without; tokens/s ≥ 0.97 × without, in the same run.

``--tenants N`` (``run_tenants``, issue 52): the gateway has N API keys, each its own tenant, and
every session of every tenant opens with one shared system prompt (no customer number). A warm-up
tenant sends it first; then each tenant in turn sends its first request, after every tenant before
it sent that prompt: the cached tokens those first requests report are cross-tenant hits (target
0). Then each tenant's sessions run (tenants interleaved, ``CONCURRENCY`` at a time), with and
without reuse: each tenant's own turn-5 TTFT p50 with reuse ≤ 0.5 × without (the worst tenant's
ratio is reported).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.procs import served_sections, start_serve_gateway, stop, stream_chat

REPO = Path(__file__).resolve().parent.parent
TURNS = 5
MAX_TOKENS = 32
CONCURRENCY = 2  # one session a worker, about: TTFT is the prefill's, not a queue's
SYSTEM = ("You are the support assistant of Northwind Outfitters, a shop for hiking and camping gear. "
          "Answer in two or three sentences, politely and precisely. ")
POLICIES = ("Returns are accepted within 30 days with the receipt. Sale items can be exchanged but not "
            "refunded. Shipping is free above 50 euros; below that it costs 4.90 euros. Orders leave the "
            "warehouse within two working days. Tents carry a two-year warranty, sleeping bags one year. ")
QUESTIONS = ("Can I return a tent I bought three weeks ago?", "How much is shipping for a 30 euro order?",
             "My sleeping bag tore after fourteen months. Is it covered?", "When will my order leave?",
             "Can I get a refund on a sale jacket?", "Do you ship to Norway?", "What if I lost the receipt?",
             "Is the warranty the same for stoves?")


@dataclass
class Tally:
    ttft_by_turn: dict[int, list[float]] = field(default_factory=dict)
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    failed: int = 0
    answers: dict[tuple[int, int], str] = field(default_factory=dict)  # (session, turn) -> text


def system_prompt(session: int | None) -> str:
    """A few hundred tokens, the same for every session but for its customer number at the end
    (sessions share the start, as a deployment's sessions share a system prompt); None: no number,
    the very same prompt for every session (the tenants' run)."""
    return SYSTEM + POLICIES * 4 + ("" if session is None else f"The customer's number is {1000 + session}.")


async def run_session(http: aiohttp.ClientSession, url: str, model: str, session: int, salt: str,
                      tally: Tally, api_key: str | None = None, turns: int = TURNS) -> None:
    messages: list[dict[str, str]] = [{"role": "system",
                                       "content": system_prompt(None if api_key is not None else session)}]
    headers = {"X-Session-ID": f"{salt}-{session}"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    for turn in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[(session + turn) % len(QUESTIONS)]})
        body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
        sent = time.monotonic()
        answer, _ = await stream_chat(http, url, body, headers)
        if answer.status != 200:
            tally.failed += 1
            return
        if answer.usage:
            tally.tokens += answer.usage["completion_tokens"]
            tally.prompt_tokens += answer.usage["prompt_tokens"]
            tally.cached_tokens += (answer.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if answer.first_content_at is not None:
            tally.ttft_by_turn.setdefault(turn + 1, []).append(answer.first_content_at - sent)
        tally.answers[(session, turn)] = answer.text
        messages.append({"role": "assistant", "content": answer.text})


async def drive(url: str, model: str, sessions: int, salt: str, api_key: str | None = None) -> tuple[Tally, float]:
    tally = Tally()
    gate = asyncio.Semaphore(CONCURRENCY)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        started = time.monotonic()

        async def one(session: int) -> None:
            async with gate:
                await run_session(http, url, model, session, salt, tally, api_key)
        await asyncio.gather(*(one(s) for s in range(sessions)))
        return tally, time.monotonic() - started


def serve_config(log_dir: Path, prefix_cache_mb: float | None) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """config.yaml's model, workers (2, costs cached in the run's folder) and policy sections."""
    model, workers, policy = served_sections()
    workers |= {"count": 2, "cost_cache_dir": str(log_dir / "costs")}
    if prefix_cache_mb is not None:
        workers["prefix_cache_mb"] = prefix_cache_mb
    return model, workers, policy


def summary(tally: Tally, elapsed: float) -> dict[str, Any]:
    return {"failed": tally.failed,
            "ttft_p50_ms_by_turn": {turn: round(1000 * statistics.median(v), 1)
                                    for turn, v in sorted(tally.ttft_by_turn.items())},
            "output_tok_s": round(tally.tokens / elapsed, 2) if elapsed > 0 else None,
            "cached_token_share": round(tally.cached_tokens / tally.prompt_tokens, 4) if tally.prompt_tokens else 0.0,
            "prompt_tokens": tally.prompt_tokens, "wall_s": round(elapsed, 1)}


def run(log_dir: Path, sessions: int) -> dict[str, Any]:
    """Both configs on the same sessions; each on a fresh gateway and workers (no cache carried)."""
    out: dict[str, Any] = {"engine": "embedded", "workers": 2, "sessions": sessions, "turns": TURNS,
                           "max_tokens": MAX_TOKENS, "concurrency": CONCURRENCY}
    answers: dict[str, dict[tuple[int, int], str]] = {}
    for config, cache_mb in (("no_reuse", 0.0), ("reuse", None)):
        model, workers, policy = serve_config(log_dir, cache_mb)
        process, port = start_serve_gateway(log_dir, model, workers, policy, ready_timeout_s=300.0)
        try:
            url = f"http://127.0.0.1:{port}"
            asyncio.run(drive(url, model["name"], 2, f"warm-{config}"))  # first prefills, kernels, caches
            tally, elapsed = asyncio.run(drive(url, model["name"], sessions, "run"))
        finally:
            stop(process)
        out[config] = summary(tally, elapsed)
        out[config]["prefix_cache_mb"] = workers.get("prefix_cache_mb")
        answers[config] = tally.answers
        print(f"embedded {config:9} " + " ".join(f"{k}={v}" for k, v in out[config].items()), flush=True)
    same = sum(1 for key, text in answers["reuse"].items() if answers["no_reuse"].get(key) == text)
    out["answers_identical"] = {"same": same, "of": len(answers["reuse"])}
    out["targets"] = targets(out)
    return out


def targets(out: dict[str, Any]) -> dict[str, Any]:
    reuse, base = out["reuse"], out["no_reuse"]
    ttft = reuse["ttft_p50_ms_by_turn"].get(TURNS), base["ttft_p50_ms_by_turn"].get(TURNS)
    ttft_ratio = round(ttft[0] / ttft[1], 3) if None not in ttft and ttft[1] else None
    tok_ratio = (round(reuse["output_tok_s"] / base["output_tok_s"], 3)
                 if reuse["output_tok_s"] and base["output_tok_s"] else None)
    same = out["answers_identical"]
    return {"turn5_ttft_p50_ratio": {"value": ttft_ratio, "target": "<= 0.5",
                                     "met": ttft_ratio is not None and ttft_ratio <= 0.5},
            "tok_s_ratio": {"value": tok_ratio, "target": ">= 0.97",
                            "met": tok_ratio is not None and tok_ratio >= 0.97},
            "answers_identical": {"value": same["same"], "target": f"== {same['of']}",
                                  "met": same["same"] == same["of"]}}


WARM_UP_KEY = "sk-bench-warm-up-0123456789"


def tenant_keys(tenants: int) -> list[str]:
    return [f"sk-bench-tenant-{t:02d}-0123456789" for t in range(tenants)]


async def drive_tenants(url: str, model: str, keys: list[str], sessions: int) -> tuple[list[int], dict[str, Tally],
                                                                                        float]:
    """Each tenant's first request in turn (its cached tokens: what it found of the tenants before
    it), then every tenant's sessions, interleaved, ``CONCURRENCY`` at a time."""
    first: list[int] = []
    tallies = {key: Tally() for key in keys}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        for key in keys:
            probe = Tally()
            await run_session(http, url, model, 0, f"first-{key[-14:]}", probe, key, turns=1)
            first.append(probe.cached_tokens)
        gate = asyncio.Semaphore(CONCURRENCY)
        started = time.monotonic()

        async def one(key: str, session: int) -> None:
            async with gate:
                await run_session(http, url, model, session, "run", tallies[key], key)
        await asyncio.gather(*(one(key, s) for s in range(sessions) for key in keys))
        return first, tallies, time.monotonic() - started


def run_tenants(log_dir: Path, tenants: int, sessions: int) -> dict[str, Any]:
    """The tenants' run, with and without reuse, each on a fresh gateway and workers."""
    keys = tenant_keys(tenants)
    out: dict[str, Any] = {"engine": "embedded", "workers": 2, "tenants": tenants, "sessions_per_tenant": sessions,
                           "turns": TURNS, "max_tokens": MAX_TOKENS, "concurrency": CONCURRENCY}
    turn5: dict[str, list[float | None]] = {}
    for config, cache_mb in (("no_reuse", 0.0), ("reuse", None)):
        model, workers, policy = serve_config(log_dir, cache_mb)
        process, port = start_serve_gateway(log_dir, model, workers, policy, ready_timeout_s=300.0,
                                            auth={"api_keys": [*keys, WARM_UP_KEY]})
        try:
            url = f"http://127.0.0.1:{port}"
            # Warmed (first prefills, kernels) by a tenant of its own that sends the shared prompt
            # first: every measured tenant's first request comes after another tenant sent it.
            asyncio.run(drive(url, model["name"], 2, f"warm-{config}", WARM_UP_KEY))
            first, tallies, elapsed = asyncio.run(drive_tenants(url, model["name"], keys, sessions))
        finally:
            stop(process)
        summaries = {f"tenant-{i}": summary(tallies[key], elapsed) for i, key in enumerate(keys)}
        out[config] = {"first_request_cached_tokens": first, "by_tenant": summaries,
                       "failed": sum(t.failed for t in tallies.values()), "wall_s": round(elapsed, 1),
                       "prefix_cache_mb": workers.get("prefix_cache_mb")}
        turn5[config] = [s["ttft_p50_ms_by_turn"].get(TURNS) for s in summaries.values()]
        print(f"embedded {config:9} tenants={tenants} first_request_cached_tokens={first} "
              f"turn5_ttft_p50_ms={turn5[config]} failed={out[config]['failed']}", flush=True)
    ratios = [round(r / b, 3) if r is not None and b else None for r, b in zip(turn5["reuse"], turn5["no_reuse"],
                                                                                   strict=True)]
    out["own_turn5_ttft_ratios"] = ratios
    worst = None if None in ratios else max(r for r in ratios if r is not None)
    # The warm-up tenant sent the prompt before all of them: every first request's hits are another's.
    cross = sum(out["reuse"]["first_request_cached_tokens"])
    out["targets"] = {
        "cross_tenant_cached_tokens": {"value": cross, "target": "== 0", "met": cross == 0},
        "own_turn5_ttft_ratio": {"value": worst, "target": "<= 0.5", "met": worst is not None and worst <= 0.5}}
    return out
