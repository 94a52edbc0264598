"""The endpoint picker behind the real Envoy: the official ``openai`` SDK talks to Envoy, whose
ext_proc filter asks ``specgate epp``, whose answer Envoy's ORIGINAL_DST cluster follows to a
real sim worker. Both request-body modes Envoy offers the picker are exercised."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from bench.procs import free_port, start_sim_worker, stop
from gateway.envoy_config import BodyMode, epp_bootstrap
from tests.envoy_harness import Envoy, start_envoy
from tests.epp_harness import Epp, start_epp

# The sim accepts 20% of the drafts of [math] prompts (far below the floor), 85% of the others.
SIM = {"time_scale": 0.002, "seed": 1, "acceptance": {"math": [[None, 0.2]], "chat": [[None, 0.85]]}}
POLICY = {"num_speculative_tokens": 4, "min_proposals": 16, "acceptance_floor": 0.6, "acceptance_resume": 0.8,
          "probe_every": 1000, "max_temperature": 0.8}
BODY_MODES: tuple[BodyMode, ...] = ("BUFFERED", "FULL_DUPLEX_STREAMED")


@dataclass
class Stack:
    epp: Epp
    envoys: dict[str, Envoy]  # by request-body mode
    worker_ports: list[int]


def start_stack(tmp: Path, remote: list[dict[str, Any]], processes: list[subprocess.Popen[bytes]],
                **sections: dict[str, Any]) -> Stack:
    epp = start_epp(tmp, remote, policy=POLICY, **sections)
    envoys: dict[str, Envoy] = {}
    try:
        for mode in BODY_MODES:
            bootstrap = epp_bootstrap(free_port(), free_port(), [("127.0.0.1", epp.grpc_port)], body_mode=mode)
            envoys[mode] = start_envoy(bootstrap, tmp / f"envoy-{mode}.log")
    except BaseException:
        for envoy in envoys.values():
            envoy.stop()
        epp.stop()
        raise
    return Stack(epp, envoys, [])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("epp-envoy")
    processes: list[subprocess.Popen[bytes]] = []
    ports = []
    try:
        for _ in range(2):
            process, port = start_sim_worker(tmp, SIM)
            processes.append(process)
            ports.append(port)
        remote = [{"url": f"http://127.0.0.1:{p}", "protocol": "specgate", "name": f"w{i}"}
                  for i, p in enumerate(ports)]
        built = start_stack(tmp, remote, processes)
        built.worker_ports = ports
        built.epp.gateway.wait_workers_ready(2)
        yield built
        for envoy in built.envoys.values():
            envoy.stop()
        built.epp.stop()
    finally:
        for process in processes:
            stop(process)


def client(envoy: Envoy) -> openai.OpenAI:
    return openai.OpenAI(base_url=envoy.base_url, api_key="unused", max_retries=0, timeout=60)


def complete(envoy: Envoy, session: str, prompt: str = "def add(a, b):", **fields: Any) -> tuple[str, str, Any]:
    """(X-Specgate-Mode, X-Specgate-Worker, the completion) of a non-streaming request."""
    with client(envoy) as sdk:
        raw = sdk.completions.with_raw_response.create(model="specgate-demo", prompt=prompt, max_tokens=24,
                                                       extra_headers={"X-Session-ID": session},
                                                       **{"temperature": 0, **fields})
        assert raw.http_response.status_code == 200
        return raw.headers["x-specgate-mode"], raw.headers["x-specgate-worker"], raw.parse()


@pytest.mark.parametrize("mode", BODY_MODES)
def test_completions_through_envoy_streaming_and_not(stack: Stack, mode: BodyMode) -> None:
    envoy = stack.envoys[mode]
    decision, worker, completion = complete(envoy, f"plain-{mode}")
    assert decision == "speculative; k=4; reason=default" and worker in ("w0", "w1")
    assert completion.usage.completion_tokens == 24 and completion.choices[0].text
    assert "specgate" not in (completion.model_extra or {})  # the step log left the answer
    with client(envoy) as sdk:
        chunks = list(sdk.chat.completions.create(
            model="specgate-demo", messages=[{"role": "user", "content": "hello"}], max_tokens=24, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_headers={"X-Session-ID": f"plain-{mode}"}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text and usage is not None and usage.completion_tokens == 24
    assert (usage.model_extra or {})["speculative"]["proposed"] > 0
    record = stack.epp.gateway.get_json(f"/admin/sessions/plain-{mode}")
    assert record["requests"] == 2 and record["evidence_drafted_tokens"] > 0


def test_a_session_sticks_to_its_endpoint(stack: Stack) -> None:
    envoy = stack.envoys["BUFFERED"]
    for session in ("sticky-a", "sticky-b"):
        workers = {complete(envoy, session)[1] for _ in range(4)}
        assert len(workers) == 1
        assert stack.epp.gateway.get_json(f"/admin/sessions/{session}")["worker"] in workers


def test_a_hot_session_goes_plain(stack: Stack) -> None:
    decision, _, completion = complete(stack.envoys["FULL_DUPLEX_STREAMED"], "hot", temperature=1.2)
    assert decision == "plain; reason=high_temperature"
    assert completion.usage.model_extra["speculative"]["proposed"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_low_acceptance_falls_back_through_envoy(stack: Stack, stream: bool) -> None:
    """The picker learns acceptance only from the response path (step reports in the stream, or
    a whole answer's step log): a session that keeps missing falls back."""
    envoy, session = stack.envoys["BUFFERED"], f"math-{stream}"
    modes = []
    with client(envoy) as sdk:
        for _ in range(12):
            raw = sdk.completions.with_raw_response.create(
                model="specgate-demo", prompt="[math] 2 + 2 =", max_tokens=24, temperature=0, stream=stream,
                extra_headers={"X-Session-ID": session})
            modes.append(raw.headers["x-specgate-mode"])
            if stream:
                list(raw.parse())  # read the stream to its end: the feedback rides on it
            if modes[-1] == "plain; reason=low_acceptance":
                break
    assert modes[-1] == "plain; reason=low_acceptance", modes
    record = stack.epp.gateway.get_json(f"/admin/sessions/{session}")
    assert record["low_acceptance"] and record["acceptance_estimate"] < 0.6


def test_bad_input_is_an_openai_error_from_envoy(stack: Stack) -> None:
    with client(stack.envoys["BUFFERED"]) as sdk:
        with pytest.raises(openai.NotFoundError) as missing:
            sdk.completions.create(model="nope", prompt="x", max_tokens=4)
        assert missing.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as bad:
            sdk.completions.create(model="specgate-demo", prompt="x", max_tokens=-3)
        assert bad.value.param == "max_tokens"


@pytest.fixture(scope="module")
def fixed_modes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two OpenAI servers of one fixed mode each (the sim workers, spoken to as plain OpenAI)."""
    tmp = tmp_path_factory.mktemp("epp-fixed")
    processes: list[subprocess.Popen[bytes]] = []
    try:
        plain, plain_port = start_sim_worker(tmp, SIM, default_k=0)
        processes.append(plain)
        spec, spec_port = start_sim_worker(tmp, SIM, default_k=4)
        processes.append(spec)
        remote: list[dict[str, Any]] = [
                  {"url": f"http://127.0.0.1:{plain_port}", "protocol": "openai", "mode": "plain", "name": "plain"},
                  {"url": f"http://127.0.0.1:{spec_port}", "protocol": "openai", "mode": "speculative", "max_k": 4,
                   "name": "spec"}]
        built = start_stack(tmp, remote, processes)
        built.epp.gateway.wait_workers_ready(2)
        yield built
        for envoy in built.envoys.values():
            envoy.stop()
        built.epp.stop()
    finally:
        for process in processes:
            stop(process)


def test_fixed_mode_servers_get_the_mode_the_rules_want(fixed_modes: Stack) -> None:
    envoy = fixed_modes.envoys["BUFFERED"]
    # Both idle: a new session's first choice is the first listed, the plain server. A cold
    # request moves to the server that speculates; a hot one stays (gateway/admission.py route).
    decision, worker, _ = complete(envoy, "fixed-cold")
    assert (decision, worker) == ("speculative; k=4; reason=default", "spec")
    decision, worker, _ = complete(envoy, "fixed-hot", temperature=1.5)
    assert decision.startswith("plain; ") and worker == "plain"


API_KEY = "client-key-0123456789abcdef0123456789"
WORKER_TOKEN = "worker-token-0123456789abcdef01234567"


def test_api_keys_are_checked_by_the_picker_and_workers_get_the_gateway_token(tmp_path: Path) -> None:
    """The client's key stops at the picker (as at the relay); a specgate worker that serves its
    gateway only gets the gateway's token instead."""
    worker, port = start_sim_worker(tmp_path, SIM, env={"SPECGATE_WORKER_TOKEN": WORKER_TOKEN})
    remote = [{"url": f"http://127.0.0.1:{port}", "protocol": "specgate", "name": "guarded"}]
    built: Stack | None = None
    try:
        built = start_stack(tmp_path, remote, [],
                            auth={"api_keys": [API_KEY], "worker_token": WORKER_TOKEN})
        built.epp.gateway.wait_workers_ready(1)
        envoy = built.envoys["BUFFERED"]
        with openai.OpenAI(base_url=envoy.base_url, api_key="wrong-key", max_retries=0) as sdk, \
                pytest.raises(openai.AuthenticationError):
            sdk.completions.create(model="specgate-demo", prompt="x", max_tokens=4)
        with openai.OpenAI(base_url=envoy.base_url, api_key=API_KEY, max_retries=0) as sdk:
            completion = sdk.completions.create(model="specgate-demo", prompt="def f():", max_tokens=8,
                                                temperature=0)
        assert completion.choices[0].text and completion.usage is not None
    finally:
        if built is not None:
            for envoy in built.envoys.values():
                envoy.stop()
            built.epp.stop()
        stop(worker)
