"""Environment overrides and JSON logs, in a real gateway and its real (embedded) worker."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.procs import free_port, wait_ok
from gateway.config.config import ConfigError
from gateway.config.env_overrides import (
    EnvOverrideError,
    load_config_env,
    load_policy_env,
    read_overrides,
    section_keys,
)
from gateway.fleet.worker_output import relay_line
from gateway.tenancy import worker_session_id
from tests.e2e.harness import Gateway, start_gateway, write_config

REPO = Path(__file__).resolve().parents[2]
ENV = {"SPECGATE_POLICY__MAX_BATCH": "32", "SPECGATE_POLICY__BATCH_RESUME": "30",
       "SPECGATE_SESSIONS__HISTORY": "5", "SPECGATE_HOME": "/not/an/override"}
SECRET = "sk-specgate-test-secret-0123456789"
PROMPT = "PROMPT-SENTINEL-never-in-logs"
STRAY = "STRAY-LINE-not-from-a-logger"  # what a worker writes to stderr outside logging


def sim_config(path: Path, **policy: Any) -> Path:
    return write_config(path, workers={"count": 1, "engine": "sim", "sim": {"time_scale": 0}},
                        policy={"probe_every": 3, **policy})


# -- the convention, parsed ----------------------------------------------------------------------------------
def test_values_are_yaml_scalars_typed_by_the_field() -> None:
    overrides = read_overrides({"SPECGATE_POLICY__MAX_TEMPERATURE": "1", "SPECGATE_MODEL__DRAFT": "null",
                                "SPECGATE_SERVER__HOST": "0.0.0.0", "SPECGATE_API_KEYS": "reserved",
                                "SPECGATE_HOME": "x", "OTHER__THING": "y"})
    assert overrides == {"policy": {"max_temperature": ("SPECGATE_POLICY__MAX_TEMPERATURE", 1)},
                         "model": {"draft": ("SPECGATE_MODEL__DRAFT", None)},
                         "server": {"host": ("SPECGATE_SERVER__HOST", "0.0.0.0")}}
    config = load_config_env(REPO / "config.yaml", {"SPECGATE_POLICY__MAX_TEMPERATURE": "1",
                                                    "SPECGATE_SERVER__PORT": "9000", "SPECGATE_MODEL__DRAFT": "null"})
    assert config.policy.max_temperature == 1.0 and type(config.policy.max_temperature) is float
    assert config.server.port == 9000 and config.model.draft is None


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("SPECGATE_POLICY__NOPE", "1", "SPECGATE_POLICY__NOPE: unknown key 'policy.nope'; known: acceptance_floor"),
    ("SPECGATE_NOPE__PORT", "1", "SPECGATE_NOPE__PORT: unknown config section 'nope'; known: auth, epp, model, policy"),
    ("SPECGATE_SERVER__PORT", "x", "SPECGATE_SERVER__PORT: server.port: must be a int (got 'x')"),
    ("SPECGATE_POLICY__MAX_BATCH", "0", "SPECGATE_POLICY__MAX_BATCH: policy.max_batch: must be >= 1 (got 0)"),
    ("SPECGATE_POLICY__PROBE_EVERY", "[1", "SPECGATE_POLICY__PROBE_EVERY: invalid YAML"),
])
def test_bad_variables_are_named(variable: str, value: str, message: str) -> None:
    with pytest.raises(EnvOverrideError) as info:
        load_config_env(REPO / "config.yaml", {variable: value})
    assert str(info.value).startswith(message)
    assert info.value.field == variable
    assert isinstance(info.value, ConfigError)


def test_every_bad_variable_and_field_is_named(tmp_path: Path) -> None:
    path = sim_config(tmp_path / "config.yaml", probe_every=0)
    environ = {"SPECGATE_POLICY__NOPE": "1", "SPECGATE_NOPE__PORT": "1", "SPECGATE_SERVER__PORT": "x",
               "SPECGATE_POLICY__MAX_BATCH": "0"}
    with pytest.raises(ConfigError) as info:
        load_config_env(path, environ)
    assert [p.field for p in info.value.problems] == [
        "SPECGATE_NOPE__PORT", "SPECGATE_POLICY__NOPE", "SPECGATE_SERVER__PORT", "SPECGATE_POLICY__MAX_BATCH",
        "probe_every"]
    with pytest.raises(EnvOverrideError) as reload:
        load_policy_env(path, environ)
    assert [p.field for p in reload.value.problems] == [
        "SPECGATE_NOPE__PORT", "SPECGATE_POLICY__NOPE", "SPECGATE_POLICY__MAX_BATCH", "probe_every"]


def test_every_overridable_key_is_in_the_config_reference() -> None:
    readme = (REPO / "docs" / "config.md").read_text()
    keys = [f"{section}.{key}" for section, names in section_keys().items() for key in sorted(names)]
    assert "tracing.record_prompts" in keys and "server.log_format" in keys
    assert [key for key in keys if f"| `{key}` |" not in readme] == []
    assert "SPECGATE_<SECTION>__<KEY>" in readme and "SPECGATE_API_KEYS" in readme


def test_reload_reapplies_the_environment_and_says_where_values_came_from(tmp_path: Path) -> None:
    path = sim_config(tmp_path / "config.yaml", max_batch=50)
    policy, origins = load_policy_env(path, {"SPECGATE_POLICY__MAX_BATCH": "20", "SPECGATE_POLICY__BATCH_RESUME": "10"})
    assert (policy.max_batch, policy.batch_resume, policy.probe_every) == (20, 10, 3)
    assert (origins["max_batch"], origins["probe_every"], origins["acceptance_floor"]) == ("env", "file", "default")


# -- a real gateway --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("gw-conventions")
    # The worker's interpreter is a wrapper that first writes a line to stderr that no logger
    # formatted (as a C extension's warning, or a crash's last words, would be).
    python = tmp / "python"
    python.write_text(f"#!/bin/sh\necho '{STRAY}: 1 warning' >&2\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    config = write_config(tmp / "config.yaml", workers={"python": str(python)},
                          policy={"probe_every": 3, "max_batch": 50, "batch_resume": 40})
    # The flag outranks the environment's port; --log-format json outranks the file's (text) format.
    gw = start_gateway(config, tmp, env={**ENV, "SPECGATE_SERVER__PORT": str(free_port())},
                       args=("--log-format", "json"))
    yield gw
    gw.stop()


def put_policy(gw: Gateway, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(gw.url + "/admin/policy", data=json.dumps(body).encode(), method="PUT",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def wait_for(gw: Gateway, check: Any, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        view = gw.get_json("/admin/policy")
        if check(view) or time.monotonic() > deadline:
            return view
        time.sleep(0.1)


def test_environment_outranks_the_file_and_survives_reloads(gateway: Gateway) -> None:
    view = gateway.get_json("/admin/policy")
    policy = view["policy"]
    assert (policy["max_batch"], policy["batch_resume"], policy["probe_every"]) == (32, 30, 3)
    assert view["origins"]["max_batch"] == "env" and view["origins"]["probe_every"] == "file"
    assert view["origins"]["acceptance_floor"] == "default"
    # A file edit reloads: the file's new value lands, the environment's still wins its keys.
    raw = yaml.safe_load(gateway.config_path.read_text())
    raw["policy"].update(probe_every=5, max_batch=60)
    gateway.config_path.write_text(yaml.safe_dump(raw))
    view = wait_for(gateway, lambda v: v["policy"]["probe_every"] == 5)
    assert view["policy"]["probe_every"] == 5 and view["policy"]["max_batch"] == 32, view
    assert view["source"] == "file" and view["origins"]["max_batch"] == "env"
    # PUT replaces the running policy, every value the API's, until the next reload from the file.
    view = put_policy(gateway, {"max_batch": 8, "batch_resume": 4})
    assert view["policy"]["max_batch"] == 8 and view["policy"]["probe_every"] == 8
    assert set(view["origins"].values()) == {"api"}
    gateway.process.send_signal(signal.SIGHUP)
    view = wait_for(gateway, lambda v: v["source"] == "sighup")
    assert view["policy"]["max_batch"] == 32 and view["policy"]["probe_every"] == 5
    assert view["origins"]["max_batch"] == "env" and view["origins"]["probe_every"] == "file"


def test_json_logs_carry_request_context_and_no_secrets(gateway: Gateway) -> None:
    """Gateway and worker lines alike: every line one JSON object, tagged, with no secret."""
    body = {"model": "specgate-demo", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(gateway.base_url + "/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {SECRET}",
                                              "X-Session-ID": "log-session"})
    with urllib.request.urlopen(request, timeout=60) as response:
        mode = response.headers["X-Specgate-Mode"]
        completion_id = json.loads(response.read())["id"]

    def entries() -> list[dict[str, Any]]:
        return [json.loads(line) for line in gateway.log().splitlines()]  # each line parses, or this fails

    # A worker never sees the client's session id, only its digest (gateway/tenancy.py): its
    # lines carry that (the open API: scope "").
    worker_session = worker_session_id("", "log-session", None)
    deadline = time.monotonic() + 10
    while sum(e.get("session") in ("log-session", worker_session) for e in entries()) < 2 \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    text, found = gateway.log(), entries()
    assert SECRET not in text and PROMPT not in text
    for entry in found:
        assert {"timestamp", "level", "logger", "message"} <= set(entry), entry
    done = [e for e in found if e.get("session") == "log-session" and e["logger"] == "gateway.relay.relay"]
    assert len(done) == 1, text
    assert done[0]["decision"] == mode and len(done[0]["request_id"]) == 32
    assert done[0]["level"] == "INFO" and "completion request on" in done[0]["message"]
    assert "worker" not in done[0]
    # The worker's line for the same request: its id, the gateway's request id and the session's digest.
    assert not [e for e in found if e.get("session") == "log-session" and "worker" in e], text
    finished = [e for e in found if e.get("session") == worker_session and e["logger"] == "workers.server.app"]
    assert len(finished) == 1, text
    assert finished[0]["worker"] == "worker-0" and finished[0]["request_id"] == done[0]["request_id"]
    assert completion_id in finished[0]["message"]
    # The worker's start-up lines carry its id too (gateway lines do not: the fleet's are about it).
    worker_loggers = {e["logger"] for e in found if e.get("worker") == "worker-0"}
    assert {"workers.server.app", "workers.engines.embedded.measurement.measure"} <= worker_loggers, worker_loggers
    assert not any(e["logger"].startswith("gateway.") for e in found if "worker" in e)
    # A line no logger wrote is wrapped, not lost.
    stray = [e for e in found if STRAY in e["message"]]
    assert stray and stray[0]["message"] == f"{STRAY}: 1 warning", text
    assert (stray[0]["worker"], stray[0]["stream"], stray[0]["level"]) == ("worker-0", "stderr", "WARNING")


@pytest.mark.parametrize(("line", "expected"), [
    (b'{"level": "ERROR", "logger": "workers.engines.embedded.runner", "message": "m", "worker": "w-1"}\n',
     # passed on as written
     {"level": "ERROR", "logger": "workers.engines.embedded.runner", "message": "m", "worker": "w-1"}),
    (b"Traceback (most recent call last):\n",
     {"level": "WARNING", "logger": "workers.output", "message": "Traceback (most recent call last):",
      "worker": "w-1", "stream": "stderr"}),
    (b"[1, 2]\n", {"level": "WARNING", "logger": "workers.output", "message": "[1, 2]", "worker": "w-1"}),
    (b"\xff not utf-8\n", {"level": "WARNING", "message": "\ufffd not utf-8"}),
])
def test_worker_output_lines_come_out_as_json(line: bytes, expected: dict[str, Any],
                                              caplog: pytest.LogCaptureFixture) -> None:
    from workers.api.logs import JsonFormatter

    with caplog.at_level("INFO", logger="workers.output"):
        relay_line("w-1", "stderr", line)
    (record,) = caplog.records
    entry = json.loads(JsonFormatter().format(record))
    assert {key: entry.get(key) for key in expected} == expected


def test_a_standalone_worker_logs_json_warnings_and_crashes_included(tmp_path: Path) -> None:
    """``specgate worker --log-format json``, no gateway: its own lines, a request's, a warning."""
    port = free_port()
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "worker", "--engine", "sim", "--sim-config", '{"time_scale": 0}',
             "--target", str(REPO / "models" / "demo-target"), "--port", str(port), "--worker-id", "solo",
             "--log-format", "json"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ok(process, f"http://127.0.0.1:{port}/health", 120, log_path)
        body = {"model": "specgate-demo", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json", "X-Request-ID": "req-1"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
    entries = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert entries and all(e["worker"] == "solo" for e in entries), entries
    assert [e["request_id"] for e in entries if e["logger"] == "workers.server.app"] == ["req-1"]
    assert PROMPT not in log_path.read_text()
    # What Python would print to stderr unformatted: a warning and an uncaught exception.
    code = ("import sys, warnings; from workers.api.logs import configure; "
            "configure('json', name='w', fields={'worker': 'w'}); warnings.warn('careful'); "
            "raise RuntimeError('boom')")
    crashed = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    assert crashed.returncode == 1
    lines = [json.loads(line) for line in crashed.stderr.splitlines()]
    assert [(e["logger"], e["level"], e["worker"]) for e in lines] == [
        ("py.warnings", "WARNING", "w"), ("py.exceptions", "CRITICAL", "w")]
    assert "careful" in lines[0]["message"] and "RuntimeError: boom" in lines[1]["exception"]


def test_a_bad_variable_stops_the_gateway_naming_it(tmp_path: Path) -> None:
    config = sim_config(tmp_path / "config.yaml")
    with pytest.raises(RuntimeError, match=re.escape("SPECGATE_POLICY__MAX_BATHC: unknown key 'policy.max_bathc'")):
        start_gateway(config, tmp_path, env={"SPECGATE_POLICY__MAX_BATHC": "32"}, ready_timeout_s=60)
