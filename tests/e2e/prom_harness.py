"""A real Prometheus on loopback for tests, the PromQL the dashboard and alerts hold, and promtool.

Prometheus comes from the system (Debian: ``apt-get install prometheus``; ``.ci/run`` installs
it). A test that needs it and does not find it fails with that hint rather than skipping:
a dashboard test that silently does not run tests nothing.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.procs import ServerProcess, free_port
from dashboards.observe import DEPLOY, ToolMissing, prometheus_command, tool, write_config

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "specgate.json"

# What Grafana would put in place of the dashboard's variables, for queries sent straight to Prometheus.
RATE_INTERVAL = "5s"  # Grafana's $__rate_interval is at least 4 scrape intervals (1 s here)


def require_tool(name: str) -> str:
    try:
        return tool(name)
    except ToolMissing as exc:
        pytest.fail(str(exc), pytrace=False)


def promtool(*args: str, cwd: Path = DEPLOY) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_tool("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=60,
                          check=False)


class Prometheus(ServerProcess):

    def api(self, path: str, **params: str) -> Any:
        """``/api/v1/<path>``'s data; raises with Prometheus's error (a PromQL parse error, say)."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as error:
            with error:
                body = json.loads(error.read())
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        data = self.api("query", **params)
        result: list[dict[str, Any]] = data["result"] if data["resultType"] == "vector" else []
        return result

    def value(self, expr: str, at: float | None = None) -> float:
        """The single sample ``expr`` returns (fails on none or several)."""
        result = self.query(expr, at)
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])

    def sample_times(self, selector: str, start: float, end: float) -> list[float]:
        """The timestamps of the raw samples (scrapes) of one series in ``[start, end]``."""
        data = self.api("query", query=f"{selector}[{max(1, int((end - start) * 1000) + 1)}ms]", time=f"{end:.3f}")
        assert data["resultType"] == "matrix" and len(data["result"]) == 1, (selector, data)
        return [float(at) for at, _ in data["result"][0]["values"] if float(at) >= start]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict[str, Any]]:
        data = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=str(step))
        result: list[dict[str, Any]] = data["result"]
        return result

    def metric_names(self) -> set[str]:
        return set(self.api("label/__name__/values"))

    def wait_for(self, expr: str, timeout_s: float = 15.0) -> list[dict[str, Any]]:
        """Polls until ``expr`` returns something (e.g. a scrape has seen a change)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            result = self.query(expr)
            if result:
                return result
            time.sleep(0.25)
        raise AssertionError(f"{expr!r} returned nothing within {timeout_s}s:\n{self.log_path.read_text()[-3000:]}")

def start_prometheus(tmp: Path, gateway: str, scrape_interval: str = "1s") -> Prometheus:
    """deploy/prometheus.yml (and its rules) scraping ``gateway``, with its own port and data dir."""
    require_tool("prometheus")
    config = write_config(tmp, gateway, scrape_interval)
    port = free_port()
    log_path = tmp / "prometheus.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(prometheus_command(config, tmp / "data", f"127.0.0.1:{port}"),
                                   stdout=log, stderr=subprocess.STDOUT)
    prom = Prometheus(process, port, log_path)
    prom.wait_ready("/-/ready", 60)
    return prom


# -- the expressions the dashboard and the alert rules hold ---------------------------------------
@dataclass(frozen=True)
class Target:
    panel: str
    expr: str
    instant: bool


def dashboard_targets(dashboard: dict[str, Any] | None = None) -> Iterator[Target]:
    board = dashboard if dashboard is not None else json.loads(DASHBOARD.read_text())
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            yield Target(panel["title"], target["expr"], bool(target.get("instant")))


def alert_exprs() -> dict[str, str]:
    rules = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    return {rule["alert"]: rule["expr"] for group in rules["groups"] for rule in group["rules"]}


def for_prometheus(expr: str, rate_interval: str = RATE_INTERVAL) -> str:
    """A dashboard expression as Grafana sends it, with every worker and model selected."""
    return (expr.replace("$__rate_interval", rate_interval).replace('=~"$model"', '=~".*"')
            .replace('=~"$worker"', '=~".*"'))


_NOT_NAMES = (
    r'"(?:[^"\\]|\\.)*"',  # strings (label values)
    r"\{[^}]*\}",  # label matchers
    r"\[[^\]]*\]",  # ranges
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)",  # label lists
)
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords and label names removed)."""
    text = expr
    for pattern in _NOT_NAMES:
        text = re.sub(pattern, " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", text):
        name = match.group()
        if name.lower() in _KEYWORDS or text[match.end():].lstrip().startswith("("):
            continue
        names.add(name)
    return names


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    """Every finite sample of an instant or range query result."""
    values = []
    for series in result:
        samples = series.get("values") or [series["value"]]
        values += [float(v) for _, v in samples if math.isfinite(float(v))]
    return values
