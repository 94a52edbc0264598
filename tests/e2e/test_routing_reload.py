"""The ``routing:`` section reloads live, under load, like the policy (gateway/scheduling/store.py):
a real gateway over two sim workers, sessions sending requests throughout while the section is
rewritten again and again. No request fails; a good section takes effect (here: without
``sticky-placement`` and with the prefix scorer at weight 0, a session's later turns are placed
by load, never ``sticky`` nor ``prefix``); a bad one is refused naming the field, and the old
pipeline keeps serving. ``GET /admin/routing`` shows what runs."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
import yaml

from gateway.scheduling.config import routing_from_policy
from policies import PolicyConfig
from tests.e2e.harness import Gateway, GatewayFactory, put_policy

DEADLINE_S = 5.0
SYSTEM = "You are the on-call assistant. Answer in one line. " * 6


def default_routing() -> dict[str, Any]:
    return routing_from_policy(PolicyConfig()).as_dict()


def unsticky_routing() -> dict[str, Any]:
    section = default_routing()
    profile = section["schedulingProfiles"][0]["plugins"]
    profile[:] = [p for p in profile if p["pluginRef"] != "sticky-placement"]
    next(p for p in profile if p["pluginRef"] == "prefix-cache-scorer")["weight"] = 0.0
    return section


def bad_routing() -> dict[str, Any]:
    section = copy.deepcopy(default_routing())
    next(p for p in section["schedulingProfiles"][0]["plugins"] if p["pluginRef"] == "load-scorer")["weight"] = 5000
    return section


@pytest.fixture(scope="module")
def gateway(gateway_factory: GatewayFactory) -> Gateway:
    return gateway_factory("gw-routing-reload", workers={"count": 2, "engine": "sim", "sim": {"time_scale": 0.0}},
                           workers_ready=2, routing=default_routing())


def write_routing(gateway: Gateway, section: dict[str, Any]) -> None:
    config = yaml.safe_load(gateway.config_path.read_text())
    config["routing"] = section
    text = yaml.safe_dump(config, sort_keys=False)
    gateway.config_path.write_text(text + "\n" * (len(text) % 3))  # a new size: the watcher sees every write


def wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S} s: {what}"
        time.sleep(0.05)


def routing_view(gateway: Gateway) -> dict[str, Any]:
    view: dict[str, Any] = gateway.get_json("/admin/routing")
    return view


def refs(view: dict[str, Any]) -> list[str]:
    return [p["pluginRef"] for p in view["routing"]["schedulingProfiles"][0]["plugins"]]


async def load(gateway: Gateway, stop: asyncio.Event, sent: list[tuple[float, int, str]]) -> None:
    """Eight sessions, each sending turn after turn until ``stop``: (when, status, route) per request."""
    async def session(http: aiohttp.ClientSession, name: str) -> None:
        turn = 0
        while not stop.is_set():
            turn += 1
            body = {"model": "specgate-demo", "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{name} {turn}"}]}
            async with http.post(gateway.url + "/v1/chat/completions", json=body,
                                 headers={**gateway.headers, "X-Session-ID": name}) as response:
                await response.read()
                sent.append((time.monotonic(), response.status, response.headers.get("X-Specgate-Route", "")))
    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(session(http, f"s{i}") for i in range(8)))


def test_routing_reloads_under_load_and_a_bad_section_keeps_the_old_one(gateway: Gateway) -> None:
    original = gateway.config_path.read_text()
    sent: list[tuple[float, int, str]] = []
    marks: dict[str, float] = {}

    async def run() -> None:
        stop = asyncio.Event()
        traffic = asyncio.create_task(load(gateway, stop, sent))
        loop = asyncio.get_running_loop()

        async def step(name: str, section: dict[str, Any], check: Callable[[], bool]) -> None:
            write_routing(gateway, section)
            await loop.run_in_executor(None, wait_for, check, name)
            marks[name] = time.monotonic()
            await asyncio.sleep(0.4)
        try:
            await asyncio.sleep(0.4)
            for _ in range(3):  # a storm: good, bad, good, ...
                await step("unsticky", unsticky_routing(),
                           lambda: "sticky-placement" not in refs(routing_view(gateway)))
                failed = gateway.metric("specgate_policy_reloads_total", result="failed")
                await step("bad", bad_routing(), lambda f=failed: gateway.metric(  # type: ignore[misc]
                    "specgate_policy_reloads_total", result="failed") > f)
                view = routing_view(gateway)
                assert "sticky-placement" not in refs(view)  # the old (unsticky) pipeline keeps serving
                assert "weight: must be a number in 0..1000 (got 5000)" in view["last_error"]
                assert "routing.schedulingProfiles[0].plugins[" in view["last_error"]
                await step("sticky", default_routing(), lambda: "sticky-placement" in refs(routing_view(gateway)))
        finally:
            stop.set()
            await traffic
    try:
        asyncio.run(run())
    finally:
        gateway.config_path.write_text(original)
    assert sent and all(status == 200 for _, status, _ in sent), [s for s in sent if s[1] != 200][:5]
    assert len(sent) > 100
    # After the unsticky section took effect and before the next write: no turn stuck, none by prefix.
    unsticky = [route for at, _, route in sent if marks["unsticky"] + 0.05 < at < marks["unsticky"] + 0.35]
    assert unsticky and set(unsticky) == {"load"}, unsticky
    sticky = [route for at, _, route in sent if marks["sticky"] + 0.05 < at]
    assert "sticky" in sticky
    assert routing_view(gateway)["source"] == "routing section"


def test_a_policy_put_may_not_change_what_the_routing_section_says(gateway: Gateway) -> None:
    policy = gateway.get_json("/admin/policy")["policy"]

    def put(changes: dict[str, Any]) -> tuple[int, Any]:
        return put_policy(gateway, json.dumps({**policy, **changes}).encode(), "application/json")
    status, answer = put({"route_prefix_weight": 9.0})
    assert status == 400 and answer["error"]["param"] == "policy.route_prefix_weight"
    assert "set by the config file's routing section (prefix-cache-scorer)" in answer["error"]["message"]
    status, answer = put({"probe_every": policy["probe_every"] + 1})
    assert status == 200 and answer["policy"]["probe_every"] == policy["probe_every"] + 1
    put({})
