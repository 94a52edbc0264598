"""Environment overrides and JSON logs, in a real gateway (sim workers: no torch to load)."""

from __future__ import annotations

import json
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import ConfigError
from gateway.env_overrides import EnvOverrideError, load_config_env, load_policy_env, read_overrides, section_keys
from tests.harness import Gateway, free_port, start_gateway, write_config

REPO = Path(__file__).resolve().parents[1]
ENV = {"SPECGATE_POLICY__MAX_BATCH": "32", "SPECGATE_POLICY__BATCH_RESUME": "30",
       "SPECGATE_SESSIONS__HISTORY": "5", "SPECGATE_HOME": "/not/an/override"}
SECRET = "sk-specgate-test-secret-0123456789"
PROMPT = "PROMPT-SENTINEL-never-in-logs"


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
    ("SPECGATE_NOPE__PORT", "1", "SPECGATE_NOPE__PORT: unknown config section 'nope'; known: auth, model, policy"),
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


def test_every_overridable_key_is_in_the_readme_table() -> None:
    readme = (REPO / "README.md").read_text()
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
    config = sim_config(tmp / "config.yaml", max_batch=50, batch_resume=40)
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
    body = {"model": "specgate-demo", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(gateway.base_url + "/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {SECRET}",
                                              "X-Session-ID": "log-session"})
    with urllib.request.urlopen(request, timeout=30) as response:
        mode = response.headers["X-Specgate-Mode"]
    deadline = time.monotonic() + 10
    while '"session": "log-session"' not in gateway.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    text = gateway.log()
    assert SECRET not in text and PROMPT not in text
    entries = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert entries, text
    for entry in entries:
        assert {"timestamp", "level", "logger", "message"} <= set(entry)
    done = [e for e in entries if e.get("session") == "log-session"]
    assert len(done) == 1, text
    assert done[0]["decision"] == mode and len(done[0]["request_id"]) == 32
    assert done[0]["logger"] == "gateway.relay" and done[0]["level"] == "INFO"
    assert "completion request on" in done[0]["message"]


def test_a_bad_variable_stops_the_gateway_naming_it(tmp_path: Path) -> None:
    config = sim_config(tmp_path / "config.yaml")
    with pytest.raises(RuntimeError, match=re.escape("SPECGATE_POLICY__MAX_BATHC: unknown key 'policy.max_bathc'")):
        start_gateway(config, tmp_path, env={"SPECGATE_POLICY__MAX_BATHC": "32"}, ready_timeout_s=60)
