"""llama-server fleets behind specgate: two plain servers, two n-gram servers, and one of each
steered per session (``python -m bench.peer --fleet``).

Each llama-server runs ``-t 1`` pinned to a core of its own (cores 0 and 1), 4 slots, behind
``specgate serve`` (``workers.remote``, ``protocol: llamacpp``; ``policy.methods: [draft,
ngram]`` and ``num_speculative_tokens: auto``, the rest the defaults). The workload: 8 sessions of 5 requests each, all
sessions at once and each session's requests in turn; 4 sessions of copy-heavy edits
(bench/data/peer_edits.jsonl) and 4 of open chat (task_prompts.jsonl), T=0, 64 tokens, every
request with its session's ``X-Session-ID``. The three arms run in turn.

Targets: the steered fleet's tokens/s ≥ 1.15× the two plain servers' (``fleet_over_plain_servers``),
and ≥ 0.97× the better static fleet's (``fleet_over_best_static``: steering must never lose to the
best fixed choice), with no failed request. Reported: each arm's sessions by the server their
requests ran on, and each server's drafts as the gateway accounted them.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.llama_server import NGRAM_TYPE, llamacpp_remote, start_llama_server, start_llamacpp_gateway
from bench.procs import REPO, get_json, stop
from workers.costs.cache import cpu_label

TASK_PROMPTS = REPO / "bench" / "data" / "task_prompts.jsonl"  # open chat (and bench.peer's code, JSON)
EDIT_PROMPTS = REPO / "bench" / "data" / "peer_edits.jsonl"  # copy-heavy edits
SESSIONS_PER_CLASS = 4
REQUESTS_PER_SESSION = 5
MAX_TOKENS = 128
# An edit session's requests after its first: each asks for the whole code again, changed.
FOLLOW_UPS = ("Now add type hints to it. Reply with the whole code.",
              "Now rename the function to a clearer name. Reply with the whole code.",
              "Now add a comment above each line that has none. Reply with the whole code.",
              "Now check the arguments at the top of the function. Reply with the whole code.")
# config.yaml's K (auto): the rules price each method on the servers' costs (a llama-server's are
# learned from its timings, gateway/llamacpp.py StepCosts); methods: sessions may choose ngram.
POLICY = {"methods": ["draft", "ngram"], "num_speculative_tokens": "auto"}
ARMS = {"two plain": (None, None), f"two {NGRAM_TYPE}": (NGRAM_TYPE, NGRAM_TYPE),
        "steered": (None, NGRAM_TYPE)}
TARGETS = {"fleet_over_plain_servers": 1.15, "fleet_over_best_static": 0.97}


@dataclass
class ArmResult:
    arm: str
    tokens: int = 0
    wall_s: float = 0.0
    failed: int = 0
    # session -> the workers its requests ran on, in order
    placements: dict[str, list[str]] = field(default_factory=dict)
    routes: dict[str, int] = field(default_factory=dict)
    workers: list[dict[str, Any]] = field(default_factory=list)

    def view(self) -> dict[str, Any]:
        by_class: dict[str, dict[str, int]] = {}
        for session, workers in self.placements.items():
            last = workers[-1] if workers else "none"
            cls = session.split("-")[0]
            by_class.setdefault(cls, {})
            by_class[cls][last] = by_class[cls].get(last, 0) + 1
        return {"arm": self.arm, "tok_s": round(self.tokens / self.wall_s, 2) if self.wall_s else 0.0,
                "tokens": self.tokens, "failed": self.failed, "sessions_by_last_server": by_class,
                "requests_by_route": self.routes, "placements": self.placements, "workers": self.workers}


@dataclass(frozen=True)
class Session:
    """One session's requests: an edit conversation (each request carries the answers before it),
    or independent open-chat prompts."""

    name: str
    first: tuple[dict[str, str], ...]
    follow_ups: tuple[str, ...] = ()  # an edit conversation's later requests
    prompts: tuple[tuple[dict[str, str], ...], ...] = ()  # open chat: each request's messages
    temperature: float = 0.0


def sessions(quick: bool) -> list[Session]:
    """Copy-heavy edit conversations (bench/data/peer_edits.jsonl's prompts, then FOLLOW_UPS) and
    open chat (task_prompts.jsonl's chat prompts), ``SESSIONS_PER_CLASS`` of each."""
    edits = [json.loads(line) for line in EDIT_PROMPTS.read_text().splitlines() if line.strip()]
    chats = [json.loads(line) for line in TASK_PROMPTS.read_text().splitlines() if line.strip()]
    chats = [row for row in chats if row["class"] == "chat"]
    per_class = 1 if quick else SESSIONS_PER_CLASS
    requests = 2 if quick else REQUESTS_PER_SESSION
    out = []
    for s in range(per_class):
        row = edits[s % len(edits)]
        first = ({"role": "system", "content": row["system"]}, {"role": "user", "content": row["prompt"]})
        out.append(Session(f"edit-{s}", first, FOLLOW_UPS[:requests - 1]))
    for s in range(per_class):
        prompts = tuple(({"role": "user", "content": chats[(s * requests + r) % len(chats)]["prompt"]},)
                        for r in range(requests))
        out.append(Session(f"chat-{s}", prompts[0], prompts=prompts))
    return out


async def chat(http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], session: str | None,
               model: str = "smollm2", temperature: float = 0.0) -> tuple[int, dict[str, Any], dict[str, str]]:
    body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": temperature}
    headers = {"X-Session-ID": session} if session else {}
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
        return response.status, await response.json(), dict(response.headers)


async def run_session(http: aiohttp.ClientSession, url: str, session: Session, session_id: str | None,
                      on_answer: Any) -> None:
    """A session's requests in turn; ``on_answer(status, answer, headers)`` for each."""
    if session.prompts:
        for prompt in session.prompts:
            on_answer(*await chat(http, url, list(prompt), session_id, temperature=session.temperature))
        return
    messages = list(session.first)
    for follow_up in (None, *session.follow_ups):
        if follow_up is not None:
            messages.append({"role": "user", "content": follow_up})
        status, answer, headers = await chat(http, url, messages, session_id, temperature=session.temperature)
        on_answer(status, answer, headers)
        if status != 200:
            return
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})


async def run_arm(arm: str, url: str, work: list[Session]) -> ArmResult:
    result = ArmResult(arm)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
        async def one(session: Session) -> None:
            placed = result.placements.setdefault(session.name, [])

            def on_answer(status: int, answer: dict[str, Any], headers: dict[str, str]) -> None:
                if status != 200:
                    result.failed += 1
                    return
                result.tokens += answer["usage"]["completion_tokens"]
                placed.append(headers.get("X-Specgate-Worker", "?"))
                route = headers.get("X-Specgate-Route", "?")
                result.routes[route] = result.routes.get(route, 0) + 1
            await run_session(http, url, session, f"{arm}-{session.name}", on_answer)
        started = time.monotonic()
        await asyncio.gather(*(one(session) for session in work))
        result.wall_s = time.monotonic() - started
    return result


def _warm(url: str) -> None:
    async def go() -> None:
        async with aiohttp.ClientSession() as http:
            body = {"model": "smollm2", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                    "temperature": 0}
            for _ in range(2):
                async with http.post(url + "/v1/chat/completions", json=body) as response:
                    await response.read()
    asyncio.run(go())


def run_fleet(quick: bool) -> dict[str, Any]:
    work = sessions(quick)
    cores = sorted(os.sched_getaffinity(0))
    results: list[ArmResult] = []
    with tempfile.TemporaryDirectory(prefix="bench-peer-fleet-") as tmp:
        log_dir = Path(tmp)
        for arm, spec_types in ARMS.items():
            servers = [start_llama_server(log_dir, spec_type=spec, slots=4, cpus=str(cores[i % len(cores)]))
                       for i, spec in enumerate(spec_types)]
            try:
                remotes = [llamacpp_remote(s, f"{'plain' if s.spec_type is None else 'ngram'}-{i}")
                           for i, s in enumerate(servers)]
                process, port = start_llamacpp_gateway(log_dir, remotes, POLICY)
                try:
                    url = f"http://127.0.0.1:{port}"
                    for server in servers:
                        _warm(server.url)
                    result = asyncio.run(run_arm(arm, url, work))
                    result.workers = [{"worker": w["worker_id"], "acceptance_by_method": w["acceptance_by_method"],
                                       "url": w["url"]} for w in get_json(url + "/admin/workers")["workers"]]
                    results.append(result)
                finally:
                    stop(process)
            finally:
                for server in servers:
                    server.stop()
    views = {r.arm: r.view() for r in results}
    plain, ngram, steered = (views[a]["tok_s"] for a in ARMS)
    ratios = {"fleet_over_plain_servers": steered / plain if plain else 0.0,
              "fleet_over_best_static": steered / max(plain, ngram) if max(plain, ngram) else 0.0}
    failed = sum(r.failed for r in results)
    targets = {name: {"ratio": round(value, 3), "target": TARGETS[name], "met": value >= TARGETS[name] and not failed}
               for name, value in ratios.items()}
    return {"bench": "peer --fleet", "cpu": cpu_label(), "cores": cores, "quick": quick, "arms": list(views.values()),
            "failed": failed, "targets": targets}


def print_fleet(out: dict[str, Any]) -> None:
    print(f"bench.peer --fleet on {out['cpu']}: each llama-server -t 1 on a core of its own ({out['cores']})")
    for arm in out["arms"]:
        print(f"{arm['arm']:20} {arm['tok_s']:7.1f} tok/s  failed {arm['failed']}  sessions by last server "
              f"{arm['sessions_by_last_server']}  routes {arm['requests_by_route']}")
    for name, target in out["targets"].items():
        print(f"{name}: {target['ratio']:.3f} (target {target['target']}: {'met' if target['met'] else 'not met'})")
