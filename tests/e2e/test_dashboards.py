"""The dashboard as code, the deploy/ files and the docs, without a gateway running.

The live half (every query against a real Prometheus scraping a real gateway) is in
tests/e2e/test_observability.py.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from dashboards import build
from dashboards.observe import DEPLOY, REPO, write_config
from tests.e2e.documented_metrics import METRICS_DOC, base_name, documented_metrics
from tests.e2e.prom_harness import DASHBOARD, alert_exprs, dashboard_targets, metric_names, promtool


@pytest.fixture(scope="module")
def board() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def test_checked_in_dashboard_is_what_the_code_renders(tmp_path: Path) -> None:
    assert DASHBOARD.read_text() == build.render(), "run: python -m dashboards.build"
    assert build.main(["--check"]) == 0
    stale = tmp_path / "specgate.json"
    stale.write_text(DASHBOARD.read_text().replace("Mean acceptance length", "Acceptance length"))
    assert build.main(["--check", "--output", str(stale)]) == 1


def test_datasource_and_variables_make_it_importable_anywhere(board: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("model", "worker"):
        assert variables[name]["type"] == "query" and variables[name]["datasource"]["uid"] == "${datasource}"
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    assert "$model" in variables["worker"]["query"]
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            # Every series carries the model label, so every query honours the model variable.
            assert '=~"$model"' in target["expr"], (panel["title"], target["expr"])
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


def test_panels_cover_the_operators_questions(board: dict[str, Any]) -> None:
    panels = {p["title"]: p for p in board["panels"] if p["type"] != "row"}
    exprs = {title: " ".join(t["expr"] for t in p["targets"]) for title, p in panels.items()}
    wanted = {
        "Acceptance: α and vLLM's accepted ÷ proposed": "specgate_spec_decode_tested_drafts_total",
        "Per-session acceptance against the floor": 'name="acceptance_floor"',
        "Sessions by acceptance estimate (now)": "specgate_session_acceptance_bucket",
        "Mean acceptance length per worker": "specgate_spec_decode_drafted_by_position_total",
        "Acceptance by draft position": "by (position)",
        "Generated tokens: speculative vs plain": "specgate_tokens_total",
        "Tokens/s: generated, drafted, accepted": "vllm:spec_decode_num_accepted_tokens_total",
        "Fallbacks/s by reason": "by (reason)",
        "Mode switches/s": "specgate_mode_switches_total",
        "Batch depth per worker against max_batch": 'name="max_batch"',
        "Policy reloads": "specgate_policy_reloads_total",
        "Time to first token": "specgate_time_to_first_token_seconds_bucket",
        "Inter-token latency": "specgate_inter_token_latency_seconds_bucket",
        "End-to-end latency": "specgate_e2e_latency_seconds_bucket",
        "Verification time": "vllm:spec_decode_mean_verification_time_ms",
        "Workers up": "specgate_worker_up",
        "Worker restarts": "specgate_worker_restarts_total",
        "Client and server errors/s": 'status=~"5.."',
    }
    for title, needle in wanted.items():
        assert needle in exprs[title], (title, exprs[title])
    for title in ("Time to first token", "Inter-token latency", "End-to-end latency"):
        assert all(f"histogram_quantile({q}," in exprs[title] for q in (0.5, 0.95, 0.99)), title
    assert "vLLM" in panels["Verification time"]["description"]
    # Reasons are never listed: a new decision reason shows up without a dashboard change.
    for title, expr in exprs.items():
        assert "reason=" not in expr and "reason!" not in expr, title


def test_promtool_accepts_the_scrape_config_and_rules(tmp_path: Path) -> None:
    for args in (("check", "config", "prometheus.yml"), ("check", "rules", "alerts.yml"),
                 ("check", "config", str(write_config(tmp_path, "127.0.0.1:8000", "1s")))):
        result = promtool(*args)
        assert result.returncode == 0, (args, result.stdout, result.stderr)
    assert "7 rules found" in promtool("check", "rules", "alerts.yml").stdout


def test_promtool_unit_tests_fire_and_stay_quiet_for_every_alert() -> None:
    result = promtool("test", "rules", "alerts.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    tests = yaml.safe_load((DEPLOY / "alerts.test.yml").read_text())["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"]]
    for alert in alert_exprs():
        assert any(c["alertname"] == alert and c["exp_alerts"] for c in cases), f"{alert} never fires"
        # Quiet on a healthy series: an expected list names only the failing one, or nothing.
        assert any(c["alertname"] == alert and len(c["exp_alerts"]) <= 1 for c in cases), alert


def test_grafana_provisioning_points_at_the_dashboard() -> None:
    provisioning = DEPLOY / "grafana" / "provisioning"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "specgate.yml").read_text())["providers"]
    path = Path(provider["options"]["path"].replace("${SPECGATE_HOME}", str(REPO)))
    assert path.resolve() == DASHBOARD.parent and (path / DASHBOARD.name).is_file()
    assert [p.name for p in path.glob("*.json")] == [DASHBOARD.name]  # Grafana loads every JSON there
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "specgate.yml").read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["isDefault"]
    scrape = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert datasource["jsonData"]["timeInterval"] == scrape["global"]["scrape_interval"]
    assert "authorization:" in (DEPLOY / "prometheus.yml").read_text()  # the metrics-token placeholder






def test_docs_describe_every_metric_the_dashboard_and_alerts_use() -> None:
    documented = documented_metrics()
    used = {base_name(n) for t in dashboard_targets() for n in metric_names(t.expr)}
    used |= {base_name(n) for expr in alert_exprs().values() for n in metric_names(expr)} - {"up"}
    assert used - documented == set(), f"undocumented in {METRICS_DOC}"


def test_make_observe_and_ci_install_prometheus() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^observe:", makefile, re.M) and "dashboards.observe" in makefile
    # make test installs Prometheus (system-deps) before it runs the tests; CI runs make test.
    assert re.search(r"^test: install system-deps$", makefile, re.M)
    assert re.search(r"^SYSTEM_PACKAGES := .*\bprometheus\b", makefile, re.M)
    assert "make test" in (REPO / ".ci" / "run").read_text()
    assert os.access(REPO / ".ci" / "run", os.X_OK)
