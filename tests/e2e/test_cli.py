"""The ``specgate`` command: its entry point, ``check`` (torch-free, every problem named), help."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gateway.cli import build_parser, check_problems

REPO = Path(__file__).resolve().parents[2]
CLEAN_ENV = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}  # no SPECGATE_* from the caller


def specgate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # The installed console script may point at another checkout: run the module it names.
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env={**CLEAN_ENV, **(env or {})}, timeout=120)


def test_entry_point_is_declared() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"specgate": "gateway.cli:main"}
    module, _, func = scripts["specgate"].partition(":")
    assert callable(getattr(__import__(module, fromlist=[func]), func))
    assert "specgate serve" in (REPO / "Makefile").read_text()


def test_check_accepts_the_repo_config() -> None:
    result = specgate("check", "config.yaml")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "config.yaml: ok"


def test_check_names_every_problem_with_field_and_value(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("server: {port: 70000, log_format: xml}\nsessions: {history: 0}\n"
                    "policy: {max_batch: 0, probe_every: often, flooor: 1}\n")
    result = specgate("check", str(path), env={"SPECGATE_POLICY__NOPE": "1", "SPECGATE_SERVER__HOST": "5"})
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    # Every problem, each once: sections with two and three bad fields, one with one, two bad variables.
    expected = [f"{path}: server.port: must be <= 65535 (got 70000)",
                f"{path}: server.log_format: must be one of text, json (got 'xml')",
                f"{path}: sessions.history: must be >= 1 (got 0)",
                f"{path}: policy.max_batch: must be >= 1 (got 0)",
                f"{path}: policy.probe_every: must be an integer (got 'often')"]
    assert [line for line in expected if line not in lines] == []
    assert any(line.startswith(f"{path}: policy.flooor: unknown field") for line in lines)
    assert any(line.startswith(f"{path}: SPECGATE_POLICY__NOPE: unknown key 'policy.nope'") for line in lines)
    assert f"{path}: SPECGATE_SERVER__HOST: server.host: must be a str (got 5)" in lines
    assert len(lines) == len(set(lines)) == 8, lines
    assert result.stdout == ""


def test_check_warns_that_an_openai_servers_cache_is_not_scoped_when_keys_are_set(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    remote = (f"model: {{target: {REPO / 'models/demo-target'}, draft: null}}\n"
              "workers: {count: 0, remote: [{url: 'http://10.0.0.5:8000', protocol: openai, name: gpu-a},"
              " {url: 'http://10.0.0.6:8000', protocol: vllm, name: gpu-b}]}\n")
    path.write_text(remote + "auth: {api_keys: [sk-aaaaaaaaaaaa, {key: sk-bbbbbbbbbbbb, tenant: team-b}]}\n")
    result = specgate("check", str(path))
    assert result.returncode == 0 and result.stdout.strip() == f"{path}: ok", result.stderr
    warnings = result.stderr.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith(f"{path}: warning: workers.remote[0]: protocol openai "
                                                         "(gpu-a): its own prompt cache"), warnings
    assert "sk-" not in result.stderr  # no secret
    path.write_text(remote)  # an open API is one tenant: nothing to warn of
    result = specgate("check", str(path))
    assert result.returncode == 0 and result.stderr == ""


def test_check_warns_of_an_ngram_server_the_policy_never_chooses(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    remote = (f"model: {{target: {REPO / 'models/demo-target'}, draft: null}}\n"
              "workers: {count: 0, remote: [{url: 'http://10.0.0.5:8081', protocol: llamacpp, name: plain},"
              " {url: 'http://10.0.0.5:8082', protocol: llamacpp, method: ngram, max_k: 48, name: ngram}]}\n")
    path.write_text(remote)
    result = specgate("check", str(path))
    assert result.returncode == 0 and result.stderr == (
        f"{path}: warning: workers.remote[1]: ngram runs ngram for its life, which policy.methods does not list "
        "(got ['draft']): no session moves there for its method; add ngram\n"), result.stderr
    path.write_text(remote + "policy: {methods: [draft, ngram]}\n")
    result = specgate("check", str(path))
    assert result.returncode == 0 and result.stderr == ""
    # A method the protocol cannot run is refused, the field named.
    path.write_text(remote.replace("method: ngram, max_k: 48", "method: suffix, max_k: 48"))
    result = specgate("check", str(path))
    assert result.returncode == 1 and "workers.remote[1].method: must be one of" in result.stderr


def test_check_warns_of_a_head_no_session_may_use_and_refuses_one_on_llamacpp(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    model = f"model: {{target: {REPO / 'models/demo-target'}, draft: {REPO / 'models/demo-draft'}"
    head = model + f", eagle3: {tmp_path}}}\n"
    path.write_text(head)
    result = specgate("check", str(path))
    assert result.returncode == 0 and "model.eagle3: the workers load" in result.stderr
    assert "add eagle3" in result.stderr
    path.write_text(head + "policy: {methods: [draft, eagle3]}\n")
    assert specgate("check", str(path)).stderr == ""
    path.write_text(model + "}\npolicy: {methods: [draft, eagle3]}\n")
    assert "no worker has an EAGLE-3 head" in specgate("check", str(path)).stderr
    path.write_text(model + "}\nworkers: {count: 0, remote: [{url: 'http://10.0.0.5:8082', protocol: llamacpp,"
                    " method: eagle3, max_k: 4}]}\n")
    result = specgate("check", str(path))
    assert result.returncode == 1 and "workers.remote[0].method: " in result.stderr and "GGUF head" in result.stderr


def test_check_a_policy_file_prints_each_bad_field(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    # A mistyped key does not make it a config file: it has policy fields and no config section.
    path.write_text("max_batch: x\nprobe_every: 0\nacceptance_flor: 0.5\nacceptance_floor: 0.9\n"
                    "acceptance_resume: 0.8\n")
    result = specgate("check", str(path))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"{path}: policy.max_batch: must be an integer (got 'x')",
        f"{path}: policy.acceptance_flor: unknown field; did you mean acceptance_floor or acceptance_resume or "
        "acceptance_half_life? (the policy's fields: docs/config.md) (got 0.5)",
        f"{path}: policy.acceptance_resume: must be >= acceptance_floor (0.9) (got 0.8)",
        f"{path}: policy.probe_every: must be >= 1 (got 0)",
    ]
    # As a reload would: the environment's values are checked, and blamed on their variable.
    problems = check_problems(path, environ={"SPECGATE_POLICY__MAX_TEMPERATURE": "-1"})
    assert len(problems) == 5
    assert "SPECGATE_POLICY__MAX_TEMPERATURE: policy.max_temperature: must be >= 0 (got -1.0)" in problems


def test_check_bare_policy_file_as_a_put_body(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("max_batch: 32\nbatch_resume: 24\n")
    assert specgate("check", str(good)).returncode == 0
    assert check_problems(good, environ={"SPECGATE_POLICY__BATCH_RESUME": "40"}) == [
        "SPECGATE_POLICY__BATCH_RESUME: policy.batch_resume: must be in 1..max_batch (32) (got 40)"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("acceptance_floor: 2\n")
    result = specgate("check", str(bad))
    assert result.returncode == 1
    assert result.stderr.strip() == f"{bad}: policy.acceptance_floor: must be between 0 and 1 (got 2.0)"


def test_check_refuses_what_the_safe_loader_refuses(tmp_path: Path) -> None:
    path = tmp_path / "aliases.yaml"
    path.write_text("a: &x [1]\nb: *x\n")
    result = specgate("check", str(path))
    assert result.returncode == 1
    assert "anchors and aliases" in result.stderr
    missing = specgate("check", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 1 and "cannot read" in missing.stderr


def test_check_path_imports_no_torch() -> None:
    code = ("import sys; from pathlib import Path; from gateway.cli import main; "
            "rc = main(['check', 'config.yaml']); "
            "heavy = sorted(m for m in ('torch', 'aiohttp', 'uvloop', 'prometheus_client') if m in sys.modules); "
            "print(rc, heavy)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=CLEAN_ENV,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "0 []"


@pytest.mark.parametrize("command", ["serve", "check", "worker"])
def test_subcommand_help(command: str) -> None:
    result = specgate(command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: specgate {command} ")
    expected = {"serve": ["--config", "--host", "--port", "--log-format", "SPECGATE_<SECTION>__<KEY>"],
                "check": ["--kind", "field and", "value"], "worker": ["--target", "--uds", "--engine"]}[command]
    for text in expected:
        assert text in result.stdout


def test_top_level_help_lists_the_subcommands() -> None:
    text = build_parser().format_help()
    for command in ("serve", "worker", "check"):
        assert command in text
