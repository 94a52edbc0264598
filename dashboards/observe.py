"""``python -m dashboards.observe [--gateway HOST:PORT]``: Prometheus scraping a running gateway.

It runs the ``prometheus`` server (Debian: ``apt-get install prometheus``) with
``deploy/prometheus.yml``'s scrape config and ``deploy/alerts.yml``'s rules, the target and
paths rewritten for this run; its data stays in ``--data-dir``. The tests start Prometheus
the same way (``prometheus_config`` and ``prometheus_command``), so what they check is what
``make observe`` runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
SCRAPE_CONFIG = DEPLOY / "prometheus.yml"
ALERT_RULES = DEPLOY / "alerts.yml"
INSTALL_HINT = "install it with: apt-get install -y prometheus (Debian/Ubuntu; it provides prometheus and promtool)"


class ToolMissing(RuntimeError):
    """A Prometheus binary is not on PATH."""


def tool(name: str) -> str:
    """The path of ``prometheus`` or ``promtool``, or an error that says how to install it."""
    path = shutil.which(name)
    if path is None:
        raise ToolMissing(f"{name} not found on PATH; {INSTALL_HINT}")
    return path


def prometheus_config(gateway: str, scrape_interval: str | None = None) -> dict[str, Any]:
    """deploy/prometheus.yml aimed at ``gateway`` (host:port), its rule files made absolute.

    Prometheus resolves rule files against the config file's directory, and the rendered
    config is written elsewhere (the data dir), so relative paths would break.
    """
    config: dict[str, Any] = yaml.safe_load(SCRAPE_CONFIG.read_text())
    config["rule_files"] = [str((DEPLOY / path).resolve()) for path in config.get("rule_files", [])]
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [gateway]}]
    if scrape_interval is not None:
        config["global"]["scrape_interval"] = scrape_interval
        config["global"]["evaluation_interval"] = scrape_interval
    return config


def prometheus_command(config_path: Path, data_dir: Path, listen: str) -> list[str]:
    return [tool("prometheus"), f"--config.file={config_path}", f"--storage.tsdb.path={data_dir}",
            f"--web.listen-address={listen}", "--log.level=warn"]


def write_config(data_dir: Path, gateway: str, scrape_interval: str | None = None) -> Path:
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / "prometheus.yml"
    path.write_text(yaml.safe_dump(prometheus_config(gateway, scrape_interval), sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards.observe", description=__doc__.split("\n")[0])
    parser.add_argument("--gateway", default="127.0.0.1:8000", help="the gateway's host:port (default %(default)s)")
    parser.add_argument("--listen", default="127.0.0.1:9090", help="Prometheus's own address (default %(default)s)")
    parser.add_argument("--data-dir", type=Path, default=REPO / ".prometheus",
                        help="Prometheus's config and time series (default %(default)s)")
    parser.add_argument("--scrape-interval", default=None, help="overrides deploy/prometheus.yml's (e.g. 5s)")
    args = parser.parse_args(argv)
    try:
        command = prometheus_command(write_config(args.data_dir, args.gateway, args.scrape_interval),
                                     args.data_dir / "data", args.listen)
    except ToolMissing as exc:
        print(f"specgate: {exc}", file=sys.stderr)
        return 2
    print(f"Prometheus on http://{args.listen} scraping http://{args.gateway}/metrics (Ctrl-C stops it)",
          file=sys.stderr)
    os.execv(command[0], command)  # Prometheus takes over the process: signals reach it directly


if __name__ == "__main__":
    sys.exit(main())
