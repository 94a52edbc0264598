"""The relay and the endpoint picker share one routing pipeline (gateway/scheduling/store.py) and
its plugins' state, in one process: a prefix recorded through the relay's admission is seen by
the picker's next placement, and for the same fleet snapshot both place the same requests alike.
The picker is driven message by message as Envoy drives it (ext_proc), the relay through the
admission it runs (``pick`` and ``commit``)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import orjson

from gateway.admission import accept_request, commit, pick, session_id_of
from gateway.auth import AUTH_KEY
from gateway.config.config import parse_config
from gateway.epp.exchange import Exchange
from gateway.fleet.handle import WorkerHandle
from gateway.relay.app import create_app
from gateway.state import STATE_KEY
from gateway.tenancy import OPEN
from tests.e2e.epp_harness import body_message, headers_message

REPO = Path(__file__).resolve().parents[2]
SYSTEM = "You are the release assistant of the Hollins project. Answer in one short paragraph. " * 8


class Gateway:
    """One gateway's app state, its workers ready and never reached (placement reads their state
    only), and its API-key store, as ``create_app`` makes them for the relay and the picker."""

    def __init__(self) -> None:
        config = parse_config({"workers": {"count": 0, "remote": [
            {"url": f"http://127.0.0.1:{9 + i}", "name": f"worker-{i}", "protocol": "specgate"} for i in range(3)]}},
            REPO)
        app = create_app(config)
        self.state, self.auth = app[STATE_KEY], app[AUTH_KEY]
        for handle in config.workers.remote:
            self.state.fleet.workers[handle.name] = WorkerHandle(
                handle.name, handle.url, cast(Any, None), cast(Any, None), frozenset({"speculative", "plain"}), 4,
                remote=True, protocol="specgate", status="ready")


def body(session_user: str) -> dict[str, Any]:
    return {"model": "specgate-demo", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": session_user}]}


def through_relay(gateway: Gateway, session_id: str, user: str) -> tuple[str, str]:
    state = gateway.state
    req = accept_request(state, "chat", body(user), OPEN)
    session = state.sessions.touch(session_id_of({"X-Session-ID": session_id}, req), 0.0, OPEN.scope)
    placed = pick(state, session, req, state.policy.active)
    commit(state, session, placed.handle, placed.decision, state.policy.active)
    return placed.handle.worker_id, placed.route


def through_picker(gateway: Gateway, session_id: str, user: str) -> tuple[str, str]:
    state = gateway.state
    endpoints = {worker_id: f"127.0.0.1:{9 + i}" for i, worker_id in enumerate(state.fleet.workers)}
    exchange = Exchange(state, gateway.auth, endpoints, 1 << 20)

    async def run() -> None:
        await exchange.handle(headers_message("/v1/chat/completions", extra={"x-session-id": session_id}))
        await exchange.handle(body_message(orjson.dumps(body(user))))
    asyncio.run(run())
    assert exchange.picked is not None and exchange.picked.admission is not None, exchange.outcome
    return exchange.picked.admission.handle.worker_id, exchange.picked.admission.route


def test_a_prefix_recorded_through_the_relay_places_the_pickers_next_request() -> None:
    gateway = Gateway()
    first, why = through_relay(gateway, "relay-a", "What changed in 2.1?")
    assert why == "load"
    # A new session behind Envoy with the same system prompt: the worker the relay sent it to.
    placed, why = through_picker(gateway, "picker-b", "What changed in 2.2?")
    assert (placed, why) == (first, "prefix")
    # ...and the other way round: what the picker recorded, the relay sees.
    other, _ = through_picker(gateway, "picker-c", "Something else entirely. " * 30)
    again, why = through_relay(gateway, "relay-d", "Something else entirely. " * 30)
    assert (again, why) == (other, "prefix")
    handles: list[WorkerHandle] = list(gateway.state.fleet.workers.values())
    assert sum(h.draft_mix.count for h in handles) == 4  # each placement committed once


def test_for_the_same_fleet_both_place_the_same_requests_alike() -> None:
    relay, picker = Gateway(), Gateway()
    requests = [(f"s{i % 4}", f"{'abcd'[i % 3]} question {i}" + " context" * (i % 5) * 20) for i in range(24)]
    by_relay = [through_relay(relay, session, user) for session, user in requests]
    by_picker = [through_picker(picker, session, user) for session, user in requests]
    assert by_relay == by_picker
    assert {why for _, why in by_relay} >= {"load", "sticky"}
