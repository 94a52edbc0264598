"""Cache-aware routing with a load guard (gateway/fleet/routing.py), with two real workers on
the demo pair: a new session whose system prompt a worker served before goes to that worker
(``X-Specgate-Route: prefix``) unless that worker is loaded beyond the guard (``load``); a
session's later turns stay (``sticky``); the reasons are counted. The gateway checks its index
against the cached tokens each worker reports (``prefix_index.hold`` in ``/admin/workers``): a
worker whose cache serves nothing stops drawing new sessions by prefix."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.e2e.harness import Gateway, GatewayFactory

SYSTEM = ("You are the build assistant of the Hollins project. Answer with Python code only, in the "
          "project's style: four-space indents, type hints, docstrings on public functions. ") * 6


@pytest.fixture(scope="module")
def gateway(gateway_factory: GatewayFactory) -> Gateway:
    # The guard trips as soon as one worker has a request more than the other (abs 0, rel 1).
    return gateway_factory("gw-prefix", workers={"count": 2}, workers_ready=2,
                           policy={"route_balance_abs": 0, "route_balance_rel": 1.0})


@pytest.fixture(scope="module")
def forgetting(gateway_factory: GatewayFactory) -> Gateway:
    # A prefix cache of 1 KiB holds no block (a 128-token chunk's K/V is larger): every request
    # misses, and the worker says so.
    return gateway_factory("gw-prefix-forgets", workers={"count": 2, "prefix_cache_mb": 1 / 1024}, workers_ready=2)


def holds(gateway: Gateway) -> dict[str, float]:
    return {w["worker_id"]: w["prefix_index"]["hold"] for w in gateway.get_json("/admin/workers")["workers"]}


async def ask(http: aiohttp.ClientSession, gateway: Gateway, session: str, user: str,
              max_tokens: int = 8) -> tuple[str, str, dict[str, Any]]:
    body = {"model": "specgate-demo", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}
    async with http.post(gateway.url + "/v1/chat/completions", json=body,
                         headers={**gateway.headers, "X-Session-ID": session}) as response:
        answer = await response.json()
        assert response.status == 200, answer
        return response.headers["X-Specgate-Worker"], response.headers["X-Specgate-Route"], answer


def test_a_known_prefix_goes_where_it_went_unless_that_worker_is_loaded(gateway: Gateway) -> None:
    async def run() -> None:
        async with aiohttp.ClientSession() as http:
            first, why, _ = await ask(http, gateway, "prefix-a", "def add(a, b):")
            assert why == "load"  # nothing known yet: least loaded
            again, why, _ = await ask(http, gateway, "prefix-a", "def sub(a, b):")
            assert (again, why) == (first, "sticky")
            # A new session with the same system prompt: the worker that holds it.
            second, why, answer = await ask(http, gateway, "prefix-b", "def mul(a, b):")
            assert (second, why) == (first, "prefix")
            # The worker served what the index expected (its cache reuses whole 128-token chunks).
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert holds(gateway)[first] > 0.5, holds(gateway)
            # That worker busy with a long request: the guard sends the next new session elsewhere.
            long = asyncio.create_task(ask(http, gateway, "prefix-a", "def long_one():", max_tokens=400))
            for _ in range(200):  # until the gateway has it in flight there
                workers = {w["worker_id"]: w["in_flight"] for w in gateway.get_json("/admin/workers")["workers"]}
                if workers[first]:
                    break
                await asyncio.sleep(0.01)
            third, why, _ = await ask(http, gateway, "prefix-c", "def div(a, b):")
            assert third != first and why == "load"
            await long
    asyncio.run(run())
    assert gateway.metric("specgate_routes_total", reason="prefix") >= 1
    assert gateway.metric("specgate_routes_total", reason="sticky") >= 1
    assert gateway.metric("specgate_routes_total", reason="load") >= 2


def test_a_worker_whose_cache_serves_nothing_stops_drawing_sessions_by_prefix(forgetting: Gateway) -> None:
    async def run() -> None:
        async with aiohttp.ClientSession() as http:
            first, why, _ = await ask(http, forgetting, "forget-a", "def add(a, b):")
            assert why == "load"
            new, why, _ = await ask(http, forgetting, "forget-b", "def mul(a, b):")
            assert (new, why) == (first, "prefix")  # nothing reported yet: the index is believed
            reported: list[int] = []
            for turn in range(12):
                worker, why, answer = await ask(http, forgetting, "forget-a", f"def f{turn}(a, b):")
                assert (worker, why) == (first, "sticky")
                reported.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
                if holds(forgetting)[first] < 0.05:
                    break
            assert set(reported) == {0}, reported  # the worker's own measure: nothing came from its cache
            assert holds(forgetting)[first] < 0.05, (reported, holds(forgetting))
            # A new session with the same system prompt: its expected hit there is now below
            # route_min_prefix_hit, so load places it.
            _, why, _ = await ask(http, forgetting, "forget-c", "def div(a, b):")
            assert why == "load"
    asyncio.run(run())
    assert forgetting.metric("specgate_worker_prefix_cache_requests_total", result="hit") == 0
