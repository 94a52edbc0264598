"""The OpenAI API through a real gateway and real worker processes, with the official client."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.admission import user_session_id
from tests.e2e.harness import Gateway, GatewayFactory, sdk_client, target_prepacked_expected
from workers.engines.embedded.kernels import rowgemm

CODE_PROMPT = "def read_lines(path):\n    with open(path) as f:\n        return f."


@pytest.fixture(scope="module")
def gateway(gateway_factory: GatewayFactory) -> Gateway:
    return gateway_factory("gw-api", workers={"count": 2}, server={"max_body_bytes": 65536}, workers_ready=2)


@pytest.fixture
def client(gateway: Gateway) -> Iterator[openai.OpenAI]:
    with sdk_client(gateway) as sdk:
        yield sdk


def raw_post(gateway: Gateway, path: str, body: bytes, headers: dict[str, str] | None = None,
             method: str = "POST") -> tuple[int, dict[str, Any], dict[str, str]]:
    request = urllib.request.Request(gateway.url + path, data=body, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.loads(error.read()), dict(error.headers)


def test_chat_non_streaming_usage(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="specgate-demo", messages=[{"role": "user", "content": "Write a Python function `add`."}],
        max_tokens=12, temperature=0)
    choice = response.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage is not None and usage.prompt_tokens > 5
    assert 1 <= usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if choice.finish_reason == "length":
        assert usage.completion_tokens == 12
    speculative = (usage.model_extra or {})["speculative"]
    assert speculative["mode"] == "speculative"
    assert 0 <= speculative["accepted"] <= speculative["proposed"]


def test_chat_stream_matches_non_stream_at_temperature_zero(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Write a Python function `parse_args`."}]
    full = client.chat.completions.create(model="specgate-demo", messages=messages, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(model="specgate-demo", messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and full.usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_without_include_usage_has_no_usage_chunk(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="specgate-demo", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks and all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_completions_stream_and_not(client: openai.OpenAI) -> None:
    full = client.completions.create(model="specgate-demo", prompt=CODE_PROMPT, max_tokens=16, temperature=0)
    assert full.usage is not None and full.usage.completion_tokens <= 16
    text = full.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="specgate-demo", prompt=CODE_PROMPT, max_tokens=16, temperature=0, stream=True) if c.choices)
    assert streamed == text


def test_stop_string_ends_the_text(client: openai.OpenAI) -> None:
    free = client.completions.create(model="specgate-demo", prompt=CODE_PROMPT, max_tokens=40, temperature=0)
    text = free.choices[0].text
    assert len(text) > 6, text
    stop = text[3:6]
    stopped = client.completions.create(model="specgate-demo", prompt=CODE_PROMPT, max_tokens=40, temperature=0,
                                        stop=[stop])
    assert stopped.choices[0].text == text[:text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["specgate-demo"]


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
    ({"model": "specgate-demo", "messages": []}, 400, "messages"),
    ({"model": "specgate-demo", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({"model": "specgate-demo", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400,
     "temperature"),
    ({"model": "specgate-demo", "messages": [{"role": "user", "content": "x"}], "temperature": 3}, 400,
     "temperature"),
    ({"model": "specgate-demo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "specgate-demo", "messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
    ({"model": "specgate-demo", "messages": [{"role": "user", "content": "x"}], "stop": [1]}, 400, "stop"),
    ({"model": "specgate-demo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, 400,
     "max_tokens"),
    ({"model": "specgate-demo", "messages": [{"role": "user", "content": "x"}], "specgate": {"k": 3}}, 400,
     "specgate"),
    ({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
])
def test_bad_chat_requests(gateway: Gateway, body: dict[str, Any], status: int, param: str) -> None:
    code, payload, _ = raw_post(gateway, "/v1/chat/completions", json.dumps(body).encode())
    assert code == status, payload
    assert payload["error"]["param"] == param
    assert payload["error"]["type"] == "invalid_request_error"
    assert payload["error"]["message"]


def test_bad_requests_through_the_sdk(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="specgate-demo", prompt="x" * 20000, max_tokens=5)
    assert "context" in str(info.value)


@pytest.mark.parametrize(("path", "body", "status"), [
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/chat/completions", b"[1, 2]", 400),
    ("/v1/completions", b'{"model": "specgate-demo", "prompt": ["a", "b"]}', 400),
    ("/v1/chat/completions", b'{"model": "specgate-demo", "messages": [{"role": "user", "content": "'
     + b"x" * 70000 + b'"}]}', 413),
    ("/v1/nothing-here", b"{}", 404),
])
def test_malformed_bodies_and_routes(gateway: Gateway, path: str, body: bytes, status: int) -> None:
    code, payload, _ = raw_post(gateway, path, body)
    assert code == status
    assert set(payload["error"]) >= {"message", "type", "param", "code"}


def test_wrong_method_is_405(gateway: Gateway) -> None:
    code, payload, _ = raw_post(gateway, "/v1/models", b"{}")
    assert code == 405 and payload["error"]["message"]


def test_session_header_user_field_and_new_ids(gateway: Gateway) -> None:
    body = {"model": "specgate-demo", "prompt": "import os\n", "max_tokens": 2, "temperature": 0}
    _, _, headers = raw_post(gateway, "/v1/completions", json.dumps(body).encode(), {"X-Session-ID": "sess-header"})
    assert headers["X-Session-ID"] == "sess-header"
    first_worker = headers["X-Specgate-Worker"]
    for _ in range(3):  # sticky while the worker is healthy
        _, _, again = raw_post(gateway, "/v1/completions", json.dumps(body).encode(), {"X-Session-ID": "sess-header"})
        assert again["X-Specgate-Worker"] == first_worker
    _, _, by_user = raw_post(gateway, "/v1/completions", json.dumps({**body, "user": "alice"}).encode())
    assert by_user["X-Session-ID"] == user_session_id("alice")
    _, _, fresh1 = raw_post(gateway, "/v1/completions", json.dumps(body).encode())
    _, _, fresh2 = raw_post(gateway, "/v1/completions", json.dumps(body).encode())
    assert fresh1["X-Session-ID"] != fresh2["X-Session-ID"]
    record = gateway.get_json("/admin/sessions/sess-header")
    assert record["requests"] == 4 and record["worker"] == first_worker


def test_unknown_session_is_404(gateway: Gateway) -> None:
    with pytest.raises(urllib.error.HTTPError) as info:
        gateway.get_json("/admin/sessions/never-seen")
    with info.value as error:
        assert error.code == 404


def test_health_ready_and_workers(gateway: Gateway) -> None:
    assert gateway.get_json("/health") == {"status": "ok"}
    ready = gateway.get_json("/ready")
    assert ready["workers_ready"] == 2
    workers = gateway.get_json("/admin/workers")["workers"]
    assert {w["worker_id"] for w in workers} == {"worker-0", "worker-1"}
    assert all(w["status"] == "ready" and w["modes"] == ["plain", "speculative"] for w in workers)
    # Each worker's precision as its start-up measurement chose it (workers.dtype auto, exact:
    # the fastest configuration that verifies bit-identically on this CPU, whatever its flags),
    # and the two agree: the second worker read the first one's measurement from the cache.
    precisions = [w["precision"] for w in workers]
    assert precisions[0] == precisions[1]
    chosen = workers[0]["cost_model"]["precision"]
    assert precisions[0]["target"] == chosen["target"] and precisions[0]["draft"] == "float32"
    kernels = precisions[0]["kernels"]  # the kernels' build as measured fastest on this machine
    assert kernels is None or (kernels["build"].startswith("rowgemm-")
                               and tuple(kernels["defines"]) in rowgemm.PREFETCH_CHOICES)
    assert precisions[0]["target_prepacked"] == target_prepacked_expected(chosen["target"]) == chosen["prepacked"]
    # float32 may be measured three times, on the kernels (with float32 FMAs, and with bfloat16
    # products where the CPU has AVX512-BF16) and on F.linear: a candidate is its target, layout
    # and products.
    candidates = {(c["target"], c["prepacked"], c["products"]): c for c in chosen["candidates"]}
    assert {target for target, _, _ in candidates} == {"bfloat16", "float32"}
    assert precisions[0]["products"] == chosen["products"]
    assert precisions[0]["draft_products"] == chosen["products"]  # the draft multiplies as its target does
    if any(c["bit_identical"] for c in candidates.values()):
        served = candidates[(chosen["target"], chosen["prepacked"], chosen["products"])]
        assert chosen["exact"] and served["bit_identical"]


def test_metrics_cover_gateway_and_workers(gateway: Gateway, client: openai.OpenAI) -> None:
    client.completions.create(model="specgate-demo", prompt=CODE_PROMPT, max_tokens=8, temperature=0)
    text = gateway.metrics()
    for name in ("specgate_requests_total", "specgate_time_to_first_token_seconds_bucket",
                 "specgate_inter_token_latency_seconds_bucket", "specgate_e2e_latency_seconds_bucket",
                 "specgate_tokens_total", "specgate_sessions", "specgate_decisions_total", "specgate_worker_up",
                 "vllm:spec_decode_draft_acceptance_rate", "vllm:spec_decode_num_accepted_tokens_total",
                 "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_mean_verification_time_ms",
                 "specgate_worker_batch_depth"):
        assert name in text, name
    assert gateway.metric("specgate_requests_total", route="/v1/completions", status="200") >= 1
    assert gateway.metric("vllm:spec_decode_num_draft_tokens_total") > 0
    # The gateway's own registry and the workers' merged files are one exposition: every
    # family once, and no _created series (the files never had them).
    families = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(families) == len(set(families)), sorted(families)
    assert "_created" not in text


def test_only_workers_write_multiprocess_files(gateway: Gateway, client: openai.OpenAI) -> None:
    """The gateway keeps its own series in memory; its workers write the files it merges."""
    client.completions.create(model="specgate-demo", prompt=CODE_PROMPT, max_tokens=4, temperature=0)
    gateway_pid = gateway.process.pid
    children = Path(f"/proc/{gateway_pid}/task/{gateway_pid}/children").read_text().split()
    directories = set()
    for pid in children:
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if item.startswith(b"PROMETHEUS_MULTIPROC_DIR="):
                directories.add(Path(item.split(b"=", 1)[1].decode()))
    assert len(directories) == 1, directories  # the workers inherit the gateway's directory
    files = [path.name for path in next(iter(directories)).glob("*.db")]
    assert any(name.endswith(f"_{pid}.db") for name in files for pid in children), files
    assert not [name for name in files if name.endswith(f"_{gateway_pid}.db")], files


def test_admin_workers_show_load_and_acceptance(gateway: Gateway) -> None:
    workers = gateway.get_json("/admin/workers")["workers"]
    for worker in workers:
        assert {"batch_depth", "in_flight", "restarts", "stats", "status"} <= set(worker)


def test_config_path_is_reported(gateway: Gateway, tmp_path: Path) -> None:
    view = gateway.get_json("/admin/policy")
    assert view["file"] == str(gateway.config_path.resolve())
    assert view["policy"]["acceptance_floor"] == 0.6
