"""Method-aware routing over vLLM servers of one speculative method each (the vLLM lane): a
draft-model server and a prompt-lookup (ngram) server side by side, both through specgate's
per-request K plugin, behind one gateway with ``policy.methods: [draft, ngram]``. A session
reaches each: the draft model where its rules want the draft, the ngram server where they want
lookup (``X-Specgate-Route: method``), and the gateway learns the session's ngram evidence
from what the ngram server's per-request metrics report.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from bench.procs import free_port
from gateway.epp.envoy_config import epp_bootstrap
from tests.e2e.envoy_harness import Envoy, start_envoy
from tests.e2e.epp_harness import Epp, start_epp
from tests.e2e.harness import Gateway, sdk_client, start_gateway, write_config
from tests.e2e.vllm.vllm_harness import ENGINE_K, VllmServer

pytestmark = pytest.mark.vllm

# Code editing: the answer repeats the function it was given, which prompt lookup finds.
FUNCTION = ("def total(items):\n    result = 0\n    for item in items:\n        result = result + item\n"
            "    return result\n")
PROMPT = f"{FUNCTION}\n\n# The same function again:\n{FUNCTION}\n\n# Once more:\ndef total(items):\n"


def two_servers(draft: VllmServer, ngram: VllmServer) -> list[dict[str, object]]:
    """``workers.remote``: the draft-model server and the ngram server, each declaring its method."""
    return [{"url": draft.url, "protocol": "vllm", "max_k": ENGINE_K, "method": "draft_model", "name": "vllm-draft"},
            {"url": ngram.url, "protocol": "vllm", "max_k": ENGINE_K, "method": "ngram", "name": "vllm-ngram"}]


@pytest.fixture(scope="module")
def methods_gateway(tmp_path_factory: pytest.TempPathFactory, vllm_plugin_server: VllmServer,
                    vllm_ngram_server: VllmServer) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("vllm-methods")
    remote = two_servers(vllm_plugin_server, vllm_ngram_server)
    config = write_config(tmp / "config.yaml", workers={"count": 0, "remote": remote, "poll_interval_s": 0.2},
                          policy={"methods": ["draft", "ngram"]})
    gateway = start_gateway(config, tmp)
    gateway.wait_workers_ready(2)
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def methods_envoy(tmp_path_factory: pytest.TempPathFactory, vllm_plugin_server: VllmServer,
                  vllm_ngram_server: VllmServer) -> Iterator[tuple[Epp, Envoy]]:
    """The two servers behind ``specgate epp`` and the real Envoy that asks it."""
    tmp = tmp_path_factory.mktemp("vllm-methods-epp")
    epp = start_epp(tmp, two_servers(vllm_plugin_server, vllm_ngram_server), policy={"methods": ["draft", "ngram"]})
    try:
        proxy = start_envoy(epp_bootstrap(free_port(), free_port(), [("127.0.0.1", epp.grpc_port)]),
                            tmp / "envoy.log")
        try:
            epp.gateway.wait_workers_ready(2)
            yield epp, proxy
        finally:
            proxy.stop()
    finally:
        epp.stop()


def run_session(client: openai.OpenAI, session: str) -> list[tuple[str, str, str]]:
    """Six requests of one session: (X-Specgate-Worker, X-Specgate-Mode, X-Specgate-Route) of each."""
    seen: list[tuple[str, str, str]] = []
    for _ in range(6):
        raw = client.completions.with_raw_response.create(
            model="specgate-demo", prompt=PROMPT, max_tokens=24, temperature=0, extra_headers={"X-Session-ID": session})
        completion = raw.parse()
        assert completion.usage is not None and completion.usage.completion_tokens == 24
        seen.append((raw.headers["x-specgate-worker"], raw.headers["x-specgate-mode"], raw.headers["x-specgate-route"]))
    print(f"worker, mode, route per request: {seen}")
    return seen


def assert_each_server_reached(seen: list[tuple[str, str, str]]) -> None:
    by_worker = {worker: [mode for w, mode, _ in seen if w == worker] for worker in ("vllm-draft", "vllm-ngram")}
    assert all(by_worker.values()), seen  # the session reached both servers
    # Each server ran its own method, as the rules asked: never the other's.
    assert all("method=ngram" in mode for mode in by_worker["vllm-ngram"]), seen
    assert all("method=ngram" not in mode for mode in by_worker["vllm-draft"]), seen
    assert any(route == "method" for _, _, route in seen), seen


def test_a_session_reaches_the_server_of_each_method_its_rules_want(methods_gateway: Gateway) -> None:
    workers = {w["worker_id"]: w for w in methods_gateway.get_json("/admin/workers")["workers"]}
    assert {w: workers[w]["methods"] for w in workers} == {"vllm-draft": ["draft"], "vllm-ngram": ["ngram"]}
    with sdk_client(methods_gateway) as client:
        assert_each_server_reached(run_session(client, "methods-1"))
    # The ngram server's per-request metrics became the session's lookup evidence.
    view = methods_gateway.get_json("/admin/sessions/methods-1")
    ngram = view["methods"]["ngram"]
    print(f"the session's ngram evidence: {ngram}")
    assert ngram["steps"] > 0 and ngram["drafts_tested"] > 0, view["methods"]
    assert methods_gateway.metric("specgate_routes_total", reason="method") >= 1


def test_through_envoy_the_picker_places_a_session_by_method_too(methods_envoy: tuple[Epp, Envoy]) -> None:
    epp, proxy = methods_envoy
    with openai.OpenAI(base_url=proxy.base_url, api_key="unused", max_retries=0, timeout=120) as client:
        assert_each_server_reached(run_session(client, "methods-epp-1"))
    ngram = epp.gateway.get_json("/admin/sessions/methods-epp-1")["methods"]["ngram"]
    print(f"the session's ngram evidence at the picker: {ngram}")
    assert ngram["steps"] > 0 and ngram["drafts_tested"] > 0
    assert epp.gateway.metric("specgate_routes_total", reason="method") >= 1
