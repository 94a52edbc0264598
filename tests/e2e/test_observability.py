"""The dashboard and the alert rules against a real Prometheus scraping a real gateway.

One gateway (two embedded workers, ``max_batch: 2``) and one Prometheus (1 s scrapes of
deploy/prometheus.yml, with deploy/alerts.yml loaded) run a short mixed workload: a worker
killed mid-request (a 502, and a restart), code prompts at T=0 and the same sessions at T=1
(mode switches), a burst over ``max_batch``, an unknown model (404), a rejected and an
accepted policy edit. Then every dashboard and alert expression goes through Prometheus's
HTTP API: it must parse, name only metrics Prometheus has, and every panel must show data.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from tests.e2e.harness import Gateway, sdk_client, start_gateway, write_config
from tests.e2e.prom_harness import (
    Prometheus,
    alert_exprs,
    dashboard_targets,
    finite_values,
    for_prometheus,
    metric_names,
    start_prometheus,
)

CODE_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    parser = "
LONG_PROMPT = "class Config:\n    def __init__(self, path):\n        "
MODEL = "specgate-demo"
# batch_resume = max_batch: a worker's per-step latch clears as soon as its batch is back to 2.
POLICY = {"max_batch": 2, "batch_resume": 2, "min_proposals": 16}
# The dashboard's acceptance rate (a ratio of rates) against the workers' own totals. The test
# lays the window exactly on two scrapes, so rate() has (almost) nothing to extrapolate; what is
# left is rounding. (A window with free edges was off by 0.064 in CI: rate() extrapolates each
# counter to the edges, and stops at zero for a counter that starts near zero, which skews the
# ratio for the worker that was killed and restarted.)
RATE_TOLERANCE = 0.005


@dataclass
class Observed:
    gateway: Gateway
    prometheus: Prometheus
    started: float  # wall clock, when Prometheus began scraping
    restarted: float  # wall clock, after the killed worker was back and before the main workload
    workload: float  # wall clock, when the main workload began (a scrape lies between the two)
    sessions: list[str]


def _put_policy(gateway: Gateway, policy: dict[str, Any]) -> int:
    request = urllib.request.Request(gateway.url + "/admin/policy", data=json.dumps(policy).encode(), method="PUT",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        with error:
            return int(error.code)


def _wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _worker(gateway: Gateway, worker_id: str) -> dict[str, Any]:
    return next(w for w in gateway.get_json("/admin/workers")["workers"] if w["worker_id"] == worker_id)


def _kill_worker_mid_request(gateway: Gateway, client: openai.OpenAI) -> str:
    """A non-streaming request whose worker dies after its first chunk, with migration off: a 502."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(client.completions.create, model=MODEL, prompt=LONG_PROMPT, max_tokens=900,
                             temperature=0, extra_headers={"X-Session-ID": "victim"})
        # Tokens relayed: the worker's stream has begun, so the gateway can no longer retry elsewhere.
        _wait(lambda: gateway.metric("specgate_tokens_total") > 0, 60, "the first relayed tokens")
        (victim,) = [w for w in gateway.get_json("/admin/workers")["workers"] if w["in_flight"]]
        os.kill(victim["pid"], signal.SIGKILL)
        with pytest.raises(openai.InternalServerError) as failed:
            future.result(timeout=60)
    assert failed.value.status_code == 502, failed.value
    return str(victim["worker_id"])


def _workload(gateway: Gateway, client: openai.OpenAI) -> list[str]:
    sessions = [f"code-{i}" for i in range(4)]
    modes: list[str] = []
    for temperature, max_tokens in ((0.0, 48), (1.0, 16)):  # T=1 is above max_temperature: plain

        def complete(session: str, temperature: float = temperature, max_tokens: int = max_tokens) -> str:
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt=CODE_PROMPT, max_tokens=max_tokens, temperature=temperature,
                extra_headers={"X-Session-ID": session})
            return str(raw.headers["X-Specgate-Mode"])

        with ThreadPoolExecutor(2) as pool:  # two at a time: sessions land on both workers
            modes += pool.map(complete, sessions)
    assert modes[:4] == ["speculative; k=6; reason=default"] * 4, modes
    assert modes[4:] == ["plain; reason=high_temperature"] * 4, modes

    # Eight streams at once over two workers: the seventh admitted finds three in flight on its
    # worker (> max_batch 2) while the first six still run. They start together (the barrier)
    # and run long enough to overlap: with 32 tokens each (a 24-token completion took 40 ms on
    # the AMX Xeon) one CI run there saw no stream decoded plain.
    start = threading.Barrier(8)

    def burst(i: int) -> str:
        start.wait(timeout=30)
        with client.completions.with_streaming_response.create(
                model=MODEL, prompt=LONG_PROMPT, max_tokens=256, temperature=0, stream=True,
                extra_headers={"X-Session-ID": f"burst-{i}"}) as response:
            for _ in response.iter_lines():
                pass
            return str(response.headers["X-Specgate-Mode"])

    with ThreadPoolExecutor(8) as pool:
        burst_modes = list(pool.map(burst, range(8)))
    assert "plain; reason=batch_full" in burst_modes, burst_modes
    sessions += [f"burst-{i}" for i in range(8)]

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    policy = gateway.get_json("/admin/policy")["policy"]
    assert _put_policy(gateway, {**policy, "acceptance_floor": 1.5}) == 400
    # Sessions choosing their method (policy.methods): the draft first, then whatever the
    # worker's shadow evidence of ngram and suffix (replayed on the first answer) says pays, never
    # an exploration at T=0; a second session's request two scrapes later, so the method series
    # increase while Prometheus already has them (a ratio of rates needs that).
    assert _put_policy(gateway, {**policy, "methods": ["draft", "ngram", "suffix"]}) == 200

    def choose(session: str) -> str:
        return str(client.completions.with_raw_response.create(
            model=MODEL, prompt=CODE_PROMPT, max_tokens=24, temperature=0,
            extra_headers={"X-Session-ID": session}).headers["X-Specgate-Mode"])
    chosen = [choose("methods-0"), choose("methods-0")]
    time.sleep(2.5)
    chosen.append(choose("methods-1"))
    assert chosen[0].startswith("speculative; method=draft;"), chosen
    assert all(m.startswith("speculative; method=") and "reason=explore" not in m for m in chosen), chosen
    sessions += ["methods-0", "methods-1"]
    assert _put_policy(gateway, {**policy, "acceptance_floor": 0.65}) == 200
    return sessions


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    tmp = tmp_path_factory.mktemp("observe")
    # max_migrations 0: a worker killed mid-request fails that request (a 502 for the 5xx panels)
    # instead of resuming it on the other worker.
    config = write_config(tmp / "config.yaml", server={"max_migrations": 0},
                          workers={"count": 2, "max_slots": 8, "restart_backoff_s": 0.2}, policy=POLICY)
    gateway = start_gateway(config, tmp)
    prometheus: Prometheus | None = None
    try:
        gateway.wait_workers_ready(2)
        prometheus = start_prometheus(tmp / "prometheus", f"127.0.0.1:{gateway.port}")
        started = time.time()
        prometheus.wait_for('specgate_worker_up{worker="worker-1"} == 1')
        with sdk_client(gateway) as client:
            victim = _kill_worker_mid_request(gateway, client)
            _wait(lambda: _worker(gateway, victim)["status"] == "ready", 60, f"{victim} to restart")
            prometheus.wait_for(f'specgate_worker_up{{worker="{victim}"}} == 1')
            restarted = time.time()
            time.sleep(2.5)  # scrapes strictly between the restart and the workload
            workload = time.time()
            sessions = ["victim", *_workload(gateway, client)]
        # Quiet: let the gateway poll the workers and Prometheus scrape the final counts.
        time.sleep(1.0)
        prometheus.wait_for('specgate_policy_threshold{name="acceptance_floor"} == 0.65')
        time.sleep(2.5)
        yield Observed(gateway, prometheus, started, restarted, workload, sessions)
    finally:
        if prometheus is not None:
            prometheus.stop()
        gateway.stop()


@pytest.mark.slow
def test_every_dashboard_query_parses_and_names_real_metrics(observed: Observed) -> None:
    prom = observed.prometheus
    known = prom.metric_names()
    targets = list(dashboard_targets())
    assert len(targets) >= 30
    for target in targets:
        expr = for_prometheus(target.expr)
        prom.query(expr)  # raises on a parse error
        names = metric_names(target.expr)
        assert names, f"{target.panel}: no metric found in {target.expr}"
        assert names <= known, f"{target.panel}: {sorted(names - known)} not in Prometheus ({target.expr})"


def test_every_dashboard_panel_shows_data_after_the_workload(observed: Observed) -> None:
    prom = observed.prometheus
    end = time.time()
    empty = []
    for target in dashboard_targets():
        expr = for_prometheus(target.expr)
        result = prom.query(expr) if target.instant else prom.query_range(expr, observed.started, end)
        if not finite_values(result):
            empty.append(f"{target.panel}: {expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_alert_rules_parse_name_real_metrics_and_evaluate(observed: Observed) -> None:
    prom = observed.prometheus
    known = prom.metric_names()
    for alert, expr in alert_exprs().items():
        prom.query(expr)
        names = metric_names(expr)
        assert names and names <= known, (alert, sorted(names - known))
    # The server loaded deploy/alerts.yml and evaluated every rule without an error.
    rules = [rule for group in prom.api("rules")["groups"] for rule in group["rules"]]
    assert {rule["name"] for rule in rules} == set(alert_exprs())
    for rule in rules:
        assert rule["health"] == "ok", rule
    # A healthy run: nothing firing but the failed reload the workload caused on purpose (and
    # the worker it killed, restarted once, is neither restarting repeatedly nor down).
    firing = {a["labels"]["alertname"] for a in prom.api("alerts")["alerts"] if a["state"] == "firing"}
    assert firing <= {"SpecgatePolicyReloadFailed"}, firing


def test_acceptance_rate_matches_the_workers_own_counts(observed: Observed) -> None:
    prom, gateway = observed.prometheus, observed.gateway
    workers = gateway.get_json("/admin/workers")["workers"]
    # /admin/workers counts since each worker process started, Prometheus's counters since the
    # gateway did: both are compared from the restart on.
    since = f"@ {observed.restarted:.3f}"
    (panel,) = [t for t in dashboard_targets()
                if t.panel == "Acceptance: α and vLLM's accepted ÷ proposed" and "vllm:" in t.expr]
    checked = 0
    for worker in workers:
        stats, name = worker["stats"], worker["worker_id"]
        assert stats["draft_tokens"] > 0, worker
        counts = {}
        for counter in ("accepted", "draft"):
            series = f'vllm:spec_decode_num_{counter}_tokens_total{{worker="{name}"}}'
            counts[counter] = prom.value(f"sum({series}) - (sum({series} {since}) or vector(0))")
        assert counts == {"accepted": stats["accepted_tokens"], "draft": stats["draft_tokens"]}, (name, counts, stats)
        expected = stats["accepted_tokens"] / stats["draft_tokens"]
        # The panel over a window from the last scrape before the workload to the last scrape:
        # it holds every increment since the restart, and its edges are scrapes.
        scrapes = prom.sample_times(f'vllm:spec_decode_num_draft_tokens_total{{worker="{name}"}}',
                                    observed.restarted, time.time())
        first = max(at for at in scrapes if at < observed.workload)
        last = scrapes[-1]
        window = f"{round((last - first) * 1000) + 1}ms"
        by_worker = {s["metric"]["worker"]: float(s["value"][1])
                     for s in prom.query(for_prometheus(panel.expr, rate_interval=window), at=last)}
        assert abs(by_worker[name] - expected) <= RATE_TOLERANCE, (name, by_worker[name], expected, window)
        checked += 1
    assert checked == 2


def test_workload_effects_reach_prometheus(observed: Observed) -> None:
    prom = observed.prometheus

    def total(selector: str) -> float:
        return sum(float(s["value"][1]) for s in prom.query(selector))

    assert total('specgate_requests_total{status="502"}') >= 1
    assert total('specgate_requests_total{status="404"}') >= 1
    assert total('specgate_fallbacks_total{reason="batch_full"}') >= 1
    assert total('specgate_fallbacks_total{reason="high_temperature"}') >= 4
    assert total('specgate_mode_switches_total{to="plain"}') >= 1
    assert total('specgate_policy_reloads_total{result="failed"}') == 1
    assert total("specgate_worker_restarts_total") == 1
    # Thresholds come from the live policy: the test's max_batch, and the floor the PUT set.
    assert prom.value('specgate_policy_threshold{name="max_batch"}') == POLICY["max_batch"]
    assert prom.value('specgate_policy_threshold{name="acceptance_floor"}') == 0.65
    judged = prom.value("specgate_session_acceptance_gcount")
    assert judged >= 1
    assert prom.value('specgate_session_acceptance_bucket{le="+Inf"}') == judged
    assert 0 <= prom.value("specgate_sessions_below_acceptance_floor") <= judged


def test_no_session_id_in_any_series(observed: Observed) -> None:
    text = observed.gateway.metrics()
    series = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert series
    for session in observed.sessions:
        assert not any(f'"{session}"' in line for line in series), session
    labels = {name for line in series if "{" in line
              for name in (pair.split("=")[0] for pair in line[line.index("{") + 1:line.rindex("}")].split(","))}
    assert labels <= {"model", "worker", "route", "status", "mode", "reason", "to", "source", "result", "name", "le",
                      "position", "shape", "method", "count"}, labels


def test_docs_describe_every_metric_prometheus_sees(observed: Observed) -> None:
    from tests.e2e.documented_metrics import base_name, documented_metrics

    exported = {base_name(n) for n in observed.prometheus.metric_names() if n.startswith(("specgate_", "vllm:"))}
    assert len(exported) >= 20
    assert exported - documented_metrics() == set(), "add them to docs/metrics.md"
    assert documented_metrics() - exported == set(), "documented but not exported"
