"""The endpoint picker behind the real Envoy: the official ``openai`` SDK talks to Envoy, whose
ext_proc filter asks ``specgate epp``, whose answer Envoy's ORIGINAL_DST cluster follows to a
real sim worker. Both request-body modes Envoy offers the picker are exercised."""

from __future__ import annotations

import contextlib
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from bench.procs import free_port, start_sim_worker, stop
from gateway.epp.envoy_config import BodyMode, epp_bootstrap
from tests.e2e.envoy_harness import Envoy, start_envoy
from tests.e2e.epp_harness import Epp, start_epp

# The sim accepts 20% of the drafts of [math] prompts (far below the floor), 85% of the others.
SIM = {"time_scale": 0.002, "seed": 1, "acceptance": {"math": [[None, 0.2]], "chat": [[None, 0.85]]}}
POLICY = {"num_speculative_tokens": 4, "min_proposals": 16, "acceptance_floor": 0.6, "acceptance_resume": 0.8,
          "probe_every": 1000, "max_temperature": 0.8}
BODY_MODES: tuple[BodyMode, ...] = ("BUFFERED", "FULL_DUPLEX_STREAMED")


@dataclass
class Stack:
    epp: Epp
    envoys: dict[str, Envoy]  # by request-body mode


@contextlib.contextmanager
def running_stack(tmp: Path, workers: list[tuple[dict[str, Any], dict[str, Any]]],
                  **sections: dict[str, Any]) -> Iterator[Stack]:
    """Sim workers (each: its ``workers.remote`` entry without the url, and start_sim_worker's
    keyword arguments), the picker routing to them, and an Envoy per request-body mode."""
    processes: list[subprocess.Popen[bytes]] = []
    envoys: dict[str, Envoy] = {}
    epp: Epp | None = None
    try:
        remote = []
        for entry, options in workers:
            process, port = start_sim_worker(tmp, SIM, **options)
            processes.append(process)
            remote.append({"url": f"http://127.0.0.1:{port}", **entry})
        epp = start_epp(tmp, remote, policy=POLICY, **sections)
        for mode in BODY_MODES:
            bootstrap = epp_bootstrap(free_port(), free_port(), [("127.0.0.1", epp.grpc_port)], body_mode=mode)
            envoys[mode] = start_envoy(bootstrap, tmp / f"envoy-{mode}.log")
        epp.gateway.wait_workers_ready(len(workers))
        yield Stack(epp, envoys)
    finally:
        for envoy in envoys.values():
            envoy.stop()
        if epp is not None:
            epp.stop()
        for process in processes:
            stop(process)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    specgate: list[tuple[dict[str, Any], dict[str, Any]]] = [({"protocol": "specgate", "name": f"w{i}"}, {})
                                                             for i in range(2)]
    with running_stack(tmp_path_factory.mktemp("epp-envoy"), specgate) as built:
        yield built


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
    servers: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"protocol": "openai", "mode": "plain", "name": "plain"}, {"default_k": 0}),
        ({"protocol": "openai", "mode": "speculative", "max_k": 4, "name": "spec"}, {"default_k": 4})]
    with running_stack(tmp_path_factory.mktemp("epp-fixed"), servers) as built:
        yield built


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
    guarded = [({"protocol": "specgate", "name": "guarded"}, {"env": {"SPECGATE_WORKER_TOKEN": WORKER_TOKEN}})]
    with running_stack(tmp_path, guarded, auth={"api_keys": [API_KEY], "worker_token": WORKER_TOKEN}) as built:
        envoy = built.envoys["BUFFERED"]
        with openai.OpenAI(base_url=envoy.base_url, api_key="wrong-key", max_retries=0) as sdk, \
                pytest.raises(openai.AuthenticationError):
            sdk.completions.create(model="specgate-demo", prompt="x", max_tokens=4)
        with openai.OpenAI(base_url=envoy.base_url, api_key=API_KEY, max_retries=0) as sdk:
            completion = sdk.completions.create(model="specgate-demo", prompt="def f():", max_tokens=8,
                                                temperature=0)
        assert completion.choices[0].text and completion.usage is not None


def _messages(epp: Epp) -> dict[str, float]:
    """specgate_epp_messages_total by phase: the ext_proc messages Envoy sent the picker so far."""
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'specgate_epp_messages_total\{phase="(\w+)"\} ([0-9.e+]+)', epp.gateway.metrics())}


def _sent(epp: Epp, before: dict[str, float]) -> dict[str, int]:
    return {phase: int(n - before.get(phase, 0.0)) for phase, n in _messages(epp).items() if n > before.get(phase, 0.0)}


@pytest.mark.parametrize("mode", BODY_MODES)
def test_a_plain_request_gets_the_picks_headers_from_the_route(stack: Stack, mode: BodyMode) -> None:
    """The route adds X-Session-ID, X-Specgate-Mode and X-Specgate-Worker from the pick's
    ``specgate`` metadata; a request without a decision gets none of them."""
    envoy = stack.envoys[mode]
    with client(envoy) as sdk:
        raw = sdk.completions.with_raw_response.create(model="specgate-demo", prompt="def f():", max_tokens=8,
                                                       temperature=1.2, extra_headers={"X-Session-ID": f"bare-{mode}"})
    assert raw.headers["x-session-id"] == f"bare-{mode}"
    assert raw.headers["x-specgate-mode"] == "plain; reason=high_temperature"
    assert raw.headers["x-specgate-worker"] in ("w0", "w1")
    assert "specgate" not in (raw.parse().model_extra or {})
    with urllib.request.urlopen(envoy.base_url + "/models", timeout=30) as models:
        assert models.status == 200 and models.headers.get("x-session-id") is None
        assert models.headers.get("x-specgate-mode") is None


def test_a_plain_request_skips_the_response_phases_a_speculative_one_keeps_them(stack: Stack) -> None:
    """BUFFERED: a plain decision's response passes the picker after its headers (its body is
    never sent), a request without a body's not at all; a speculative one still folds its steps."""
    envoy, epp = stack.envoys["BUFFERED"], stack.epp
    before = _messages(epp)
    complete(envoy, "skip-plain", temperature=1.2)
    assert _sent(epp, before) == {"request_headers": 1, "request_body": 1, "response_headers": 1}
    before = _messages(epp)
    with urllib.request.urlopen(envoy.base_url + "/models", timeout=30) as models:
        models.read()
    assert _sent(epp, before) == {"request_headers": 1}
    before = _messages(epp)
    decision, _, _ = complete(envoy, "skip-speculative")
    assert decision.startswith("speculative")
    sent = _sent(epp, before)
    assert sent["response_headers"] == 1 and sent["response_body"] >= 1, sent
    assert epp.gateway.get_json("/admin/sessions/skip-speculative")["evidence_drafted_tokens"] > 0
