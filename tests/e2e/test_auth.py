"""Access control: API keys, the admin token (or loopback), key-scoped sessions, key rotation,
the refusal to serve a public address without keys, and a TCP worker that serves its gateway only."""

from __future__ import annotations

import hmac
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from unittest import mock

import openai
import pytest
import yaml
from aiohttp.test_utils import make_mocked_request
from prometheus_client import CollectorRegistry

import workers.api.tokens
from bench.procs import free_port
from gateway.auth import AuthStore, check_exposure
from gateway.config.auth import AuthConfig, parse_auth
from gateway.config.config import ConfigError, ServerConfig
from gateway.observe.ops_metrics import OpsMetrics
from gateway.tenancy import Caller
from tests.e2e.harness import MODELS, REPO, Gateway, GatewayFactory, start_gateway, start_tcp_worker, write_config
from workers.api.tokens import Forbidden, Unauthorized, is_loopback

KEY_A, KEY_B, ADMIN = "sk-alpha-0123456789", "sk-bravo-9876543210", "admin-token-55555555"
KEY_C = "sk-charlie-1357924680"
PROMPT = "def add(a, b):\n    "


def call(url: str, token: str | None = None, method: str = "GET", body: Any = None,
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={
        "Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {}),
        **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.loads(error.read())


# -- the rules, unit by unit ---------------------------------------------------------------------------
def _store(config: AuthConfig) -> AuthStore:
    return AuthStore(config, None, ServerConfig(), OpsMetrics.create(CollectorRegistry()))


def _request(path: str, token: str | None = None, peer: str = "127.0.0.1") -> Any:
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (peer, 40000) if name == "peername" else default
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return make_mocked_request("GET", path, headers=headers, transport=transport)


def test_keys_are_compared_in_constant_time_against_every_key() -> None:
    store = _store(AuthConfig(api_keys=(KEY_A, KEY_B)))
    with mock.patch.object(hmac, "compare_digest", wraps=hmac.compare_digest) as spy:
        assert store.api_caller(_request("/v1/models", KEY_A)).scope.startswith("key-")
        # No early exit at the first match: every key is compared.
        assert spy.call_count == 2
        with pytest.raises(Unauthorized):
            store.api_caller(_request("/v1/models", KEY_A[:-1] + "x"))
        assert spy.call_count == 4


def test_scopes_differ_per_key_and_name_no_key() -> None:
    store = _store(AuthConfig(api_keys=(KEY_A, KEY_B)))
    a, b = store.api_caller(_request("/v1/models", KEY_A)), store.api_caller(_request("/v1/models", KEY_B))
    assert a.scope != b.scope
    assert a.tenant == a.scope and b.tenant == b.scope  # a plain key is its own tenant
    assert KEY_A not in repr(a) and KEY_B not in repr(b)
    assert _store(AuthConfig()).api_caller(_request("/v1/models")) == Caller("", "")  # the open API: one scope


def test_keys_of_a_named_tenant_share_the_tenant_not_the_session_scope() -> None:
    auth = parse_auth({"api_keys": [{"key": KEY_A, "tenant": "team-a"}, {"key": KEY_B, "tenant": "team-a"},
                                    KEY_C]}, env={})
    store = _store(auth)
    a, b, c = (store.api_caller(_request("/v1/models", key)) for key in (KEY_A, KEY_B, KEY_C))
    assert a.tenant == b.tenant == "tenant-team-a"
    assert a.scope != b.scope  # sessions stay per key
    assert c.tenant == c.scope != a.tenant
    assert "team-a" in repr(auth) and KEY_A not in repr(auth)


@pytest.mark.parametrize(("entries", "field"), [
    ([{"key": KEY_A, "tenant": ""}], "auth.api_keys[0].tenant"),
    ([{"key": KEY_A, "tenant": "a b"}], "auth.api_keys[0].tenant"),
    ([{"key": KEY_A, "tenant": 7}], "auth.api_keys[0].tenant"),
    ([{"key": KEY_A, "tenant": "x" * 65}], "auth.api_keys[0].tenant"),
    ([{"tenant": "team-a"}], "auth.api_keys[0].key"),
    ([{"key": KEY_A, "team": "a"}], "auth.api_keys[0].team"),
    ([{"key": "short", "tenant": "a"}], "auth.api_keys[0].key"),
    ([{"key": KEY_A, "tenant": "a"}, {"key": KEY_A, "tenant": "b"}], "auth.api_keys[1].tenant"),
])
def test_bad_tenant_entries_are_refused_naming_the_field(entries: list[Any], field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_auth({"api_keys": entries}, env={})
    assert [p.field for p in caught.value.problems] == [field]
    assert KEY_A not in str(caught.value)  # a secret is never in the message


def test_admin_without_a_token_answers_loopback_only() -> None:
    store = _store(AuthConfig(api_keys=(KEY_A,)))
    store.check_admin(_request("/admin/workers", peer="127.0.0.1"))
    store.check_admin(_request("/admin/workers", peer="::1"))
    store.check_admin(_request("/admin/workers", peer="::ffff:127.0.0.1"))
    for peer in ("10.1.2.3", "192.168.0.7", "2001:db8::1"):
        with pytest.raises(Forbidden):
            store.check_admin(_request("/admin/workers", KEY_A, peer=peer))


def test_admin_with_a_token_wants_it_from_everyone() -> None:
    store = _store(AuthConfig(api_keys=(KEY_A,), admin_token=ADMIN))
    with pytest.raises(Unauthorized):
        store.check_admin(_request("/admin/policy", peer="127.0.0.1"))
    with pytest.raises(Forbidden):
        store.check_admin(_request("/admin/policy", KEY_A, peer="127.0.0.1"))
    store.check_admin(_request("/admin/policy", ADMIN, peer="10.9.9.9"))


def test_loopback_rule() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "localhost", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "", "::", "10.0.0.1", "example.com"))


def test_exposure_needs_keys_or_an_explicit_opt_out() -> None:
    with pytest.raises(ConfigError) as refused:
        check_exposure(AuthConfig(), ServerConfig(), "0.0.0.0")
    assert refused.value.field == "auth.api_keys" and "allow_unauthenticated" in str(refused.value)
    check_exposure(AuthConfig(api_keys=(KEY_A,)), ServerConfig(), "0.0.0.0")
    check_exposure(AuthConfig(), ServerConfig(allow_unauthenticated=True), "0.0.0.0")
    check_exposure(AuthConfig(), ServerConfig(), "127.0.0.1")


def test_auth_config_env_alias_and_errors_without_secrets() -> None:
    parsed = parse_auth({"api_keys": [KEY_A]}, env={"SPECGATE_API_KEYS": f" {KEY_B} ,{KEY_A},"})
    assert parsed.api_keys == (KEY_B, KEY_A)
    assert KEY_A not in repr(parsed)
    with pytest.raises(ConfigError) as short:
        parse_auth({"api_keys": ["sk-short-secret-with space"]}, env={})
    assert short.value.field == "auth.api_keys[0]" and "short-secret" not in str(short.value)
    with pytest.raises(ConfigError) as wrong:
        parse_auth({"admin_token": 12345678}, env={})
    assert wrong.value.field == "auth.admin_token" and "12345678" not in str(wrong.value)


def test_resilience_settings_are_validated() -> None:
    from gateway.config.config import parse_config

    with pytest.raises(ConfigError) as bad:
        parse_config({"server": {"max_migrations": -1}}, REPO)
    assert bad.value.field == "server.max_migrations"
    with pytest.raises(ConfigError) as bad:
        parse_config({"server": {"allow_unauthenticated": "yes"}}, REPO)
    assert bad.value.field == "server.allow_unauthenticated"
    config = parse_config({"server": {"drain_timeout_s": 2}, "auth": {"api_keys": [KEY_A]}}, REPO)
    assert config.server.drain_timeout_s == 2.0 and config.auth.api_keys == (KEY_A,)


# -- a real gateway with keys -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def gateway(gateway_factory: GatewayFactory) -> Gateway:
    # The second key comes from the environment alias, which overrides the file's list.
    gw = gateway_factory("auth", workers={"count": 1}, auth={"api_keys": [KEY_A], "admin_token": ADMIN},
                         env={"SPECGATE_API_KEYS": f"{KEY_A},{KEY_B}"})
    gw.headers = {"Authorization": f"Bearer {ADMIN}"}
    return gw


def test_api_keys_missing_wrong_right(gateway: Gateway) -> None:
    status, body = call(gateway.base_url + "/models")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = call(gateway.base_url + "/models", "sk-wrong-000000000")
    assert status == 401 and body["error"]["type"] == "invalid_request_error"
    assert call(gateway.base_url + "/models", KEY_B)[0] == 200
    with openai.OpenAI(base_url=gateway.base_url, api_key="sk-wrong-000000000", max_retries=0) as client, \
            pytest.raises(openai.AuthenticationError):
        client.completions.create(model="specgate-demo", prompt=PROMPT, max_tokens=2)
    with openai.OpenAI(base_url=gateway.base_url, api_key=KEY_A, max_retries=0, timeout=60) as client:
        assert client.completions.create(model="specgate-demo", prompt=PROMPT, max_tokens=2, temperature=0).usage


def test_admin_needs_the_admin_token_and_probes_stay_open(gateway: Gateway) -> None:
    assert call(gateway.url + "/admin/workers")[0] == 401
    status, body = call(gateway.url + "/admin/workers", KEY_A)
    assert status == 403 and body["error"]["code"] == "admin_token_required"
    assert call(gateway.url + "/admin/workers", ADMIN)[0] == 200
    assert call(gateway.url + "/admin/policy", ADMIN, "PUT", {"max_temperature": 0.5})[0] == 200
    assert call(gateway.url + "/admin/policy", KEY_A, "PUT", {"max_temperature": 0.9})[0] == 403
    assert call(gateway.url + "/health")[0] == 200 and call(gateway.url + "/ready")[0] == 200
    with urllib.request.urlopen(gateway.url + "/metrics", timeout=10) as response:
        assert response.status == 200


def test_sessions_are_scoped_to_their_key(gateway: Gateway) -> None:
    body = {"model": "specgate-demo", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    for key in (KEY_A, KEY_A, KEY_B):
        status, _ = call(gateway.base_url + "/completions", key, "POST", body, {"X-Session-ID": "shared-id"})
        assert status == 200
    status, error = call(gateway.url + "/admin/sessions/shared-id", ADMIN)
    assert status == 400 and error["error"]["param"] == "scope"
    scopes = {}
    for key in (KEY_A, KEY_B):
        scope = "key-" + workers.api.tokens.fingerprint(key)
        status, view = call(gateway.url + f"/admin/sessions/shared-id?scope={scope}", ADMIN)
        assert status == 200 and view["scope"] == scope
        scopes[key] = view["requests"]
    # Key B's request with A's session id started a session of its own: it did not ride A's.
    assert scopes == {KEY_A: 2, KEY_B: 1}


def test_keys_never_appear_in_logs_or_admin_output(gateway: Gateway) -> None:
    call(gateway.base_url + "/models", "sk-wrong-000000000")
    views = json.dumps([gateway.get_json(p) for p in ("/admin/policy", "/admin/workers")])
    for secret in (KEY_A, KEY_B, ADMIN, "sk-wrong-000000000"):
        assert secret not in gateway.log() and secret not in views


def test_keys_rotate_on_file_change_and_sighup(tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.yaml", workers={"count": 1}, auth={"api_keys": [KEY_A]})
    gw = start_gateway(config, tmp_path)
    try:
        assert call(gw.base_url + "/models", KEY_A)[0] == 200
        raw = yaml.safe_load(config.read_text())
        raw["auth"]["api_keys"] = [KEY_B]
        config.write_text(yaml.safe_dump(raw))
        _wait_for(lambda: call(gw.base_url + "/models", KEY_A)[0] == 401, gw)
        assert call(gw.base_url + "/models", KEY_B)[0] == 200
        # An invalid section is refused, and the running keys stay; the bad value is not logged.
        raw["auth"]["api_keys"] = ["tiny7"]
        config.write_text(yaml.safe_dump(raw))
        _wait_for(lambda: "auth reload from file rejected" in gw.log(), gw)
        assert call(gw.base_url + "/models", KEY_B)[0] == 200
        assert "tiny7" not in gw.log()
        # SIGHUP reloads too.
        sighups = gw.metric("specgate_auth_reloads_total", source="sighup", result="ok")
        raw["auth"]["api_keys"] = [KEY_A]
        config.write_text(yaml.safe_dump(raw))
        gw.process.send_signal(signal.SIGHUP)
        _wait_for(lambda: gw.metric("specgate_auth_reloads_total", source="sighup", result="ok") > sighups, gw)
        assert call(gw.base_url + "/models", KEY_A)[0] == 200
        assert call(gw.base_url + "/models", KEY_B)[0] == 401
    finally:
        gw.stop()


def _wait_for(condition: Any, gw: Gateway, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"condition not met within {timeout_s}s:\n{gw.log()}")


def test_a_public_address_without_keys_is_refused(tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.yaml", workers={"count": 1})
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECGATE_")}
    run = subprocess.run([sys.executable, "-m", "gateway", "--config", str(config), "--host", "0.0.0.0",
                          "--port", str(free_port())], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "auth.api_keys" in run.stderr and "0.0.0.0" in run.stderr and "allow_unauthenticated" in run.stderr


# -- a TCP worker serves its gateway only ------------------------------------------------------------
def test_tcp_worker_refuses_a_public_bind_without_a_token() -> None:
    env = {k: v for k, v in os.environ.items() if k != "SPECGATE_WORKER_TOKEN"}
    run = subprocess.run([sys.executable, "-m", "workers", "--port", str(free_port()), "--host", "0.0.0.0",
                          "--target", str(MODELS / "demo-target")], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "SPECGATE_WORKER_TOKEN" in run.stderr


def test_tcp_worker_wants_the_gateways_token(tmp_path: Path) -> None:
    token = "worker-token-0123456789"
    process, port = start_tcp_worker(tmp_path, env={"SPECGATE_WORKER_TOKEN": token})
    try:
        url = f"http://127.0.0.1:{port}"
        body = {"model": "specgate-demo", "prompt": PROMPT, "max_tokens": 2}
        assert call(url + "/health")[0] == 200  # liveness stays open
        status, error = call(url + "/v1/completions", None, "POST", body)
        assert status == 401 and error["error"]["code"] == "invalid_api_key"
        assert call(url + "/v1/completions", "worker-token-wrong-000", "POST", body)[0] == 401
        assert call(url + "/specgate/worker")[0] == 401
        assert call(url + "/v1/completions", token, "POST", body)[0] == 200
        # The gateway sends the token to its protocol: specgate remotes.
        remote = {"url": url, "protocol": "specgate", "name": "tcp"}
        config = write_config(tmp_path / "config.yaml", workers={"count": 0, "remote": [remote]},
                              auth={"worker_token": token})
        gw = start_gateway(config, tmp_path)
        try:
            status, answer = call(gw.base_url + "/completions", None, "POST", {**body, "temperature": 0})
            assert status == 200 and answer["usage"]["completion_tokens"] == 2
        finally:
            gw.stop()
        assert token not in (tmp_path / f"worker-{port}.log").read_text()
    finally:
        process.terminate()
        process.wait(timeout=30)
