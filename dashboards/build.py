"""specgate's Grafana dashboard as typed code (grafana-foundation-sdk), rendered to JSON.

``python -m dashboards.build`` writes ``dashboards/specgate.json``; ``--check`` exits 1 when
the checked-in file differs from what this code renders (tests run it too).

The panels follow vLLM's own speculative-decoding dashboard (acceptance rate, acceptance
length, accepted and draft tokens/s, acceptance by position) and add what only specgate
knows: per-session modes and acceptance, fallback reasons, and the live policy. Thresholds
(the acceptance floor, ``max_batch``) are drawn from ``specgate_policy_threshold``, i.e. the
policy the gateway runs now, never a number copied into the dashboard.

Queries never list decision reasons: ``by (reason)`` shows whatever reasons the policy has.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from grafana_foundation_sdk.builders import bargauge, common, dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_models
from grafana_foundation_sdk.models import dashboard as dashboard_models
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

OUTPUT = Path(__file__).resolve().parent / "specgate.json"
UID = "specgate"
DATASOURCE = dashboard_models.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"
M = 'model=~"$model"'  # every series carries the gateway's model label
MW = 'model=~"$model", worker=~"$worker"'
# Series drawn as dashed reference lines (their legends), wherever they appear.
REFERENCE_LINES = ("acceptance_floor", "acceptance_resume", "max_batch", "batch_resume")

Kind = Literal["timeseries", "bargauge", "stat"]


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str
    instant: bool = False
    heatmap: bool = False  # cumulative ``le`` buckets, shown by Grafana as per-bucket counts


@dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    kind: Kind = "timeseries"
    width: int = 12
    height: int = 8
    stacked: bool = False
    min: float | None = None
    max: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _quantiles(metric: str, by: str, selector: str, what: str) -> tuple[Query, ...]:
    return tuple(
        Query(f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
              f"p{round(q * 100)} {what}")
        for q in (0.5, 0.95, 0.99))


def _threshold(name: str) -> Query:
    return Query(f'max(specgate_policy_threshold{{{M}, name="{name}"}})', name)


SPECULATION = (
    PanelSpec(
        "Acceptance: α and vLLM's accepted ÷ proposed",
        "Per worker, two definitions. alpha: accepted / tested drafts (a step's drafts after its first rejection "
        "are never tested), the per-draft acceptance the policy's acceptance_floor reads. accepted / proposed: "
        "vLLM's acceptance rate, which counts the untested drafts as failures and so depends on K (alpha 0.8 at "
        "K=6 reads 0.49). Compare the floor with alpha only (docs/policy.md, The acceptance estimate).",
        "percentunit",
        (Query(f"sum by (worker) (rate(specgate_spec_decode_accepted_by_position_total{{{MW}}}[{RATE}])) / "
               f"sum by (worker) (rate(specgate_spec_decode_tested_drafts_total{{{MW}}}[{RATE}]))",
               "alpha {{worker}}"),
         Query(f"sum by (worker) (rate(vllm:spec_decode_num_accepted_tokens_total{{{MW}}}[{RATE}])) / "
               f"sum by (worker) (rate(vllm:spec_decode_num_draft_tokens_total{{{MW}}}[{RATE}]))",
               "accepted / proposed {{worker}}"),
         _threshold("acceptance_floor")),
        min=0, max=1),
    PanelSpec(
        "Per-session acceptance against the floor",
        "Quantiles over sessions of the policy's acceptance estimate, now (sessions with min_proposals tested "
        "drafts: the evidence the policy needs before it may act), against the live acceptance_floor and "
        "acceptance_resume. Sessions below the floor decode plain (reason low_acceptance) until they climb "
        "above resume.",
        "percentunit",
        (*(Query(f"histogram_quantile({q}, sum by (le) (specgate_session_acceptance_bucket{{{M}}}))",
                 f"p{round(q * 100)} of sessions") for q in (0.1, 0.5, 0.9)),
         _threshold("acceptance_floor"), _threshold("acceptance_resume")),
        min=0, max=1),
    PanelSpec(
        "Sessions by acceptance estimate (now)",
        "How many sessions' acceptance estimate falls in each bucket (upper bound shown), sessions with "
        "min_proposals tested drafts only. Compare with the floor in the panel to the left.",
        "short",
        (Query(f"sum by (le) (specgate_session_acceptance_bucket{{{M}}})", "{{le}}", instant=True, heatmap=True),),
        kind="bargauge", width=8),
    PanelSpec(
        "Sessions below the floor",
        "Share of sessions (with min_proposals tested drafts) whose acceptance estimate is below the live "
        "acceptance_floor. The alert SpecgateMostSessionsBelowAcceptanceFloor fires above 50%.",
        "percentunit",
        (Query(f"sum(specgate_sessions_below_acceptance_floor{{{M}}}) / "
               f"clamp_min(sum(specgate_session_acceptance_gcount{{{M}}}), 1)", "below floor"),),
        kind="stat", width=4, min=0, max=1),
    PanelSpec(
        "Mean acceptance length per worker",
        "Tokens a speculative step emits on average: 1 + accepted drafts per step (vLLM's acceptance length). "
        "From the gateway's step reports, so every engine that reports steps fills it.",
        "short",
        (Query(f"1 + sum by (worker) (rate(specgate_spec_decode_accepted_by_position_total{{{MW}}}[{RATE}])) / "
               f'sum by (worker) (rate(specgate_spec_decode_drafted_by_position_total{{{MW}, position="1"}}'
               f"[{RATE}]))", "{{worker}}"),),
        width=12),
    PanelSpec(
        "Acceptance by draft position",
        "Of the drafts proposed at position n of a step, the share accepted (vLLM's acceptance by position). "
        "It falls with n: a draft counts only if every draft before it was accepted.",
        "percentunit",
        (Query(f"sum by (position) (rate(specgate_spec_decode_accepted_by_position_total{{{MW}}}[{RATE}])) / "
               f"sum by (position) (rate(specgate_spec_decode_drafted_by_position_total{{{MW}}}[{RATE}]))",
               "position {{position}}"),),
        min=0, max=1),
    PanelSpec(
        "Generated tokens: speculative vs plain",
        "Share of completion tokens decoded by speculative steps and by plain steps (a speculative request "
        "runs plain steps while its worker's batch is over max_batch).",
        "percentunit",
        (Query(f"sum by (mode) (rate(specgate_tokens_total{{{M}}}[{RATE}])) / ignoring (mode) group_left "
               f"sum(rate(specgate_tokens_total{{{M}}}[{RATE}]))", "{{mode}}"),),
        stacked=True, min=0, max=1),
    PanelSpec(
        "Tokens/s: generated, drafted, accepted",
        "Completion tokens/s by decoding mode (gateway), and draft tokens proposed and accepted per second "
        "per worker (workers' counters).",
        "short",
        (Query(f"sum by (mode) (rate(specgate_tokens_total{{{M}}}[{RATE}]))", "generated {{mode}}"),
         Query(f"sum by (worker) (rate(vllm:spec_decode_num_draft_tokens_total{{{MW}}}[{RATE}]))",
               "drafted {{worker}}"),
         Query(f"sum by (worker) (rate(vllm:spec_decode_num_accepted_tokens_total{{{MW}}}[{RATE}]))",
               "accepted {{worker}}")),
        extra={"unit": "suffix: tok/s"}),
)

POLICY = (
    PanelSpec(
        "Sessions by current mode",
        "Sessions in the gateway's table by the mode of their last decision (undecided: no request admitted "
        "yet).",
        "short",
        (Query(f"sum by (mode) (specgate_sessions{{{M}}})", "{{mode}}"),),
        stacked=True),
    PanelSpec(
        "Fallbacks/s by reason",
        "Decisions to decode plain, by the rule that made them (README: How the policy decides).",
        "reqps",
        (Query(f"sum by (reason) (rate(specgate_fallbacks_total{{{M}}}[{RATE}]))", "{{reason}}"),),
        stacked=True),
    PanelSpec(
        "Mode switches/s",
        "Sessions whose decision changed mode, by the new mode and the reason for it. Frequent switches of "
        "the same sessions would mean flapping; hysteresis should keep this low.",
        "reqps",
        (Query(f"sum by (to, reason) (rate(specgate_mode_switches_total{{{M}}}[{RATE}]))", "to {{to}}: {{reason}}"),)),
    PanelSpec(
        "Batch depth per worker against max_batch",
        "Sequences running in each worker's batch (and waiting for a slot), against the live policy's "
        "max_batch (above it requests decode plain, reason batch_full) and batch_resume.",
        "short",
        (Query(f"max by (worker) (specgate_worker_batch_depth{{{MW}}})", "running {{worker}}"),
         Query(f"max by (worker) (specgate_worker_queue_length{{{MW}}})", "queued {{worker}}"),
         _threshold("max_batch"), _threshold("batch_resume")),
        min=0),
    PanelSpec(
        "Requests placed by why that worker",
        "sticky: the session's own worker. prefix: a new placement won by the expected prefix hit (the gateway sent "
        "that worker the same prompt start before). load: the least-loaded worker, or the load guard overruled "
        "(policy.route_balance_abs and route_balance_rel) or the load bound (route_load_factor, route_load_slack). "
        "method: the session moved to a worker whose batch runs its kind of step (policy.route_method_margin).",
        "reqps",
        (Query(f"sum by (reason) (rate(specgate_routes_total{{{M}}}[{RATE}]))", "{{reason}}"),),
        stacked=True),
    PanelSpec(
        "Speculation by method",
        "Decisions to speculate per second by method (draft model, prompt lookup ngram, suffix), where sessions "
        "choose one (policy.methods); explore: a method's first run in a session.",
        "reqps",
        (Query(f"sum by (method, reason) (rate(specgate_method_decisions_total{{{M}}}[{RATE}]))",
               "{{method}} {{reason}}"),),
        stacked=True),
    PanelSpec(
        "Acceptance by method",
        "alpha by method: accepted / tested drafts, what each method's own acceptance_floor latch reads.",
        "percentunit",
        (Query(f'sum by (method) (rate(specgate_method_drafts_total{{{M}, count="accepted"}}[{RATE}])) / '
               f'sum by (method) (rate(specgate_method_drafts_total{{{M}, count="tested"}}[{RATE}]))',
               "alpha {{method}}"),
         _threshold("acceptance_floor")),
        min=0, max=1),
    PanelSpec(
        "Drafts proposed per step by method",
        "Proposals per engine step of requests speculating with each method. A lookup step that finds no match "
        "proposes nothing and runs plain, so for ngram and suffix this is coverage times proposal length.",
        "short",
        (Query(f'sum by (method) (rate(specgate_method_drafts_total{{{M}, count="proposed"}}[{RATE}])) / '
               f"sum by (method) (rate(specgate_method_steps_total{{{M}}}[{RATE}]))", "{{method}}"),),
        min=0),
    PanelSpec(
        "Active policy",
        "The policy the gateway runs now (config.yaml names), as of the last scrape.",
        "short",
        (Query(f"max by (name) (specgate_policy_threshold{{{M}}})", "{{name}}", instant=True),),
        kind="stat"),
    PanelSpec(
        "Policy reloads",
        "Reloads by source (file, sighup, api) and result. A failed reload keeps the running policy; GET "
        "/admin/policy names the field in last_error.",
        "short",
        (Query(f"sum by (source, result) (increase(specgate_policy_reloads_total{{{M}}}[{RATE}]))",
               "{{source}} {{result}}"),),
        extra={"failed_red": True}),
)

LATENCY = (
    PanelSpec("Time to first token", "TTFT quantiles by the request's decoding mode.", "s",
              _quantiles("specgate_time_to_first_token_seconds", "mode", M, "{{mode}}")),
    PanelSpec("Inter-token latency", "Gap between streamed tokens, quantiles by the mode of the step that made them.",
              "s", _quantiles("specgate_inter_token_latency_seconds", "mode", M, "{{mode}}")),
    PanelSpec("End-to-end latency", "Request latency from arrival to the last byte, quantiles by route.", "s",
              _quantiles("specgate_e2e_latency_seconds", "route", M, "{{route}}")),
    PanelSpec(
        "Verification time",
        "Mean time of the target's verification forward per step (since the worker started), and engine "
        "step time quantiles. Embedded workers fill both; vLLM workers (workers.engine: vllm) leave both "
        "empty, since vLLM does not report them.",
        "ms",
        (Query(f"max by (worker) (vllm:spec_decode_mean_verification_time_ms{{{MW}}})", "verify mean {{worker}}"),
         *(Query(f"1000 * histogram_quantile({q}, sum by (le, worker) "
                 f"(rate(specgate_worker_step_seconds_bucket{{{MW}}}[{RATE}])))",
                 f"step p{round(q * 100)} {{{{worker}}}}") for q in (0.5, 0.99)))),
)

FLEET = (
    PanelSpec("Workers up", "1 while a worker is ready for requests.", "short",
              (Query(f"max by (worker) (specgate_worker_up{{{MW}}})", "{{worker}}"),), width=8, min=0, max=1),
    PanelSpec("Worker restarts", "Worker processes restarted by the gateway (crash, hang, failed start).", "short",
              (Query(f"sum by (worker) (increase(specgate_worker_restarts_total{{{MW}}}[{RATE}]))", "{{worker}}"),),
              width=8),
    PanelSpec(
        "Client and server errors/s",
        "Responses with 4xx status (499: the client left) and 5xx status (502/504: a worker failed). A stream "
        "that fails after it started is counted with its 200 status; its client sees an error event.",
        "reqps",
        (Query(f'sum by (status) (rate(specgate_requests_total{{{M}, status=~"4.."}}[{RATE}]))', "{{status}}"),
         Query(f'sum by (status) (rate(specgate_requests_total{{{M}, status=~"5.."}}[{RATE}]))', "{{status}}")),
        width=8),
)

ROWS = (("Speculation", SPECULATION), ("Policy", POLICY), ("Latency", LATENCY), ("Fleet and errors", FLEET))


def _target(query: Query, ref: str) -> prometheus.Dataquery:
    target = prometheus.Dataquery().expr(query.expr).legend_format(query.legend).ref_id(ref).datasource(DATASOURCE)
    target = target.instant() if query.instant else target.range()
    if query.heatmap:
        target = target.format(PromQueryFormat.HEATMAP)
    return target


def _dashed(name: str) -> tuple[str, list[dashboard_models.DynamicConfigValue]]:
    return name, [dashboard_models.DynamicConfigValue("custom.lineStyle", {"fill": "dash", "dash": [10, 10]}),
                  dashboard_models.DynamicConfigValue("color", {"mode": "fixed", "fixedColor": "red"})]


def _panel(spec: PanelSpec, panel_id: int) -> timeseries.Panel | bargauge.Panel | stat.Panel:
    panel: timeseries.Panel | bargauge.Panel | stat.Panel
    if spec.kind == "timeseries":
        panel = timeseries.Panel().legend(
            common.VizLegendOptions().display_mode(common_models.LegendDisplayMode.LIST)
            .placement(common_models.LegendPlacement.BOTTOM).show_legend(True))
        if spec.stacked:
            panel = panel.stacking(common.StackingConfig().mode(common_models.StackingMode.NORMAL)).fill_opacity(30)
        for query in spec.queries:
            if query.legend in REFERENCE_LINES:
                panel = panel.override_by_name(*_dashed(query.legend))
        if spec.extra.get("failed_red"):
            panel = panel.override_by_regexp(".* failed", [dashboard_models.DynamicConfigValue(
                "color", {"mode": "fixed", "fixedColor": "red"})])
    elif spec.kind == "bargauge":
        panel = bargauge.Panel().orientation(common_models.VizOrientation.VERTICAL).reduce_options(
            common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    else:
        panel = stat.Panel().reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    panel = (panel.id(panel_id).title(spec.title).description(spec.description).datasource(DATASOURCE)
             .unit(spec.extra.get("unit", spec.unit)).span(spec.width).height(spec.height))
    if spec.min is not None:
        panel = panel.min(spec.min)
    if spec.max is not None:
        panel = panel.max(spec.max)
    for i, query in enumerate(spec.queries):
        panel = panel.with_target(_target(query, chr(ord("A") + i)))
    return panel


def build() -> dashboard_models.Dashboard:
    board = (
        dashboard.Dashboard("specgate: speculative decoding gateway").uid(UID)
        .description("Is acceptance where we expect, how much traffic is speculative, why sessions fall back, "
                     "and what it does to latency. Generated by dashboards/build.py; do not edit the JSON.")
        .tags(["specgate", "speculative-decoding", "vllm"]).refresh("10s").time("now-1h", "now")
        .timezone("browser").editable().tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR)
        .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(dashboard.QueryVariable("model").label("Model").datasource(DATASOURCE)
                       .query("label_values(specgate_requests_total, model)")
                       .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
                       .multi(True).include_all(True).all_value(".*"))
        .with_variable(dashboard.QueryVariable("worker").label("Worker").datasource(DATASOURCE)
                       .query('label_values(specgate_worker_up{model=~"$model"}, worker)')
                       .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
                       .multi(True).include_all(True).all_value(".*"))
    )
    panel_id = 1
    for title, specs in ROWS:
        board = board.with_row(dashboard.Row(title).id(panel_id))
        panel_id += 1
        for spec in specs:
            board = board.with_panel(_panel(spec, panel_id))
            panel_id += 1
    return board.build()


def render() -> str:
    return json.dumps(build(), cls=JSONEncoder, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards.build", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the checked-in JSON is out of date")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date: run python -m dashboards.build", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
