"""Method-aware routing over vLLM servers of one speculative method each (the vLLM lane): a
draft-model server and a prompt-lookup (ngram) server side by side, both through specgate's
per-request K plugin, behind one gateway with ``policy.methods: [draft, ngram]``. A session
reaches each: the draft model where its rules want the draft, the ngram server where they want
lookup (``X-Specgate-Route: method``), and the gateway learns the session's ngram evidence
from what the ngram server's per-request metrics report.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.harness import Gateway, sdk_client, start_gateway, write_config
from tests.e2e.vllm.vllm_harness import ENGINE_K, VllmServer

pytestmark = pytest.mark.vllm

# Code editing: the answer repeats the function it was given, which prompt lookup finds.
FUNCTION = ("def total(items):\n    result = 0\n    for item in items:\n        result = result + item\n"
            "    return result\n")
PROMPT = f"{FUNCTION}\n\n# The same function again:\n{FUNCTION}\n\n# Once more:\ndef total(items):\n"


@pytest.fixture(scope="module")
def methods_gateway(tmp_path_factory: pytest.TempPathFactory, vllm_plugin_server: VllmServer,
                    vllm_ngram_server: VllmServer) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("vllm-methods")
    remote = [{"url": vllm_plugin_server.url, "protocol": "vllm", "max_k": ENGINE_K, "method": "draft_model",
               "name": "vllm-draft"},
              {"url": vllm_ngram_server.url, "protocol": "vllm", "max_k": ENGINE_K, "method": "ngram",
               "name": "vllm-ngram"}]
    config = write_config(tmp / "config.yaml", workers={"count": 0, "remote": remote, "poll_interval_s": 0.2},
                          policy={"methods": ["draft", "ngram"]})
    gateway = start_gateway(config, tmp)
    gateway.wait_workers_ready(2)
    yield gateway
    gateway.stop()


def test_a_session_reaches_the_server_of_each_method_its_rules_want(methods_gateway: Gateway) -> None:
    workers = {w["worker_id"]: w for w in methods_gateway.get_json("/admin/workers")["workers"]}
    assert {w: workers[w]["methods"] for w in workers} == {"vllm-draft": ["draft"], "vllm-ngram": ["ngram"]}
    seen: list[tuple[str, str, str]] = []
    with sdk_client(methods_gateway) as client:
        for _ in range(6):
            raw = client.completions.with_raw_response.create(
                model="specgate-demo", prompt=PROMPT, max_tokens=24, temperature=0,
                extra_headers={"X-Session-ID": "methods-1"})
            completion = raw.parse()
            assert completion.usage is not None and completion.usage.completion_tokens == 24
            seen.append((raw.headers["x-specgate-worker"], raw.headers["x-specgate-mode"],
                         raw.headers["x-specgate-route"]))
    print(f"worker, mode, route per request: {seen}")
    by_worker = {worker: [mode for w, mode, _ in seen if w == worker] for worker in ("vllm-draft", "vllm-ngram")}
    assert all(by_worker.values()), seen  # the session reached both servers
    # Each server ran its own method, as the rules asked: never the other's.
    assert all("method=ngram" in mode for mode in by_worker["vllm-ngram"]), seen
    assert all("method=ngram" not in mode for mode in by_worker["vllm-draft"]), seen
    assert any(route == "method" for _, _, route in seen), seen
    # The ngram server's per-request metrics became the session's lookup evidence.
    view = methods_gateway.get_json("/admin/sessions/methods-1")
    ngram = view["methods"]["ngram"]
    print(f"the session's ngram evidence: {ngram}")
    assert ngram["steps"] > 0 and ngram["drafts_tested"] > 0, view["methods"]
    assert methods_gateway.metric("specgate_routes_total", reason="method") >= 1
