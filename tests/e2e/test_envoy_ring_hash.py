"""Real Envoy (gateway/epp/envoy_config.py's configs) in front of real `specgate serve` replicas:
both configs pass `envoy --mode validate`; ring hash on X-Session-ID keeps a session on one
replica and spreads sessions over all; a replica killed under load loses only the streams that
had already begun, and its sessions move to the survivor."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest

from bench.procs import free_port
from gateway.epp.envoy_config import epp_bootstrap, ring_hash_bootstrap, round_robin_bootstrap
from tests.e2e.envoy_harness import Envoy, Replica, start_envoy, start_replica, validate
from tests.e2e.harness import REPO

MODEL = "specgate-demo"
MAX_TOKENS = 24
PROMPT = "[code] def flatten(items):\n    "


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Envoy, list[Replica]]]:
    """Two replicas behind Envoy's ring hash."""
    replicas: list[Replica] = []
    envoy: Envoy | None = None
    try:
        for name in ("a", "b"):
            replicas.append(start_replica(tmp_path / name))
        bootstrap = ring_hash_bootstrap(free_port(), free_port(), [("127.0.0.1", r.port) for r in replicas])
        envoy = start_envoy(bootstrap, tmp_path / "envoy.log")
        yield envoy, replicas
    finally:
        if envoy is not None:
            envoy.stop()
        for replica in replicas:
            replica.stop()


def client(envoy: Envoy) -> openai.OpenAI:
    return openai.OpenAI(base_url=envoy.base_url, api_key="unused", max_retries=0, timeout=120)


def holders(replicas: list[Replica], session_id: str) -> list[int]:
    """The indexes of the replicas that hold ``session_id``."""
    return [i for i, replica in enumerate(replicas) if replica.session_requests(session_id) is not None]


@pytest.mark.parametrize("name, bootstrap", [
    ("epp-buffered", epp_bootstrap(18080, 19901, [("127.0.0.1", 9002)])),
    ("epp-full-duplex", epp_bootstrap(18080, 19901, [("127.0.0.1", 9002), ("127.0.0.2", 9002)],
                                      body_mode="FULL_DUPLEX_STREAMED")),
    ("epp-dns", epp_bootstrap(18080, 19901, [("epp.specgate.svc", 9002)])),
    ("ring-hash", ring_hash_bootstrap(18080, 19901, [("127.0.0.1", 8001), ("127.0.0.1", 8002)])),
    ("round-robin", round_robin_bootstrap(18080, 19901, [("127.0.0.1", 8001), ("127.0.0.1", 8002)])),
])
def test_envoy_validates_the_rendered_configs(name: str, bootstrap: dict[str, Any], tmp_path: Path) -> None:
    result = validate(bootstrap, tmp_path)
    assert result.returncode == 0 and "OK" in result.stdout, f"{name}:\n{result.stdout}\n{result.stderr}"


def test_the_module_prints_yaml_envoy_accepts(tmp_path: Path) -> None:
    import yaml

    from gateway.epp.envoy_config import main

    for argv in (["epp", "--listen", "127.0.0.1:8080", "--epp", "127.0.0.1:9002", "--admin", "127.0.0.1:9901"],
                 ["ring-hash", "--listen", "127.0.0.1:8080", "--replica", "127.0.0.1:8001",
                  "--replica", "127.0.0.1:8002"]):
        printed = subprocess.run([sys.executable, "-m", "gateway.epp.envoy_config", *argv], cwd=REPO,
                                 capture_output=True, text=True, check=True, timeout=60).stdout
        result = validate(yaml.safe_load(printed), tmp_path)
        assert result.returncode == 0, f"{argv}:\n{result.stdout}\n{result.stderr}"
    with pytest.raises(SystemExit):
        main(["ring-hash", "--replica", "no-port"])


@pytest.mark.slow
def test_ring_hash_keeps_each_session_on_one_replica_and_spreads_sessions(
        fleet: tuple[Envoy, list[Replica]]) -> None:
    envoy, replicas = fleet
    sessions = [f"sticky-{i}" for i in range(16)]
    with client(envoy) as sdk:
        for session in sessions:
            for turn in range(3):
                headers = {"X-Session-ID": session}
                if turn == 1:  # streamed, through the same proxy
                    text, finish = "", None
                    with sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True, extra_headers=headers) as chunks:
                        for chunk in chunks:
                            text += chunk.choices[0].text if chunk.choices else ""
                            finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
                    assert text and finish == "length"
                else:
                    answer = sdk.completions.with_raw_response.create(
                        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_headers=headers)
                    assert answer.headers["x-session-id"] == session
                    completion = answer.parse()
                    assert completion.choices[0].text and completion.choices[0].finish_reason == "length"
                    assert completion.usage is not None and completion.usage.completion_tokens == MAX_TOKENS
    placement = {session: holders(replicas, session) for session in sessions}
    assert all(len(held) == 1 for held in placement.values()), placement
    for session, (index,) in placement.items():
        assert replicas[index].session_requests(session) == 3, (session, index)
    assert {held[0] for held in placement.values()} == {0, 1}, placement


@dataclass
class Outcome:
    session: str
    stream: bool
    after_kill: bool
    ok: bool = False
    # "no answer: ..." (non-streaming), "before headers: ..." or "mid-stream: ..." (a stream)
    failure: str | None = None


@dataclass
class Load:
    killed: asyncio.Event = field(default_factory=asyncio.Event)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    outcomes: list[Outcome] = field(default_factory=list)
    # Streams whose response has begun and not ended, by session.
    under_way: dict[str, int] = field(default_factory=dict)
    # Non-streaming requests sent and not yet answered, by session.
    waiting: dict[str, int] = field(default_factory=dict)


async def _one(sdk: openai.AsyncOpenAI, session: str, stream: bool, load: Load) -> Outcome:
    outcome = Outcome(session, stream, load.killed.is_set())
    headers = {"X-Session-ID": session}
    if not stream:
        load.waiting[session] = load.waiting.get(session, 0) + 1
        try:
            completion = await sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                      temperature=0, extra_headers=headers)
        except Exception as error:
            outcome.failure = f"no answer: {type(error).__name__}: {error}"
            return outcome
        finally:
            load.waiting[session] -= 1
        outcome.ok = (bool(completion.choices[0].text) and completion.choices[0].finish_reason == "length"
                      and completion.usage is not None and completion.usage.completion_tokens == MAX_TOKENS)
        outcome.failure = None if outcome.ok else f"incomplete answer: {completion}"
        return outcome
    try:
        # Returns once the response headers came: from then on Envoy cannot retry elsewhere.
        chunks = await sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_headers=headers)
    except Exception as error:
        outcome.failure = f"before headers: {type(error).__name__}: {error}"
        return outcome
    load.under_way[session] = load.under_way.get(session, 0) + 1
    text, finish, tokens = "", None, None
    try:
        async with chunks:
            async for chunk in chunks:
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
    except Exception as error:
        outcome.failure = f"mid-stream: {type(error).__name__}: {error}"
        return outcome
    finally:
        load.under_way[session] -= 1
    outcome.ok = bool(text) and finish == "length" and tokens == MAX_TOKENS
    # A stream cut without an error (no finish, no usage) is a mid-stream failure too.
    outcome.failure = None if outcome.ok else f"mid-stream: ended early (finish {finish}, {tokens} tokens)"
    return outcome


async def _client(sdk: openai.AsyncOpenAI, session: str, stream: bool, load: Load, after_kill: int) -> None:
    """Requests back to back until ``after_kill`` of them started after the kill and ``stop`` is set."""
    started_after = 0
    while not (load.stop.is_set() and started_after >= after_kill):
        started_after += load.killed.is_set()
        load.outcomes.append(await _one(sdk, session, stream, load))


async def test_killing_a_replica_under_load_fails_only_streams_already_under_way(
        fleet: tuple[Envoy, list[Replica]]) -> None:
    envoy, replicas = fleet
    # Sessions by replica: first placed by Envoy's hash, then read back from the replicas.
    by_replica: dict[int, list[str]] = {0: [], 1: []}
    async with openai.AsyncOpenAI(base_url=envoy.base_url, api_key="unused", max_retries=0, timeout=120) as sdk:
        for i in range(64):
            if min(len(s) for s in by_replica.values()) >= 4:
                break
            session = f"load-{i}"
            await sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                         extra_headers={"X-Session-ID": session})
            (index,) = await asyncio.to_thread(holders, replicas, session)
            by_replica[index].append(session)
        victim_index = 0
        victim, survivor = replicas[victim_index], replicas[1 - victim_index]
        victim_sessions, survivor_sessions = by_replica[victim_index][:4], by_replica[1 - victim_index][:4]
        assert len(victim_sessions) == len(survivor_sessions) == 4, by_replica

        # Eight clients: on each replica two streaming and two not.
        load = Load()
        clients = [asyncio.create_task(_client(sdk, session, stream=j % 2 == 0, load=load, after_kill=3))
                   for sessions in (victim_sessions, survivor_sessions) for j, session in enumerate(sessions)]
        # Kill once every client has finished a request, while the victim has begun a stream's
        # response and has a non-streaming request in hand (for Envoy to retry elsewhere).
        for _ in range(1200):
            begun = sum(load.under_way.get(s, 0) for s in victim_sessions)
            waiting = sum(load.waiting.get(s, 0) for s in victim_sessions)
            if begun and waiting and len({o.session for o in load.outcomes}) == len(clients):
                break
            await asyncio.sleep(0.05)
        in_hand = {"streams_begun": begun, "whole_waiting": waiting}
        assert begun and waiting, f"the victim never had both kinds of request in hand: {in_hand}"
        await asyncio.to_thread(victim.kill)
        load.killed.set()
        load.stop.set()
        await asyncio.wait_for(asyncio.gather(*clients), 600)
        retries = [line for line in (await asyncio.to_thread(envoy.admin, "/stats?filter=upstream_rq_retry"))
                   .splitlines() if "specgate-replicas" in line]

    failures = [o for o in load.outcomes if not o.ok]
    counts = {
        "requests": len(load.outcomes),
        "after_kill": sum(o.after_kill for o in load.outcomes),
        "streams": sum(o.stream for o in load.outcomes),
        "failed_mid_stream": sum(bool(o.failure and o.failure.startswith("mid-stream")) for o in failures),
        "failed_otherwise": sum(not (o.failure and o.failure.startswith("mid-stream")) for o in failures),
    }
    print(f"replica killed under load: {counts}; at the kill, on the victim: {in_hand}; envoy: {retries}")
    for failure in failures:
        print(f"  {failure}")
    report = f"{counts}\n" + "\n".join(f"{o}" for o in failures) + f"\nenvoy log:\n{envoy.log()[-4000:]}"
    # Whatever had not begun its response went elsewhere and completed; only streams the victim
    # had begun answering may fail, and only on the victim's sessions.
    assert all(o.stream and o.failure and o.failure.startswith("mid-stream") for o in failures), report
    assert all(o.session in victim_sessions and not o.after_kill for o in failures), report
    # Every session carried on: each client completed requests started after the kill...
    for session in victim_sessions + survivor_sessions:
        assert sum(o.ok and o.after_kill for o in load.outcomes if o.session == session) >= 3, (session, report)
    # ...and the victim's sessions now live on the survivor, which served them after the kill.
    for session in victim_sessions:
        served = await asyncio.to_thread(survivor.session_requests, session)
        assert served is not None and served >= 3, (session, served)
