"""The gateway driving vLLM per request (the vLLM lane, ``make test-vllm``).

- Two local ``workers.engine: vllm`` workers (vLLM's AsyncLLM + the plugin, one engine for
  both modes), through the official openai SDK, streaming and not.
- A stock vLLM OpenAI server with the plugin as a ``protocol: vllm`` remote worker.
In both: a T = 1.0 session runs plain with zero speculative steps in vLLM's own per-request
metrics; a code session at T = 0 speculates; the session's evidence in ``/admin`` equals what
vLLM's per-request metrics add up to. A kill -9 of a vLLM worker is survived.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import Gateway, sdk_client, start_gateway, write_config
from tests.e2e.vllm.vllm_harness import ENGINE_K, STARTUP_TIMEOUT_S, VllmServer, vllm_worker_config

pytestmark = pytest.mark.vllm

CODE = "import os\nimport sys\n\n\ndef main(argv):\n    "


@pytest.fixture(scope="module")
def vllm_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("vllm-gateway")
    config = write_config(tmp / "config.yaml", workers=vllm_worker_config(2))
    gateway = start_gateway(config, tmp, ready_timeout_s=STARTUP_TIMEOUT_S)
    gateway.wait_workers_ready(2, timeout_s=STARTUP_TIMEOUT_S)
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def remote_vllm_gateway(tmp_path_factory: pytest.TempPathFactory,
                        vllm_plugin_server: VllmServer) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("remote-vllm-gateway")
    remote = {"url": vllm_plugin_server.url, "protocol": "vllm", "max_k": ENGINE_K, "name": "vllm-remote"}
    config = write_config(tmp / "config.yaml", workers={"count": 0, "remote": [remote], "poll_interval_s": 0.2})
    gateway = start_gateway(config, tmp)
    yield gateway
    gateway.stop()


def streamed(gateway: Gateway, session: str, temperature: float, max_tokens: int = 32) -> dict[str, Any]:
    """A streamed completion through the SDK; returns headers, text, usage and the tested drafts
    that vLLM's per-request metrics (carried in the chunks' ``specgate.late_steps``) add up to."""
    with sdk_client(gateway) as client, client.completions.with_streaming_response.create(
            model="specgate-demo", prompt=CODE, max_tokens=max_tokens, temperature=temperature, stream=True,
            stream_options={"include_usage": True}, extra_headers={"X-Session-ID": session}) as response:
        headers = dict(response.headers)
        text, usage, tested, accepted, steps = "", None, 0, 0, 0
        for chunk in response.parse():
            extra = chunk.model_extra or {}
            for proposed, ok, count in (extra.get("specgate") or {}).get("late_steps", []):
                tested += count * (ok + (1 if ok < proposed else 0))
                accepted += count * ok
                steps += count
            if chunk.choices:
                text += chunk.choices[0].text
            usage = chunk.usage or usage
    assert usage is not None
    return {"headers": headers, "text": text, "usage": usage, "tested": tested, "accepted": accepted,
            "spec_steps": steps}


def session_view(gateway: Gateway, session: str) -> dict[str, Any]:
    view: dict[str, Any] = gateway.get_json(f"/admin/sessions/{session}")
    return view


@pytest.fixture(params=["local", "remote"])
def any_vllm_gateway(request: pytest.FixtureRequest) -> Gateway:
    name = "vllm_gateway" if request.param == "local" else "remote_vllm_gateway"
    gateway: Gateway = request.getfixturevalue(name)
    return gateway


def test_hot_session_runs_plain(any_vllm_gateway: Gateway) -> None:
    result = streamed(any_vllm_gateway, "hot-session", 1.0)
    assert result["headers"]["x-specgate-mode"] == "plain; reason=high_temperature"
    speculative = (result["usage"].model_extra or {})["speculative"]
    assert speculative["proposed"] == 0 and result["spec_steps"] == 0  # vLLM ran no speculative step
    assert result["usage"].completion_tokens == 32


def test_code_session_speculates_and_evidence_matches_vllm(any_vllm_gateway: Gateway) -> None:
    gateway = any_vllm_gateway
    session = f"code-session-{id(gateway)}"
    tested = accepted = 0
    texts = set()
    for _ in range(3):
        result = streamed(gateway, session, 0.0)
        assert result["headers"]["x-specgate-mode"] == f"speculative; k={ENGINE_K}; reason=default"
        speculative = (result["usage"].model_extra or {})["speculative"]
        assert result["spec_steps"] > 0 and speculative["proposed"] > 0
        assert speculative["accepted"] == result["accepted"]
        tested += result["tested"]
        accepted += result["accepted"]
        texts.add(result["text"])
    assert len(texts) == 1  # greedy
    view = session_view(gateway, session)
    assert view["evidence_drafted_tokens"] == tested
    assert 0.0 < view["acceptance_estimate"] <= 1.0 and accepted <= tested


def test_non_streaming_through_the_sdk(any_vllm_gateway: Gateway) -> None:
    with sdk_client(any_vllm_gateway) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="specgate-demo", messages=[{"role": "user", "content": "Write a function that adds two numbers."}],
            max_tokens=24, temperature=0)
    completion = raw.parse()
    assert raw.headers["X-Specgate-Mode"].startswith("speculative")
    assert completion.choices[0].message.content and completion.usage is not None
    assert completion.usage.completion_tokens <= 24


def _worker_pids(gateway: Gateway) -> dict[str, int]:
    return {w["worker_id"]: w["pid"] for w in gateway.get_json("/admin/workers")["workers"] if w["pid"]}


def _descendants(pid: int) -> set[int]:
    children: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            children.add(int(entry.name))
            children |= _descendants(int(entry.name))
    return children


def test_kill_9_of_a_vllm_worker_is_survived(vllm_gateway: Gateway) -> None:
    gateway = vllm_gateway
    pids = _worker_pids(gateway)
    victim_id = sorted(pids)[0]
    engine_processes = _descendants(pids[victim_id])
    restarts = {w["worker_id"]: w["restarts"] for w in gateway.get_json("/admin/workers")["workers"]}
    os.kill(pids[victim_id], signal.SIGKILL)
    # Requests keep being served by the other worker while the victim is down.
    for i in range(4):
        result = streamed(gateway, f"during-outage-{i}", 0.0, max_tokens=8)
        assert result["usage"].completion_tokens == 8
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        workers = {w["worker_id"]: w for w in gateway.get_json("/admin/workers")["workers"]}
        if workers[victim_id]["restarts"] > restarts[victim_id] and workers[victim_id]["status"] == "ready":
            break
        time.sleep(1)
    else:
        raise AssertionError(f"{victim_id} not ready again:\n{gateway.log()[-4000:]}")
    # vLLM's engine processes of the killed worker do not outlive it.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in engine_processes):
        time.sleep(0.5)
    orphans = [pid for pid in engine_processes if Path(f"/proc/{pid}").exists()]
    assert not orphans, f"engine processes {orphans} outlived their worker"
    result = streamed(gateway, "after-restart", 0.0, max_tokens=8)
    assert result["usage"].completion_tokens == 8


def test_vllm_worker_describes_itself(vllm_gateway: Gateway) -> None:
    workers = vllm_gateway.get_json("/admin/workers")["workers"]
    assert {w["engine"] for w in workers} == {"vllm"}
    assert all(w["modes"] == ["plain", "speculative"] and w["max_k"] == ENGINE_K for w in workers)
    with urllib.request.urlopen(vllm_gateway.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    # One metric table for every engine: the worker's vLLM-named series, from specgate's registry.
    assert "vllm:spec_decode_num_draft_tokens_total" in text and "specgate_worker_batch_depth" in text
