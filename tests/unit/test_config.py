"""config.yaml parsing: the repo's file loads, paths resolve against the file, errors name field and value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config.config import (
    ConfigError,
    GatewayConfig,
    ModelConfig,
    RemoteWorker,
    ServerConfig,
    SessionsConfig,
    WorkersConfig,
    load_config,
    load_policy_file,
    parse_config,
    parse_policy,
)
from policies import PolicyConfig, PolicyConfigError

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "config.yaml"
BASE = Path("/srv/specgate")  # parse_config never touches the filesystem: any base will do


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --------------------------------------------------------------------------------------------
# The repo's config.yaml


def test_repo_config_loads() -> None:
    config = load_config(CONFIG)
    assert config.source == CONFIG.resolve()
    assert config.server == ServerConfig()
    # the file's deliberate departures from the defaults: the real pair and its context window
    assert config.workers == WorkersConfig(max_model_len=2048)
    assert config.sessions == SessionsConfig()
    assert config.model == ModelConfig(name="smollm2-135m-instruct-q4_1",
                                       target=REPO / "models/smollm2-135m-instruct-q4_1",
                                       draft=REPO / "models/smollm2-draft", eagle3=REPO / "models/smollm2-eagle3")


def test_repo_config_policy_is_the_files_values() -> None:
    section = yaml.safe_load(CONFIG.read_text())["policy"]
    config = load_config(CONFIG)
    assert config.policy == PolicyConfig.from_mapping(section)
    # (a list in the file, tree_shapes, is a tuple in the frozen policy)
    file_values = {key: tuple(v) if isinstance(v, list) else v for key, v in section.items()}
    assert config.policy.as_dict() == {key: file_values.get(key, v) for key, v in PolicyConfig().as_dict().items()}
    # the file documents the defaults; a changed default or a changed file shows up here. The
    # deliberate departures: the real pair's K is auto (the default, 6, is the demo pair's best),
    # sessions choose among all four methods (the default, the draft alone, is today's behaviour),
    # and the floor and temperature rule wait where the worker's costs say speculation pays
    # (free_batch: auto; bench.tasks measured the floor costing 5-25% on the real pair)
    assert file_values["num_speculative_tokens"] == "auto"
    assert config.policy == PolicyConfig.from_mapping({"num_speculative_tokens": "auto", "free_batch": "auto",
                                                       "methods": ["draft", "eagle3", "ngram", "suffix"]})
    assert load_policy_file(CONFIG) == config.policy


def test_repo_config_types_follow_the_dataclasses() -> None:
    config = load_config(CONFIG)
    assert type(config.server.worker_timeout_s) is float  # written as 60
    assert type(config.workers.startup_timeout_s) is float  # written as 120
    assert type(config.policy.acceptance_half_life) is float  # written as 64
    assert config.workers.remote == ()  # written as []


def test_repo_config_paths_resolve_against_the_files_directory(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    copy = write(tmp_path / "deploy" / "config.yaml", CONFIG.read_text())
    monkeypatch.chdir(tmp_path)
    config = load_config(Path("deploy/config.yaml"))  # a relative path to the file, from elsewhere
    assert config.source == copy.resolve()
    assert config.model.target == copy.resolve().parent / "models/smollm2-135m-instruct-q4_1"
    assert config.model.draft == copy.resolve().parent / "models/smollm2-draft"
    assert config.model.target.is_absolute()


# --------------------------------------------------------------------------------------------
# parse_config / load_config: valid input


def test_empty_config_is_all_defaults() -> None:
    empty: tuple[dict[str, Any] | None, ...] = (None, {})
    for raw in empty:
        config = parse_config(raw, BASE)
        assert config == GatewayConfig(
            model=ModelConfig(target=BASE / "models/demo-target", draft=BASE / "models/demo-draft"))
        assert config.policy == PolicyConfig()
        assert config.source is None


@pytest.mark.parametrize("raw", [
    {"server": None, "model": None, "workers": None, "sessions": None, "policy": None},
    {"server": {}, "model": {}, "workers": {}, "sessions": {}, "policy": {}},
])
def test_empty_sections_are_defaults(raw: dict[str, Any]) -> None:
    assert parse_config(raw, BASE) == parse_config({}, BASE)


def test_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "etc" / "specgate.yaml", """
model:
  target: weights/target
  draft: /opt/models/draft
workers:
  socket_dir: run/sockets
""")
    monkeypatch.chdir(tmp_path)
    config = load_config(path)
    etc = (tmp_path / "etc").resolve()
    assert config.model.target == etc / "weights/target"
    assert config.model.draft == Path("/opt/models/draft")  # absolute paths stay as written
    assert config.workers.socket_dir == etc / "run/sockets"


def test_null_draft_means_plain_only() -> None:
    config = parse_config({"model": {"draft": None}}, BASE)
    assert config.model.draft is None
    assert config.model.target == BASE / "models/demo-target"


def test_every_section_is_read() -> None:
    config = parse_config({
        "server": {"host": "0.0.0.0", "port": 0, "max_body_bytes": 1024, "worker_timeout_s": 0.1},
        "model": {"name": "m", "target": "t", "draft": "d"},
        "workers": {"count": 3, "max_slots": 4, "max_queue": 1, "max_k": 0, "threads": 2, "dtype": "float32",
                    "draft_dtype": "bfloat16", "startup_timeout_s": 1, "poll_interval_s": 0.05, "restart_backoff_s": 0,
                    "restart_backoff_max_s": 0},
        "sessions": {"max_sessions": 1, "idle_ttl_s": 1, "history": 1},
        "policy": {"max_batch": 8, "batch_resume": 2, "probe_every": 1},
    }, BASE)
    assert config.server == ServerConfig("0.0.0.0", 0, 1024, 0.1)
    assert config.model == ModelConfig("m", BASE / "t", BASE / "d")
    assert config.workers == WorkersConfig(count=3, max_slots=4, max_queue=1, max_k=0, threads=2, dtype="float32",
                                           draft_dtype="bfloat16", startup_timeout_s=1.0, poll_interval_s=0.05,
                                           restart_backoff_s=0.0, restart_backoff_max_s=0.0)
    assert config.sessions == SessionsConfig(1, 1.0, 1)
    assert config.policy == PolicyConfig(max_batch=8, batch_resume=2, probe_every=1)


def test_remote_workers() -> None:
    config = parse_config({"workers": {"count": 0, "remote": [
        {"url": "http://10.0.0.5:8001/", "mode": "plain", "name": "vllm-a"},
        {"url": "https://10.0.0.6:8001", "mode": "speculative", "max_k": 4},
        {"url": "http://10.0.0.7:8001/"},
        {"url": "http://10.0.0.8:8001", "protocol": "vllm", "max_k": 3, "method": "ngram", "name": "ngram-a"},
    ]}}, BASE)
    assert config.workers.count == 0
    assert config.workers.remote == (
        RemoteWorker("http://10.0.0.5:8001", "plain", "vllm-a", 0),
        RemoteWorker("https://10.0.0.6:8001", "speculative", "https://10.0.0.6:8001", 4),
        RemoteWorker("http://10.0.0.7:8001", "plain", "http://10.0.0.7:8001", 0),  # defaults; slash stripped
        RemoteWorker("http://10.0.0.8:8001", "plain", "ngram-a", 3, "vllm", "ngram"),
    )


def test_an_eagle3_head_and_an_eagle3_server() -> None:
    """model.eagle3 resolves against the file (default: none); a vLLM server may run eagle3 for its life."""
    assert parse_config({}, BASE).model.eagle3 is None
    remote = {"url": REMOTE, "protocol": "vllm", "max_k": 3, "method": "eagle3"}
    config = parse_config({"model": {"eagle3": "models/smollm2-eagle3"}, "workers": {"remote": [remote]}}, BASE)
    assert config.model.eagle3 == BASE / "models/smollm2-eagle3"
    assert config.workers.remote[0].method == "eagle3"


def test_remote_workers_alongside_local_ones() -> None:
    config = parse_config({"workers": {"remote": [{"url": "http://a:1"}]}}, BASE)
    assert config.workers.count == 2
    assert len(config.workers.remote) == 1


# --------------------------------------------------------------------------------------------
# parse_config: errors name the dotted field and the value

REMOTE = "http://10.0.0.5:8001"
ERRORS: list[tuple[Any, str, Any]] = [
    # (raw config, dotted field, bad value)
    ({"servr": {"port": 1}}, "servr", {"port": 1}),
    ({"policies": {}}, "policies", {}),
    ({"server": [8000]}, "server", [8000]),
    ({"workers": "two"}, "workers", "two"),
    ({"server": {"port": "x"}}, "server.port", "x"),
    ({"server": {"port": True}}, "server.port", True),
    ({"server": {"port": 80.5}}, "server.port", 80.5),
    ({"server": {"port": -1}}, "server.port", -1),
    ({"server": {"host": 127}}, "server.host", 127),
    ({"server": {"max_body_bytes": 1023}}, "server.max_body_bytes", 1023),
    ({"server": {"worker_timeout_s": 0.05}}, "server.worker_timeout_s", 0.05),
    ({"server": {"worker_timeout_s": "60s"}}, "server.worker_timeout_s", "60s"),
    ({"server": {"timeout": 5}}, "server.timeout", 5),
    ({"model": {"target": 5}}, "model.target", 5),
    ({"model": {"target": None}}, "model.target", None),
    ({"model": {"draft": ["a"]}}, "model.draft", ["a"]),
    ({"model": {"name": None}}, "model.name", None),
    ({"model": {"tokenizer": "t"}}, "model.tokenizer", "t"),
    ({"workers": {"foo": 1}}, "workers.foo", 1),
    ({"workers": {"count": -1}}, "workers.count", -1),
    ({"workers": {"count": "2"}}, "workers.count", "2"),
    ({"workers": {"count": 0}}, "workers.count", 0),  # nothing would serve
    ({"workers": {"count": 0, "remote": []}}, "workers.count", 0),
    ({"workers": {"count": 0, "remote": None}}, "workers.count", 0),
    ({"workers": {"dtype": "float16"}}, "workers.dtype", "float16"),
    ({"workers": {"draft_dtype": "int8"}}, "workers.draft_dtype", "int8"),
    ({"workers": {"dtype": "q4_1", "engine": "vllm"}}, "workers.dtype", "q4_1"),  # the blocks are the embedded's
    ({"workers": {"engine": "tensorrt"}}, "workers.engine", "tensorrt"),
    ({"workers": {"vllm_args": ["enforce_eager"]}}, "workers.vllm_args", ["enforce_eager"]),
    ({"workers": {"vllm_args": {"scheduler_cls": "x.Y"}}}, "workers.vllm_args.scheduler_cls", "x.Y"),
    ({"workers": {"remote": [{"url": "http://h:1", "protocol": "grpc"}]}}, "workers.remote[0].protocol", "grpc"),
    ({"workers": {"max_slots": 0}}, "workers.max_slots", 0),
    ({"workers": {"max_queue": 0}}, "workers.max_queue", 0),
    ({"workers": {"max_k": -1}}, "workers.max_k", -1),
    ({"workers": {"threads": 0}}, "workers.threads", 0),
    ({"workers": {"startup_timeout_s": 0.5}}, "workers.startup_timeout_s", 0.5),
    ({"workers": {"poll_interval_s": 0.01}}, "workers.poll_interval_s", 0.01),
    ({"workers": {"restart_backoff_s": -1}}, "workers.restart_backoff_s", -1.0),
    ({"workers": {"restart_backoff_max_s": False}}, "workers.restart_backoff_max_s", False),
    ({"workers": {"socket_dir": 3}}, "workers.socket_dir", 3),
    ({"workers": {"remote": {"url": REMOTE}}}, "workers.remote", {"url": REMOTE}),
    ({"workers": {"remote": [REMOTE]}}, "workers.remote[0]", REMOTE),
    ({"workers": {"remote": [{"url": "ftp://10.0.0.5"}]}}, "workers.remote[0].url", "ftp://10.0.0.5"),
    ({"workers": {"remote": [{"url": "10.0.0.5:8001"}]}}, "workers.remote[0].url", "10.0.0.5:8001"),
    ({"workers": {"remote": [{"mode": "plain"}]}}, "workers.remote[0].url", None),
    ({"workers": {"remote": [{"url": REMOTE, "mode": "speculative"}]}}, "workers.remote[0].max_k", 0),
    ({"workers": {"remote": [{"url": REMOTE, "mode": "speculative", "max_k": 0}]}}, "workers.remote[0].max_k", 0),
    ({"workers": {"remote": [{"url": REMOTE, "max_k": -1}]}}, "workers.remote[0].max_k", -1),
    ({"workers": {"remote": [{"url": REMOTE}, {"url": REMOTE, "mode": "fast"}]}}, "workers.remote[1].mode", "fast"),
    ({"workers": {"remote": [{"url": REMOTE, "port": 1}]}}, "workers.remote[0].port", 1),
    ({"workers": {"remote": [{"url": REMOTE, "protocol": "vllm", "method": "medusa"}]}}, "workers.remote[0].method",
     "medusa"),
    ({"workers": {"remote": [{"url": REMOTE, "protocol": "specgate", "method": "ngram"}]}},
     "workers.remote[0].method", "ngram"),
    ({"workers": {"remote": [{"url": REMOTE, "name": 7}]}}, "workers.remote[0].name", 7),
    ({"sessions": {"max_sessions": 0}}, "sessions.max_sessions", 0),
    ({"sessions": {"idle_ttl_s": "long"}}, "sessions.idle_ttl_s", "long"),
    ({"sessions": {"history": 0}}, "sessions.history", 0),
    ({"sessions": {"ttl": 1}}, "sessions.ttl", 1),
]


@pytest.mark.parametrize(("raw", "field", "value"), ERRORS)
def test_errors_name_field_and_value(raw: Any, field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(raw, BASE)
    assert info.value.field == field
    assert info.value.value == value
    message = str(info.value)
    assert message.startswith(f"{field}: ")
    assert message.endswith(f"(got {value!r})")


@pytest.mark.parametrize("raw", [[1, 2], "server: {}", 3])
def test_top_level_must_be_a_mapping(raw: Any) -> None:
    with pytest.raises(ConfigError, match=r"^\(top level\): config must be a mapping"):
        parse_config(raw, BASE)


@pytest.mark.parametrize(("policy", "field", "value"), [
    ({"max_batch": 0}, "max_batch", 0),
    ({"acceptance_floor": 1.5}, "acceptance_floor", 1.5),
    ({"probe_every": "often"}, "probe_every", "often"),
    ({"flooor": 0.5}, "flooor", 0.5),
    ([1, 2], "(section)", [1, 2]),
])
def test_policy_errors_name_the_policy_field(policy: Any, field: str, value: Any) -> None:
    for parse in (lambda: parse_config({"policy": policy}, BASE), lambda: parse_policy(policy)):
        with pytest.raises(PolicyConfigError) as info:
            parse()
        assert info.value.field == field
        assert str(info.value).startswith(f"policy.{field}: ")
        assert str(info.value).endswith(f"(got {value!r})")


def test_huge_int_for_a_float_field_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^server\.worker_timeout_s: "):
        parse_config({"server": {"worker_timeout_s": 10**400}}, BASE)


def test_every_bad_field_of_every_section_is_reported() -> None:
    raw = {"server": {"port": -1, "host": 5, "colour": "red"}, "sessions": {"history": 0},
           "workers": {"count": 0, "max_k": -1, "remote": [{"url": "ftp://x", "mode": "fast"}, 7]},
           "policy": {"max_batch": 0, "probe_every": "often"}, "tracing": {"otlp_endpoint": "x", "enabled": 1},
           "auth": {"admin_token": "short", "protect_probes": "yes", "nope": 1}, "extra": {},
           "state": {"backend": "etcd", "redis_url": "http://x"}, "epp": {"port": 70000}}
    with pytest.raises(ConfigError) as info:
        parse_config(raw, BASE)
    assert str(info.value) == ("extra: unknown field; known: auth, epp, model, policy, routing, server, sessions, "
                               "state, tracing, workers (got {})")
    assert [p.field for p in info.value.problems] == [
        "extra", "server.colour", "server.host", "server.port", "workers.max_k", "workers.remote[0].url",
        "workers.remote[0].mode", "workers.remote[1]", "sessions.history", "probe_every", "max_batch",
        "tracing.otlp_endpoint", "tracing.enabled", "auth.nope", "auth.admin_token", "auth.protect_probes",
        "state.redis_url", "state.backend", "epp.port"]
    # workers.count 0 is no problem here: workers.remote has entries (bad ones, reported above).
    assert isinstance(info.value.problems[9], PolicyConfigError)
    assert "short" not in info.value.summary()  # a secret's value is never shown


def test_a_rule_on_a_bad_field_says_nothing_more() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"workers": {"count": -1},
                      "sessions": {"max_sessions": "many"}}, BASE)
    assert [p.field for p in info.value.problems] == ["workers.count", "sessions.max_sessions"]
    with pytest.raises(ConfigError) as info:
        parse_config({"workers": {"remote": [{"url": "http://x", "mode": "speculative", "max_k": "two"}]}}, BASE)
    assert [p.field for p in info.value.problems] == ["workers.remote[0].max_k"]


# --------------------------------------------------------------------------------------------
# Files


def test_load_config_from_a_temp_file(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", "server: {port: 9000}\npolicy: {num_speculative_tokens: 6}\n")
    config = load_config(path)
    assert config.server.port == 9000
    assert config.policy == PolicyConfig(num_speculative_tokens=6)
    assert config.source == path.resolve()


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n"])
def test_empty_file_is_all_defaults(tmp_path: Path, text: str) -> None:
    path = write(tmp_path / "c.yaml", text)
    assert load_config(path) == parse_config({}, tmp_path.resolve(), path.resolve())


@pytest.mark.parametrize("text", ["server: [unclosed\n", "server:\n  port: 1\n port: 2\n", "a: b: c\n", "\tx: 1\n"])
def test_invalid_yaml(tmp_path: Path, text: str) -> None:
    path = write(tmp_path / "bad.yaml", text)
    for load in (load_config, load_policy_file):
        with pytest.raises(ConfigError, match=r"^\(file\): invalid YAML") as info:
            load(path)
        assert info.value.field == "(file)"
        assert info.value.value == str(path)
        assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    for load in (load_config, load_policy_file):
        with pytest.raises(ConfigError, match=r"^\(file\): cannot read") as info:
            load(path)
        assert info.value.value == str(path)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_file_top_level_must_be_a_mapping(tmp_path: Path, text: str) -> None:
    path = write(tmp_path / "c.yaml", text)
    for load in (load_config, load_policy_file):
        with pytest.raises(ConfigError, match=r"^\(top level\): config must be a mapping"):
            load(path)


def test_file_errors_name_the_dotted_field(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", "workers:\n  remote:\n    - {url: 'ftp://x', mode: plain}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == "workers.remote[0].url: must start with http:// or https:// (got 'ftp://x')"


# --------------------------------------------------------------------------------------------
# load_policy_file: the hot-reload path reads the policy section and nothing else


def test_load_policy_file_reads_only_the_policy_section(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", """
bogus_top_level: 1
server: {port: "not a port"}
workers: {count: -1, foo: bar, dtype: float16}
model: {target: 5}
policy:
  max_batch: 10
  batch_resume: 5
  acceptance_half_life: 16
""")
    with pytest.raises(ConfigError):
        load_config(path)
    policy = load_policy_file(path)
    assert policy == PolicyConfig(max_batch=10, batch_resume=5, acceptance_half_life=16.0)


@pytest.mark.parametrize("text", ["server: {port: 1}\n", "policy:\n", "policy: null\n", "policy: {}\n", ""])
def test_load_policy_file_without_a_policy_gives_defaults(tmp_path: Path, text: str) -> None:
    assert load_policy_file(write(tmp_path / "c.yaml", text)) == PolicyConfig()


@pytest.mark.parametrize(("text", "field", "value"), [
    ("policy: {max_batch: 0}\n", "max_batch", 0),
    ("policy: {acceptance_floor: 1.5}\n", "acceptance_floor", 1.5),
    ("policy: {num_speculative_tokens: 17}\n", "num_speculative_tokens", 17),
    ("policy: {max_batch: 8, batch_resume: 9}\n", "batch_resume", 9),
    ("policy: {probe_every: true}\n", "probe_every", True),
    ("policy: {max_temperature: abc}\n", "max_temperature", "abc"),
    ("policy: {acceptance_flor: 0.5}\n", "acceptance_flor", 0.5),
    ("policy: [1, 2]\n", "(section)", [1, 2]),
])
def test_load_policy_file_errors(tmp_path: Path, text: str, field: str, value: Any) -> None:
    with pytest.raises(PolicyConfigError) as info:
        load_policy_file(write(tmp_path / "c.yaml", text))
    assert info.value.field == field
    assert str(info.value).startswith(f"policy.{field}: ")
    assert str(info.value).endswith(f"(got {value!r})")


@pytest.mark.parametrize(("value", "expected"), [(None, None), (2048, 2048), (16, 16)])
def test_max_model_len(value: int | None, expected: int | None) -> None:
    assert parse_config({"workers": {"max_model_len": value}}, BASE).workers.max_model_len == expected


@pytest.mark.parametrize("value", [8, 0, -1, "long", 2048.5, True])
def test_max_model_len_refused(value: Any) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({"workers": {"max_model_len": value}}, BASE)
    assert "workers.max_model_len" in str(raised.value)


@pytest.mark.parametrize(("value", "expected"), [(0, 0.0), (256, 256.0), (0.5, 0.5)])
def test_prefix_cache_mb(value: float, expected: float) -> None:
    assert parse_config({"workers": {"prefix_cache_mb": value}}, BASE).workers.prefix_cache_mb == expected


@pytest.mark.parametrize("value", [-1, -0.5, float("nan"), float("inf"), 1e12, "big", True])
def test_prefix_cache_mb_refused_naming_the_field(value: Any) -> None:
    """Negative, not a number, or more than this machine's physical memory (1e12 MiB)."""
    with pytest.raises(ConfigError) as raised:
        parse_config({"workers": {"prefix_cache_mb": value}}, BASE)
    assert "workers.prefix_cache_mb" in str(raised.value)


@pytest.mark.parametrize("value", ["-1", "1e12", "nan"])
def test_a_worker_refuses_a_bad_prefix_cache_at_start(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    from workers.__main__ import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(["--target", "models/demo-target", "--port", "1", "--prefix-cache-mb", value])
    assert exited.value.code == 2
    assert "--prefix-cache-mb (workers.prefix_cache_mb)" in capsys.readouterr().err


@pytest.mark.parametrize("engine", ["vllm", "sim"])
def test_a_worker_refuses_q4_1_on_another_engine_at_start(engine: str, capsys: pytest.CaptureFixture[str]) -> None:
    from workers.__main__ import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(["--target", "models/demo-target", "--port", "1", "--engine", engine, "--dtype", "q4_1"])
    assert exited.value.code == 2
    assert f"--dtype q4_1 (workers.dtype) is the embedded engine's; engine {engine}" in capsys.readouterr().err
