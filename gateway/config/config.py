"""config.yaml, parsed once into frozen, validated objects.

Errors name the field (dotted path) and the value. Every field is checked, each on its own:
the ConfigError (or PolicyConfigError) raised is the first problem and carries all of them in
``problems``, so one bad field does not hide the next. Relative paths resolve against the
directory of the config file, so a config works from any working directory.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gateway.config.auth import AuthConfig, parse_auth
from gateway.config.errors import ConfigError, Problems
from gateway.config.safe_yaml import YamlRefused, load_yaml
from gateway.scheduling.config import POLICY_KEY_HOMES, ROUTE_KEYS, RoutingConfig, parse_routing
from policies.config import FieldError, PolicyConfig, PolicyConfigError, raise_problems
from workers.api.limits import prefix_cache_problem

__all__ = ["ConfigError", "GatewayConfig", "load_config", "parse_config"]

EngineName = Literal["embedded", "vllm", "sim"]
RemoteMode = Literal["speculative", "plain"]
RemoteProtocol = Literal["openai", "specgate", "vllm", "llamacpp"]
REMOTE_PROTOCOLS: tuple[RemoteProtocol, ...] = ("openai", "specgate", "vllm", "llamacpp")
RemoteMethod = Literal["draft_model", "eagle3", "ngram", "none"]
REMOTE_METHODS: tuple[RemoteMethod, ...] = ("draft_model", "eagle3", "ngram", "none")
MAX_SCOPED_SLOTS = 256  # a llama-server's -np; each slot is a sequence of its KV cache
MAX_CONFIG_BYTES = 1 << 20  # config.yaml is a few KiB; anything near this is not a config file




@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    worker_timeout_s: float = 60.0  # a worker silent this long (first token included) gets a 504
    body_timeout_s: float = 30.0  # a request body not fully received by then gets a 408
    log_format: Literal["text", "json"] = "text"  # json: one object per line (workers/api/logs.py)
    # SIGTERM: in-flight requests get this long to finish before they are ended with an error.
    drain_timeout_s: float = 30.0
    # A generation whose worker dies mid-way resumes on another worker at most this many times...
    max_migrations: int = 3
    # ...waiting at most this long for one to be ready.
    migration_wait_s: float = 15.0
    # A new request that finds no worker ready waits this long for one (0: refused at once)...
    admission_wait_s: float = 15.0
    # ...with at most this many requests waiting; beyond it, a 503 with Retry-After.
    admission_queue: int = 256
    # Listening on a non-loopback address without API keys is refused unless this says so.
    allow_unauthenticated: bool = False
    # A non-streaming request's chunks after the first, this long as one from a specgate worker
    # (workers/server/coalesce.py): fewer events to relay. 0: a chunk per engine step.
    coalesce_s: float = 0.05
    # After each request's arrival and end, poll the event loop instead of sleeping this long
    # (gateway/relay/busy_poll.py): a worker's answer finds the gateway awake. 0: off.
    busy_poll_s: float = 0.0


@dataclass(frozen=True)
class ModelConfig:
    name: str = "specgate-demo"  # the model id clients send
    target: Path = Path("models/demo-target")
    draft: Path | None = Path("models/demo-draft")  # null: plain decoding only
    eagle3: Path | None = None  # an EAGLE-3 head (speculators' eagle3 format): the eagle3 method; null: none


@dataclass(frozen=True)
class RemoteWorker:
    url: str  # base URL, e.g. http://10.0.0.5:8001
    mode: RemoteMode = "plain"  # the one mode an "openai" server serves
    name: str = ""  # worker id in metrics and admin views (default: the URL)
    # An "openai" server's fixed K when speculative; a "vllm" server's num_speculative_tokens; a
    # "llamacpp" server's longest draft (--spec-draft-n-max, or its n-gram type's draft length).
    max_k: int = 0
    # "openai": any OpenAI-compatible server, serving one fixed mode;
    # "specgate": a specgate worker (python -m workers --port N) that takes per-request decisions;
    # "vllm": a vLLM OpenAI server with specgate's scheduler plugin, driven per request (vllm_xargs);
    # "llamacpp": llama.cpp's llama-server, one method for its life (gateway/llamacpp.py).
    protocol: RemoteProtocol = "openai"
    # What a vLLM or llama.cpp server proposes with, fixed for its life (vLLM's
    # --speculative-config method; llama-server's -md or --spec-type): the draft model
    # ("draft_model", vLLM's name), prompt lookup ("ngram", any of llama.cpp's n-gram types), or
    # nothing ("none": it serves plain only). A specgate worker lists its own.
    method: RemoteMethod = "draft_model"
    # A "llamacpp" server started with --cache-ram 0: its -np. The gateway then runs each cache
    # scope's requests in slots of their own (gateway/llamacpp.py PromptScopes); 0: it does not.
    scoped_slots: int = 0


@dataclass(frozen=True)
class WorkersConfig:
    count: int = 2  # local worker processes
    engine: EngineName = "embedded"  # embedded: PyTorch in this repo; vllm: vLLM's AsyncLLM with specgate's plugin
    python: Path | None = None  # interpreter for local workers (vllm: the vLLM environment's); default: the gateway's
    vllm_args: Mapping[str, Any] = field(default_factory=dict)  # further vLLM engine args (AsyncEngineArgs fields)
    # engine: sim: the simulated GPU deployment (workers/engines/sim/roofline.py, docs/sim.md), as given;
    # validated at load so a bad field is refused with its name.
    sim: Mapping[str, Any] = field(default_factory=dict)
    max_slots: int = 16  # sequences one worker batches together
    max_queue: int = 64  # waiting sequences per worker before 429
    max_k: int = 8  # deepest speculation a worker supports
    # Longest sequence (prompt + generation) a worker's KV slot holds; None: the model's own window.
    # K/V memory is allocated for it per slot: SmolLM2's 8,192 positions would take 377 MB a slot.
    max_model_len: int | None = None
    # Prompt K/V each embedded worker keeps for reuse by later requests with the same start
    # (workers/engines/embedded/prefix_cache.py), MiB; 0: none. 256 holds about 5,600 tokens of
    # SmolLM2's float32 target K/V (46 KB a token) with its draft's: a few long conversations.
    prefix_cache_mb: float = 256.0
    threads: int = 1  # compute threads per worker process: torch's and the float32 kernels'
    dtype: Literal["auto", "float32", "bfloat16", "q4_1"] = "auto"  # the target's (auto: measured at start-up)
    draft_dtype: Literal["float32", "bfloat16"] = "float32"
    # dtype auto: choose only among configurations whose verification is bit-identical to plain
    # decoding on the worker's CPU (checked at start-up); false admits faster, close ones.
    exact: bool = True
    cost_cache_dir: Path | None = None  # start-up cost measurements (default: ~/.cache/specgate/costs)
    cost_budget_s: float = 4.0  # time a worker may spend measuring its costs at start-up (a cache hit: none)
    startup_timeout_s: float = 120.0  # a worker not healthy by then is restarted
    poll_interval_s: float = 0.5  # health and load polling period
    unhealthy_restart_s: float = 10.0  # a live local worker failing health checks this long is killed and restarted
    restart_backoff_s: float = 0.5  # first restart delay, doubled per consecutive failure
    restart_backoff_max_s: float = 30.0
    socket_dir: Path | None = None  # where Unix sockets go (default: a fresh temporary directory)
    remote: tuple[RemoteWorker, ...] = ()


@dataclass(frozen=True)
class SessionsConfig:
    max_sessions: int = 10_000  # least recently used sessions are evicted beyond this
    idle_ttl_s: float = 1800.0  # sessions idle this long are forgotten
    history: int = 20  # mode changes kept per session for /admin/sessions/{id}


@dataclass(frozen=True)
class StateConfig:
    # Where per-session controller state lives: memory (this process) or redis (shared by replicas).
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "specgate:"  # every key this gateway writes starts with it
    timeout_s: float = 0.05  # one Redis call slower than this counts as Redis down for the request
    retry_s: float = 1.0  # after Redis failed, local state only for this long before trying it again


@dataclass(frozen=True)
class EppConfig:
    # specgate epp: the ext_proc gRPC service Envoy asks which endpoint serves each request.
    host: str = "127.0.0.1"
    port: int = 9002  # the Inference Extension's conventional EPP port
    max_body_bytes: int = 1 << 20  # a request body larger than this gets an ImmediateResponse 413


@dataclass(frozen=True)
class TracingConfig:
    # Off unless set here or by the standard OTEL_* variables (OTEL_EXPORTER_OTLP_ENDPOINT): gateway/observe/tracing.py.
    enabled: bool = False
    otlp_endpoint: str | None = None  # OTLP/HTTP base URL, e.g. http://collector:4318 (default: OTEL_* or localhost)
    service_name: str = "specgate"
    record_prompts: bool = False  # prompt text in the request span; off: spans carry no user text


@dataclass(frozen=True)
class GatewayConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    sessions: SessionsConfig = field(default_factory=SessionsConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    source: Path | None = None  # the file this came from (reloads re-read it)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    state: StateConfig = field(default_factory=StateConfig)
    epp: EppConfig = field(default_factory=EppConfig)
    # The routing pipeline (gateway/scheduling/config.py); None: the policy's route_* keys say it.
    routing: RoutingConfig | None = None


class _Section:
    """One mapping of config.yaml as it is parsed: unknown keys and bad fields are recorded in
    ``problems``, and a bad field reads as its default, so that every field gets checked."""

    def __init__(self, raw: Any, prefix: str, allowed: Collection[str], problems: Problems) -> None:
        self.prefix, self.problems = prefix, problems
        if raw is not None and not isinstance(raw, Mapping):
            problems.add(ConfigError(prefix, raw, "must be a mapping"))
            raw = None
        self.raw: Mapping[str, Any] = raw or {}
        _check_keys(self.raw, prefix, set(allowed), problems)

    def get(self, key: str, kind: type, default: Any, *, minimum: float | None = None, maximum: float | None = None,
            choices: tuple[Any, ...] | None = None, nullable: bool = False) -> Any:
        if nullable and self.raw.get(key, default) is None:
            return None
        return self.problems.check(lambda: _get(self.raw, self.prefix, key, kind, default, minimum=minimum,
                                                maximum=maximum, choices=choices), default)

    def path(self, key: str, default: Path | None, base: Path, nullable: bool = False) -> Path | None:
        return self.problems.check(lambda: _path(self.raw, self.prefix, key, default, base, nullable), default)


def _check_keys(section: Mapping[str, Any], prefix: str, allowed: set[str], problems: Problems) -> None:
    for key in section:
        if key not in allowed:
            name = key if prefix == "(top level)" else f"{prefix}.{key}"
            problems.add(ConfigError(str(name), section[key], f"unknown field; known: {', '.join(sorted(allowed))}"))


def _get(section: Mapping[str, Any], prefix: str, key: str, kind: type, default: Any, *,
         minimum: float | None = None, maximum: float | None = None, choices: tuple[Any, ...] | None = None) -> Any:
    value = section.get(key, default)
    name = f"{prefix}.{key}"
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            raise ConfigError(name, value, "is too large") from None
    if kind is not Path and ((isinstance(value, bool) and kind is not bool) or not isinstance(value, kind)):
        raise ConfigError(name, value, f"must be a {kind.__name__}")
    if minimum is not None and value < minimum:
        raise ConfigError(name, value, f"must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise ConfigError(name, value, f"must be <= {maximum}")
    if choices is not None and value not in choices:
        raise ConfigError(name, value, f"must be one of {', '.join(map(str, choices))}")
    return value


def _path(section: Mapping[str, Any], prefix: str, key: str, default: Path | None, base: Path,
          nullable: bool = False) -> Path | None:
    value = section.get(key, default)
    if value is None and nullable:
        return None
    if not isinstance(value, str | Path):
        raise ConfigError(f"{prefix}.{key}", value, "must be a path")
    path = Path(value)
    return path if path.is_absolute() else base / path


def parse_policy(raw: Any) -> PolicyConfig:
    try:
        return PolicyConfig.from_mapping(raw)
    except PolicyConfigError:
        raise
    except TypeError as exc:
        raise PolicyConfigError("(section)", raw, str(exc)) from None


def parse_config(raw: Any, base: Path, source: Path | None = None) -> GatewayConfig:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError("(top level)", raw, "config must be a mapping")
    problems = Problems()
    _check_keys(raw, "(top level)", {"server", "model", "workers", "sessions", "policy", "tracing", "auth", "state",
                                     "epp", "routing"}, problems)
    s = _Section(raw.get("server"), "server", ServerConfig.__dataclass_fields__, problems)
    d = ServerConfig()
    server = ServerConfig(
        host=s.get("host", str, d.host),
        port=s.get("port", int, d.port, minimum=0, maximum=65535),
        max_body_bytes=s.get("max_body_bytes", int, d.max_body_bytes, minimum=1024),
        worker_timeout_s=s.get("worker_timeout_s", float, d.worker_timeout_s, minimum=0.1),
        body_timeout_s=s.get("body_timeout_s", float, d.body_timeout_s, minimum=0.1),
        log_format=s.get("log_format", str, d.log_format, choices=("text", "json")),
        drain_timeout_s=s.get("drain_timeout_s", float, d.drain_timeout_s, minimum=0),
        max_migrations=s.get("max_migrations", int, d.max_migrations, minimum=0),
        migration_wait_s=s.get("migration_wait_s", float, d.migration_wait_s, minimum=0),
        admission_wait_s=s.get("admission_wait_s", float, d.admission_wait_s, minimum=0),
        admission_queue=s.get("admission_queue", int, d.admission_queue, minimum=0),
        allow_unauthenticated=s.get("allow_unauthenticated", bool, d.allow_unauthenticated),
        coalesce_s=s.get("coalesce_s", float, d.coalesce_s, minimum=0, maximum=5.0),
        busy_poll_s=s.get("busy_poll_s", float, d.busy_poll_s, minimum=0, maximum=1.0))
    if server.coalesce_s >= server.worker_timeout_s:  # a worker holding chunks longer would time out
        problems.add(ConfigError("server.coalesce_s", server.coalesce_s,
                                 f"must be below server.worker_timeout_s ({server.worker_timeout_s:g})"))
    m = _Section(raw.get("model"), "model", {"name", "target", "draft", "eagle3"}, problems)
    md = ModelConfig()
    model = ModelConfig(name=m.get("name", str, md.name), target=m.path("target", md.target, base) or md.target,
                        draft=m.path("draft", md.draft, base, nullable=True),
                        eagle3=m.path("eagle3", md.eagle3, base, nullable=True))
    workers = _parse_workers(_Section(raw.get("workers"), "workers", WorkersConfig.__dataclass_fields__, problems),
                             base)
    x = _Section(raw.get("sessions"), "sessions", {"max_sessions", "idle_ttl_s", "history"}, problems)
    xd = SessionsConfig()
    sessions = SessionsConfig(
        max_sessions=x.get("max_sessions", int, xd.max_sessions, minimum=1),
        idle_ttl_s=x.get("idle_ttl_s", float, xd.idle_ttl_s, minimum=1),
        history=x.get("history", int, xd.history, minimum=1))
    policy = problems.check(lambda: parse_policy(raw.get("policy")), PolicyConfig())
    tracing = _parse_tracing(_Section(raw.get("tracing"), "tracing", TracingConfig.__dataclass_fields__, problems))
    auth = problems.check(lambda: parse_auth(raw.get("auth")), AuthConfig())
    state = _parse_state(_Section(raw.get("state"), "state", StateConfig.__dataclass_fields__, problems))
    e = _Section(raw.get("epp"), "epp", EppConfig.__dataclass_fields__, problems)
    ed = EppConfig()
    epp = EppConfig(host=e.get("host", str, ed.host), port=e.get("port", int, ed.port, minimum=0, maximum=65535),
                    max_body_bytes=e.get("max_body_bytes", int, ed.max_body_bytes, minimum=1024))
    routing = problems.check(lambda: parse_routing_section(raw), None)
    problems.raise_any()
    return GatewayConfig(server, model, workers, sessions, policy, source, tracing, auth, state, epp, routing)


def _parse_state(s: _Section) -> StateConfig:
    d = StateConfig()
    url = s.get("redis_url", str, d.redis_url)
    if not url.startswith(("redis://", "rediss://", "unix://")):
        s.problems.add(ConfigError("state.redis_url", url, "must be a redis://, rediss:// or unix:// URL"))
        url = d.redis_url
    return StateConfig(backend=s.get("backend", str, d.backend, choices=("memory", "redis")), redis_url=url,
                       key_prefix=s.get("key_prefix", str, d.key_prefix),
                       timeout_s=s.get("timeout_s", float, d.timeout_s, minimum=0.001, maximum=10),
                       retry_s=s.get("retry_s", float, d.retry_s, minimum=0))


def _parse_workers(w: _Section, base: Path) -> WorkersConfig:
    wd, problems = WorkersConfig(), w.problems
    workers = WorkersConfig(
        count=w.get("count", int, wd.count, minimum=0),
        engine=w.get("engine", str, wd.engine, choices=("embedded", "vllm", "sim")),
        python=w.path("python", None, base, nullable=True),
        vllm_args=_vllm_args(w.raw.get("vllm_args"), problems),
        sim=problems.check(lambda: _sim(w.raw.get("sim")), {}),
        max_slots=w.get("max_slots", int, wd.max_slots, minimum=1),
        max_queue=w.get("max_queue", int, wd.max_queue, minimum=1),
        max_k=w.get("max_k", int, wd.max_k, minimum=0),
        max_model_len=w.get("max_model_len", int, wd.max_model_len, minimum=16, nullable=True),
        prefix_cache_mb=_prefix_cache_mb(w, wd.prefix_cache_mb),
        threads=w.get("threads", int, wd.threads, minimum=1),
        dtype=w.get("dtype", str, wd.dtype, choices=("auto", "float32", "bfloat16", "q4_1")),
        draft_dtype=w.get("draft_dtype", str, wd.draft_dtype, choices=("float32", "bfloat16")),
        exact=w.get("exact", bool, wd.exact),
        cost_cache_dir=w.path("cost_cache_dir", None, base, nullable=True),
        cost_budget_s=w.get("cost_budget_s", float, wd.cost_budget_s, minimum=0.1, maximum=60),
        startup_timeout_s=w.get("startup_timeout_s", float, wd.startup_timeout_s, minimum=1),
        poll_interval_s=w.get("poll_interval_s", float, wd.poll_interval_s, minimum=0.05),
        unhealthy_restart_s=w.get("unhealthy_restart_s", float, wd.unhealthy_restart_s, minimum=0.1),
        restart_backoff_s=w.get("restart_backoff_s", float, wd.restart_backoff_s, minimum=0),
        restart_backoff_max_s=w.get("restart_backoff_max_s", float, wd.restart_backoff_max_s, minimum=0),
        socket_dir=w.path("socket_dir", None, base, nullable=True), remote=_parse_remote(w.raw.get("remote"), problems))
    if workers.dtype == "q4_1" and workers.engine != "embedded":
        problems.add(ConfigError("workers.dtype", "q4_1", f"the GGUF's blocks are the embedded engine's; "
                                 f"engine {workers.engine} serves the float32 conversion (dtype auto or float32)"))
    # Only a count that was given (and valid) can leave nothing to serve: a bad one is already reported.
    if workers.count == 0 and not workers.remote and not problems.failed("workers.count"):
        problems.add(ConfigError("workers.count", 0, "no local workers and no workers.remote: nothing would serve"))
    return workers


def _prefix_cache_mb(w: _Section, default: float) -> float:
    value: float = w.get("prefix_cache_mb", float, default)
    problem = prefix_cache_problem(value)
    if problem is not None:
        w.problems.add(ConfigError("workers.prefix_cache_mb", value, problem))
        return default
    return value


def _parse_tracing(t: _Section) -> TracingConfig:
    d = TracingConfig()
    endpoint = t.raw.get("otlp_endpoint")
    if endpoint is not None and (not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://"))):
        t.problems.add(ConfigError("tracing.otlp_endpoint", endpoint, "must be an http:// or https:// URL"))
        endpoint = None
    return TracingConfig(enabled=t.get("enabled", bool, d.enabled), otlp_endpoint=endpoint,
                         service_name=t.get("service_name", str, d.service_name),
                         record_prompts=t.get("record_prompts", bool, d.record_prompts))


def _vllm_args(raw: Any, problems: Problems) -> Mapping[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping) or not all(isinstance(k, str) for k in raw):
        problems.add(ConfigError("workers.vllm_args", raw, "must be a mapping of vLLM engine argument names to values"))
        return {}
    for key in ("model", "speculative_config", "max_num_seqs", "scheduler_cls", "per_request_spec_decode_metrics"):
        if key in raw:
            problems.add(ConfigError(f"workers.vllm_args.{key}", raw[key],
                                     "is set by specgate from model.* and workers.*"))
    return dict(raw)


def _sim(raw: Any) -> Mapping[str, Any]:
    # Imported here, only to validate this section: workers/api/sim_config.py is the torch-free
    # contract both sides read (its docstring says why it sits in the layer the gateway imports).
    from workers.api.sim_config import SimConfig, SimConfigError

    if raw is None:
        return {}
    try:
        SimConfig.from_mapping(raw)
    except SimConfigError as exc:
        raise_problems([ConfigError(f"workers.sim.{p.field}", p.value, p.problem) for p in exc.problems])
        raise  # unreachable: raise_problems raised (it returns only when given none)
    return dict(raw)


def _parse_remote(raw: Any, problems: Problems) -> tuple[RemoteWorker, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        problems.add(ConfigError("workers.remote", raw, "must be a list"))
        return ()
    out = []
    for i, item in enumerate(raw):
        prefix = f"workers.remote[{i}]"
        if not isinstance(item, Mapping):
            problems.add(ConfigError(prefix, item, "must be a mapping with url and mode"))
            continue
        r = _Section(item, prefix, {"url", "protocol", "mode", "name", "max_k", "method", "scoped_slots"}, problems)
        url = r.get("url", str, None)
        if isinstance(url, str) and not url.startswith(("http://", "https://")):
            problems.add(ConfigError(f"{prefix}.url", url, "must start with http:// or https://"))
        url = (url or "").rstrip("/")
        protocol = r.get("protocol", str, "openai", choices=REMOTE_PROTOCOLS)
        mode = r.get("mode", str, "plain", choices=("speculative", "plain"))
        max_k = r.get("max_k", int, 0, minimum=0)
        if protocol == "openai" and mode == "speculative" and max_k < 1 and not problems.failed(f"{prefix}.max_k"):
            problems.add(ConfigError(f"{prefix}.max_k", max_k, "a speculative remote worker needs max_k >= 1"))
        method = r.get("method", str, "none" if protocol == "llamacpp" else "draft_model", choices=REMOTE_METHODS)
        if protocol == "specgate" and "method" in item and not problems.failed(f"{prefix}.method"):
            problems.add(ConfigError(f"{prefix}.method", method, "a specgate worker lists its own methods"))
        if protocol == "openai" and "method" in item and not problems.failed(f"{prefix}.method"):
            problems.add(ConfigError(f"{prefix}.method", method, "an openai server's mode says what it serves; "
                                     "method is for protocol vllm or llamacpp"))
        if protocol == "llamacpp" and method == "eagle3" and not problems.failed(f"{prefix}.method"):
            problems.add(ConfigError(f"{prefix}.method", method, "llama-server's EAGLE-3 needs a GGUF head, which "
                                     "this repository does not make; eagle3 is for protocol vllm"))
        if protocol == "llamacpp":
            if "mode" in item and not problems.failed(f"{prefix}.mode"):
                problems.add(ConfigError(f"{prefix}.mode", mode, "a llamacpp server's method says what it runs "
                                         "(none: plain)"))
            mode = "plain" if method == "none" else "speculative"
            if method != "none" and max_k < 1 and not problems.failed(f"{prefix}.max_k"):
                problems.add(ConfigError(f"{prefix}.max_k", max_k, f"a llamacpp server of method {method} needs "
                                         "max_k >= 1: its longest draft (--spec-draft-n-max)"))
        scoped_slots = r.get("scoped_slots", int, 0, minimum=0, maximum=MAX_SCOPED_SLOTS)
        if protocol != "llamacpp" and "scoped_slots" in item and not problems.failed(f"{prefix}.scoped_slots"):
            problems.add(ConfigError(f"{prefix}.scoped_slots", scoped_slots, "is for protocol llamacpp servers"))
        out.append(RemoteWorker(url, mode, r.get("name", str, url), max_k, protocol, method, scoped_slots))
    return tuple(out)


def _read_yaml(path: Path) -> Any:
    try:
        with path.open("rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)  # never more, whatever the file holds
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError("(file)", str(path), f"is larger than {MAX_CONFIG_BYTES} bytes")
        raw = load_yaml(data.decode(), MAX_CONFIG_BYTES)
    except OSError as exc:
        raise ConfigError("(file)", str(path), f"cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError("(file)", str(path), "is not valid UTF-8") from None
    except YamlRefused as exc:
        raise ConfigError("(file)", str(path), str(exc)) from None
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError("(top level)", raw, "config must be a mapping")
    return raw or {}


def parse_routing_section(raw: Mapping[str, Any]) -> RoutingConfig | None:
    """The file's ``routing:`` section, or None where it has none. With one, the policy's
    ``route_*`` keys in the same file are refused: two places for one weight would disagree."""
    if raw.get("routing") is None:
        return None
    section = raw.get("policy")
    section = section if isinstance(section, Mapping) else {}
    problems: list[FieldError] = [
        ConfigError(f"policy.{key}", section[key], f"is set by the routing section when there is one "
                    f"({POLICY_KEY_HOMES[key][0]}); `specgate check` shows where")
        for key in ROUTE_KEYS if key in section]
    try:
        routing = parse_routing(raw["routing"])
    except FieldError as exc:
        problems.extend(exc.problems)
        routing = None
    raise_problems(problems)
    return routing


def load_config(path: Path) -> GatewayConfig:
    return parse_config(_read_yaml(path), path.resolve().parent, path.resolve())


def load_auth_file(path: Path) -> AuthConfig:
    """Re-reads only the auth section (API keys rotate without a restart)."""
    return parse_auth(_read_yaml(path).get("auth"))


def load_policy_file(path: Path) -> PolicyConfig:
    """Re-reads only the policy section (hot reload); the rest of the file needs a restart."""
    return parse_policy(_read_yaml(path).get("policy"))
