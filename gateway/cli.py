"""The ``specgate`` command: ``serve`` (the gateway and its workers), ``epp`` (the gateway as
an Envoy endpoint picker), ``worker`` (a standalone worker) and ``check`` (validate a config or
policy file without starting anything).

``check`` imports only the config parser, the safe YAML loader and the pure policy module: no
torch, no aiohttp, so it runs anywhere an operator edits a file (tests/e2e/test_cli.py checks).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

SERVE_HELP = """Start the OpenAI-compatible gateway and its local worker processes.

Settings come from, highest first: these flags, SPECGATE_<SECTION>__<KEY> environment
variables (e.g. SPECGATE_POLICY__MAX_BATCH=32), the config file, the defaults."""
WORKER_HELP = """Run one standalone specgate worker (what `python -m workers` runs); all further
arguments are the worker's own: `specgate worker --help` lists them."""
EPP_HELP = """Serve the endpoint-picker protocol of the Gateway API Inference Extension: Envoy's
ext_proc filter asks, over gRPC (epp.host:epp.port), which model server in workers.remote takes
each request; the answer carries the same per-session decision `specgate serve` makes. The HTTP
port (server.port) serves /metrics, /health, /ready and /admin. See docs/scale-out.md."""
CHECK_HELP = """Validate a config file, or a bare policy file (the body of PUT /admin/policy),
with the parser and safe YAML loader the gateway uses on a live reload, and the
SPECGATE_* environment overrides applied. Prints every problem with its field and
value; exits 1 if there is any, 0 if the file would be accepted. Starts nothing."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specgate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,epp,worker,check}")
    serve = sub.add_parser("serve", help="start the gateway and its workers", description=SERVE_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--config", type=Path, default=Path("config.yaml"),
                       help="config file (default: %(default)s)")
    serve.add_argument("--host", default=None, help="listen address; overrides server.host")
    serve.add_argument("--port", type=int, default=None, help="listen port; overrides server.port")
    serve.add_argument("--log-format", choices=("text", "json"), default=None,
                       help="log lines as text or one JSON object each; overrides server.log_format")
    serve.add_argument("--log-level", default="INFO", help="logging level (default: %(default)s)")
    epp = sub.add_parser("epp", help="serve as the endpoint picker of an Envoy inference gateway",
                         description=EPP_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    for action in serve._actions[1:]:  # the same flags as serve (all but --help)...
        epp._add_action(action)
    epp.add_argument("--epp-host", default=None, help="the ext_proc gRPC listen address; overrides epp.host")
    epp.add_argument("--epp-port", type=int, default=None, help="the ext_proc gRPC port; overrides epp.port")
    sub.add_parser("worker", help="run a standalone worker (python -m workers)", description=WORKER_HELP,
                   add_help=False)
    check = sub.add_parser("check", help="validate a config or policy file", description=CHECK_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("file", type=Path, help="config.yaml, or a bare policy mapping")
    check.add_argument("--kind", choices=("auto", "config", "policy"), default="auto",
                       help="auto: a file with policy fields and no config section at the top is a policy file "
                            "(default: auto)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:  # passed through whole: the worker's parser owns its flags and --help
        from workers.__main__ import main as worker_main

        return worker_main(argv[1:], prog="specgate worker")
    args = build_parser().parse_args(argv)
    if args.command == "check":
        return check(args.file, args.kind)
    return serve(args)


# -- check -------------------------------------------------------------------------------------------
def check_problems(path: Path, kind: str = "auto", environ: Mapping[str, str] | None = None) -> list[str]:
    """Every problem found, one message each naming the field (or variable) and the value."""
    return check_file(path, kind, environ)[0]


def check_file(path: Path, kind: str = "auto", environ: Mapping[str, str] | None = None
               ) -> tuple[list[str], list[str]]:
    """(problems, warnings): every problem found, one message each naming the field (or variable)
    and the value; and, for a valid config file, what it leaves unscoped (``tenancy_warnings``).

    The same functions the gateway runs: ``load_config_env`` at start, ``policy_env`` on a
    reload (for a bare policy file, as ``PUT /admin/policy`` takes it). Each checks every field.
    """
    from gateway.config.config import _read_yaml
    from gateway.config.env_overrides import load_config_env, policy_env, section_keys
    from policies import FieldError, PolicyConfig

    try:
        raw = _read_yaml(path)
        # auto: no config section at the top and some policy field there is a policy file, so
        # that a policy file with a mistyped key is still checked as one.
        policy_file = not set(raw) & set(section_keys()) and set(raw) & {f.name for f in fields(PolicyConfig)}
        if kind == "policy" or (kind == "auto" and policy_file):
            policy_env(raw, environ)
            return [], []
        config = load_config_env(path, environ)
        return model_problems(config), tenancy_warnings(config) + method_warnings(config)
    except FieldError as exc:
        return [str(problem) for problem in exc.problems], []


def model_problems(config: Any) -> list[str]:
    return [f"{name}: no model at {p} (got {str(p)!r})"
            for p, name in ((config.model.target, "model.target"), (config.model.draft, "model.draft"))
            if p is not None and not (p / "config.json").is_file()]


def tenancy_warnings(config: Any) -> list[str]:
    """What the config leaves unscoped: with API keys, a ``protocol: openai`` server keeps its own
    prompt cache (if any) across tenants, since the gateway cannot know it honours ``cache_salt``
    (docs/api.md "Tenants and caches"). Warnings: the config is valid."""
    if not config.auth.api_keys:
        return []
    return [f"workers.remote[{i}]: protocol openai ({remote.name}): its own prompt cache, if it keeps one, is "
            "shared by every tenant (auth.api_keys is set; the gateway sends such a server no cache_salt). A vLLM "
            "server: declare protocol: vllm, which gets each tenant's cache_salt (got 'openai')"
            for i, remote in enumerate(config.workers.remote) if remote.protocol == "openai"]


def method_warnings(config: Any) -> list[str]:
    """A server whose one method the policy never chooses: its sessions would never be steered
    to it by method (an n-gram or EAGLE-3 server while ``policy.methods`` lacks the method); and an
    EAGLE-3 head loaded that no session may use, or eagle3 listed where nothing serves it."""
    methods = list(config.policy.methods)
    out = [f"workers.remote[{i}]: {remote.name} runs {remote.method} for its life, which policy.methods does not "
           f"list (got {methods}): no session moves there for its method; add {remote.method}"
           for i, remote in enumerate(config.workers.remote)
           if remote.protocol in ("vllm", "llamacpp") and remote.method in ("ngram", "eagle3")
           and remote.method not in methods]
    heads = config.model.eagle3 is not None or any(r.method == "eagle3" for r in config.workers.remote)
    if config.model.eagle3 is not None and "eagle3" not in methods:
        out.append(f"model.eagle3: the workers load {config.model.eagle3}, which policy.methods does not list "
                   f"(got {methods}): no session drafts with it; add eagle3")
    if "eagle3" in methods and not heads:
        out.append("policy.methods lists eagle3, but no worker has an EAGLE-3 head (model.eagle3 is null and no "
                   "remote server runs method eagle3): sessions price the other methods only")
    return out


def check(path: Path, kind: str) -> int:
    problems, warnings = check_file(path, kind)
    for problem in problems:
        print(f"{path}: {problem}", file=sys.stderr)
    if problems:
        return 1
    for warning in warnings:
        print(f"{path}: warning: {warning}", file=sys.stderr)
    for note in route_key_notes(path):
        print(f"{path}: note: {note}", file=sys.stderr)
    print(f"{path}: ok")
    return 0


def route_key_notes(path: Path) -> list[str]:
    """What each ``policy.route_*`` key the file sets becomes in a ``routing:`` section (the old
    keys still load: gateway/scheduling/config.py ``routing_from_policy``)."""
    from gateway.config.config import _read_yaml, parse_policy
    from gateway.scheduling.config import ROUTE_KEYS, policy_key_mapping

    raw = _read_yaml(path)
    section = raw.get("policy") if isinstance(raw.get("policy"), dict) else raw
    if not isinstance(section, dict) or "routing" in raw:
        return []
    policy = parse_policy({k: v for k, v in section.items() if k in ROUTE_KEYS})
    return [line + " (the old key still loads)" for line in policy_key_mapping(policy, (k for k in ROUTE_KEYS
                                                                                         if k in section))]


# -- serve -------------------------------------------------------------------------------------------
def serve(args: argparse.Namespace) -> int:
    from workers.api.logs import configure

    configure(args.log_format or "text", args.log_level)
    # prometheus_client picks its multiprocess value store at import, so the directory must
    # exist in the environment before anything imports it; the workers inherit it.
    multiproc = tempfile.TemporaryDirectory(prefix="specgate-metrics-")
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", multiproc.name)
    from gateway.observe.metrics import keep_series_in_memory

    keep_series_in_memory()  # the workers write the files; the gateway's own series stay in memory

    import logging

    import uvloop

    from gateway.auth import check_exposure
    from gateway.config.config import ConfigError
    from gateway.config.env_overrides import load_config_env
    from gateway.relay.app import create_app
    from gateway.relay.drain import DRAIN_KEY
    from policies import FieldError
    from workers.api.web_runner import run_app

    picker = args.command == "epp"
    try:
        config = load_config_env(args.config)
    except FieldError as exc:
        problems = [str(problem) for problem in exc.problems]
    else:
        # The endpoint picker hands requests to model servers elsewhere: it loads no model.
        problems = [] if picker else model_problems(config)
        if picker and config.workers.count:
            problems.append(f"workers.count: specgate epp routes to workers.remote only; set it to 0 "
                            f"(got {config.workers.count})")
    for problem in problems:
        print(f"specgate: bad config {args.config}: {problem}", file=sys.stderr)
    if problems:
        return 2
    server = replace(config.server, host=args.host or config.server.host,
                     port=args.port if args.port is not None else config.server.port,
                     log_format=args.log_format or config.server.log_format)
    config = replace(config, server=server)
    if picker:
        config = replace(config, epp=replace(config.epp, host=args.epp_host or config.epp.host,
                                             port=args.epp_port if args.epp_port is not None else config.epp.port))
    try:
        check_exposure(config.auth, server, server.host)
    except ConfigError as exc:
        print(f"specgate: refusing to start: {exc}", file=sys.stderr)
        return 2
    configure(server.log_format, args.log_level)
    uvloop.install()
    logging.getLogger("gateway").info("serving %s on http://%s:%d/v1", config.model.name, server.host, server.port)
    try:
        app = create_app(config, openai_routes=not picker)
        if picker:
            from gateway.epp.picker import add_endpoint_picker

            add_endpoint_picker(app)
        # SIGTERM/SIGINT: drain (gateway/relay/drain.py), then the cleanup stops the workers.
        run_app(app, host=server.host, port=server.port, drainer=app[DRAIN_KEY])
    finally:
        multiproc.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
