"""Cache-aware routing with a load guard (gateway/fleet/routing.py), with two real workers on
the demo pair: a new session whose system prompt a worker served before goes to that worker
(``X-Specgate-Route: prefix``) unless that worker is loaded beyond the guard (``load``); a
session's later turns stay (``sticky``); the reasons are counted."""

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
            second, why, _ = await ask(http, gateway, "prefix-b", "def mul(a, b):")
            assert (second, why) == (first, "prefix")
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
