"""``python -m gateway --config config.yaml [--host H] [--port P]``: the gateway and its workers."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    parser.add_argument("--config", type=Path, default=Path("config.yaml"))
    parser.add_argument("--host", default=None, help="overrides server.host")
    parser.add_argument("--port", type=int, default=None, help="overrides server.port")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s gateway %(levelname)s %(name)s: %(message)s")
    # prometheus_client picks its multiprocess value store at import, so the directory must
    # exist in the environment before anything imports it; the workers inherit it.
    multiproc = tempfile.TemporaryDirectory(prefix="specgate-metrics-")
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", multiproc.name)

    import uvloop

    from gateway.app import create_app
    from gateway.auth import check_exposure
    from gateway.config import ConfigError, load_config
    from gateway.drain import DRAIN_KEY
    from policies import PolicyConfigError
    from workers.web_runner import run_app

    try:
        config = load_config(args.config)
    except (ConfigError, PolicyConfigError) as exc:
        print(f"specgate: bad config {args.config}: {exc}", file=sys.stderr)
        return 2
    for path, name in ((config.model.target, "model.target"), (config.model.draft, "model.draft")):
        if path is not None and not (path / "config.json").is_file():
            print(f"specgate: bad config {args.config}: {name}: no model at {path}", file=sys.stderr)
            return 2
    server = replace(config.server, host=args.host or config.server.host,
                     port=args.port if args.port is not None else config.server.port)
    config = replace(config, server=server)
    try:
        check_exposure(config.auth, server, server.host)
    except ConfigError as exc:
        print(f"specgate: refusing to start: {exc}", file=sys.stderr)
        return 2
    uvloop.install()
    logging.getLogger(__name__).info("serving %s on http://%s:%d/v1", config.model.name, server.host, server.port)
    try:
        app = create_app(config)
        # SIGTERM/SIGINT: drain (gateway/drain.py), then the cleanup stops the workers.
        run_app(app, host=server.host, port=server.port, drainer=app[DRAIN_KEY])
    finally:
        multiproc.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
