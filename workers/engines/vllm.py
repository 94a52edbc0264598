"""vLLM's ``AsyncLLM`` (target + draft) behind the worker's engine interface.

One vLLM engine serves both modes: specgate's scheduler plugin (``workers/vllm_plugin``)
reads each request's K from ``SamplingParams.extra_args`` and cuts its drafts to it, so a
session switched to plain decoding needs no second pool and no second copy of the weights.

- Prompts go in as token ids and come out as token ids (``detokenize=False``): text, stop
  strings and usage are the worker server's, exactly as for the embedded engine.
- Acceptance: vLLM learns it per step inside its engine core and reports it per request only
  when the request ends (``per_request_spec_decode_metrics="detailed"``). The final event
  carries it as ``late_steps``, one group per (drafted, accepted) pair, which the gateway folds
  into the session's estimate step by step, as it does the embedded engine's per-step reports.
- Metrics: a stat logger turns vLLM's per-step scheduler stats into specgate's ``StepStats``.
  vLLM's own Prometheus logger is replaced by a silent one: its series would collide with the
  worker's (prometheus_client refuses duplicated names), and specgate's table covers them.
  vLLM reports no verification time; ``vllm:spec_decode_mean_verification_time_ms`` stays
  empty for vLLM workers.
- Cost model: the stat logger times each engine iteration as the gap since the previous one
  (while requests run, the engine core iterates back to back, so the gap is the step) and folds
  it, by batch depth and mean drafts per running request, into ``StepTimeCosts``
  (``workers/costs/cost_report.py``): whole steps only, an estimate that appears once a plain and a
  speculative step have been seen. The gap also includes scheduling and output processing,
  which a plain step pays too. The per-step cost rule is the plugin's business and not
  applied here (``cost_rule`` is accepted and ignored).

Only this module (and the plugin) imports vLLM; it runs in the vLLM environment.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.api.generation import SpecSteps, group_steps
from workers.costs.cost_report import CostReport, depth_grid
from workers.costs.online import StepTimeCosts
from workers.engines.interface import (
    EngineInfo,
    EngineRequestError,
    EngineTotals,
    FinishReason,
    GenerationRequest,
    StepEvent,
    StepObserver,
    StepStats,
)

log = logging.getLogger(__name__)
SYNC_SCHEDULER = "specgate_vllm.scheduler.SpecgateScheduler"
ASYNC_SCHEDULER = "specgate_vllm.scheduler.SpecgateAsyncScheduler"


@dataclass(frozen=True)
class VllmSettings:
    target: Path
    draft: Path | None
    max_slots: int = 16  # vLLM's max_num_seqs
    max_k: int = 8  # the engine's num_speculative_tokens: the deepest K a request can get
    dtype: str = "auto"  # vLLM's dtype (auto: the checkpoint's)
    max_model_len: int | None = None
    threads: int = 1
    # Further AsyncEngineArgs fields, as operators pass them to `vllm serve` (workers.vllm_args).
    engine_args: Mapping[str, Any] = field(default_factory=dict)
    # An EAGLE-3 head (speculators' format): the engine's method is then eagle3, not the draft's
    # (a vLLM engine runs one method for its life).
    eagle3: Path | None = None


def late_steps(metrics: Any) -> tuple[SpecSteps, ...]:
    """vLLM's per-request ``detailed`` metrics as (drafted, accepted, count) groups."""
    if metrics is None:
        return ()
    return group_steps(getattr(metrics, "per_step_drafted", None) or (),
                       getattr(metrics, "per_step_accepted", None) or ())


def _eos_ids(model_dir: Path) -> frozenset[int]:
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return frozenset(int(i) for i in ids)


def _engine_args(s: VllmSettings) -> tuple[Any, bool]:
    """vLLM's engine arguments for these settings, and whether they speculate (a draft and K > 0)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    speculative: dict[str, Any] | None = None
    if s.eagle3 is not None and s.max_k > 0:
        speculative = {"method": "eagle3", "model": str(s.eagle3), "num_speculative_tokens": s.max_k}
    elif s.draft is not None and s.max_k > 0:
        speculative = {"method": "draft_model", "model": str(s.draft), "num_speculative_tokens": s.max_k}
    # Operators' vLLM arguments (workers.vllm_args) win over the worker's generic ones.
    fields: dict[str, Any] = {"dtype": s.dtype, "max_model_len": s.max_model_len}
    fields.update(s.engine_args)
    args = AsyncEngineArgs(model=str(s.target), max_num_seqs=s.max_slots, speculative_config=speculative,
                           per_request_spec_decode_metrics="detailed", disable_log_stats=False, **fields)
    return args, speculative is not None


class VllmEngine:
    def __init__(self, settings: VllmSettings) -> None:
        self.settings = settings
        self._llm: Any = None
        self._info: EngineInfo | None = None
        self._totals = EngineTotals()
        self._in_flight = 0
        self._max_batch = 1 << 30
        self._batch_resume = 1 << 30
        self._latched = False  # the frontend's mirror of the plugin's latch (the plugin's runs in the engine core)
        self._observer: StepObserver | None = None
        speculates = settings.draft is not None or settings.eagle3 is not None
        self._costs = StepTimeCosts(depth_grid(settings.max_slots), settings.max_k if speculates else 0)

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("engine not started")
        return self._info

    @property
    def batch_depth(self) -> int:
        return min(self._in_flight, self.settings.max_slots)

    @property
    def queue_length(self) -> int:
        return max(0, self._in_flight - self.settings.max_slots)

    @property
    def batch_full(self) -> bool:
        depth = self.batch_depth
        if depth > self._max_batch:
            self._latched = True
        elif depth < self._batch_resume:
            self._latched = False
        return self._latched

    @property
    def totals(self) -> EngineTotals:
        return self._totals

    @property
    def cost_model(self) -> CostReport | None:
        return self._costs.report()

    async def start(self, observer: StepObserver) -> None:
        # vLLM's CPU build sizes its KV cache from this (GiB); its engine processes talk over
        # the host's address unless told to use loopback.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.executor import Executor
        from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerBase

        s = self.settings
        args, speculative = _engine_args(s)
        vllm_config = args.create_engine_config()
        # The plugin's base class must match the engine's scheduling (see specgate_vllm.scheduler).
        scheduler = vllm_config.scheduler_config
        scheduler.scheduler_cls = ASYNC_SCHEDULER if scheduler.async_scheduling else SYNC_SCHEDULER
        totals, costs = self._totals, self._costs
        self._observer = observer

        class StepStatsLogger(StatLoggerBase):  # type: ignore[misc]
            """vLLM's per-step scheduler stats, as specgate's StepStats."""

            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                self.last_at: float | None = None  # when the previous busy iteration was recorded

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:
                if scheduler_stats is None:
                    return
                now = time.perf_counter()
                spec = scheduler_stats.spec_decoding_stats
                running = scheduler_stats.num_running_reqs
                step_s = 0.0 if self.last_at is None else now - self.last_at
                self.last_at = now if running else None
                if step_s and running:
                    costs.observe(running, round((spec.num_draft_tokens if spec else 0) / running), step_s)
                stats = StepStats(
                    proposed=spec.num_draft_tokens if spec else 0, accepted=spec.num_accepted_tokens if spec else 0,
                    emitted=iteration_stats.num_generation_tokens if iteration_stats else 0,
                    batch_depth=running, queue_length=scheduler_stats.num_waiting_reqs, step_s=step_s,
                    verify_s=0.0)
                totals.add(stats)
                observer(stats)

            def log_engine_initialized(self) -> None:
                pass

        class SilentPrometheus(PrometheusStatLogger):  # type: ignore[misc]
            """Stands in for vLLM's Prometheus logger, so vLLM registers no series of its own."""

            def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
                pass

            def record(self, *args: Any, **kwargs: Any) -> None:
                pass

            def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
                pass

            def log_engine_initialized(self) -> None:
                pass

        self._llm = AsyncLLM(vllm_config=vllm_config, executor_class=Executor.get_class(vllm_config),
                             log_requests=False, log_stats=True, stat_loggers=[StepStatsLogger, SilentPrometheus])
        model_config = vllm_config.model_config
        import vllm

        # Chains only (tree_max_nodes 0, the gateway prices it so): vLLM's token trees are an
        # engine-wide static tree for EAGLE drafts (speculative_token_tree, where a release has
        # it), never per request, and not for draft_model, the method this worker runs.
        self._info = EngineInfo(
            kind="vllm", max_k=s.max_k if speculative else 0, max_slots=s.max_slots, tree_max_nodes=0,
            context_window=model_config.max_model_len, vocab_size=model_config.get_vocab_size(),
            eos_token_ids=_eos_ids(s.target),
            methods=(("eagle3",) if s.eagle3 is not None else ("draft",)) if speculative else (),
            prefix_cache=bool(vllm_config.cache_config.enable_prefix_caching),
            details={"precision": {"target": str(model_config.dtype).removeprefix("torch."),
                                   "draft": str(model_config.dtype).removeprefix("torch.") if speculative else None},
                     "vllm": {"version": vllm.__version__, "scheduler_cls": scheduler.scheduler_cls,
                              "async_scheduling": bool(scheduler.async_scheduling)}})
        log.info("vLLM %s engine ready: %s", vllm.__version__, self._info)

    async def stop(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()

    def set_batch_thresholds(self, max_batch: int, batch_resume: int, max_step_drafts: int = 0,
                             cost_rule: bool = False) -> None:
        # The scheduler plugin applies the batch latch only; it does not implement the per-step
        # draft limit (max_step_drafts) or the cost rule yet, so vLLM workers draft the requested
        # K at any depth below max_batch.
        self._max_batch, self._batch_resume = max_batch, batch_resume

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[StepEvent, None]:
        from specgate_vllm.rules import BATCH_RESUME_ARG, MAX_BATCH_ARG, SPEC_K_ARG
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        p = request.params
        window = self.info.context_window
        if len(request.prompt_ids) + request.max_tokens > window:
            raise EngineRequestError(f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.max_tokens}) "
                                     f"exceeds the context window of {window} tokens")
        try:
            sampling = SamplingParams(
                temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed, max_tokens=request.max_tokens,
                ignore_eos=p.ignore_eos, min_tokens=p.min_tokens,
                detokenize=False, output_kind=RequestOutputKind.DELTA,
                extra_args={SPEC_K_ARG: request.k, MAX_BATCH_ARG: self._max_batch,
                            BATCH_RESUME_ARG: self._batch_resume})
        except ValueError as exc:  # vLLM's own parameter checks
            raise EngineRequestError(str(exc)) from None
        eos_ids = self.info.eos_token_ids
        self._in_flight += 1
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids))
        if request.cache_scope:  # vLLM's prefix caching keys the first block by the salt
            prompt["cache_salt"] = request.cache_scope
        outputs = self._llm.generate(prompt, sampling, request.request_id)
        first = True
        try:
            async for output in outputs:
                completion = output.outputs[0]
                # vLLM's prefix cache hit, known once the request is scheduled: on the first event.
                cached = output.num_cached_tokens if first else None
                first = False
                tokens = list(completion.token_ids)
                finish: FinishReason | None = None
                eos = False
                if output.finished:
                    if completion.finish_reason == "abort":
                        raise RuntimeError("vLLM aborted the request")
                    finish = "length" if completion.finish_reason == "length" else "stop"
                    if finish == "stop" and tokens and tokens[-1] in eos_ids:
                        tokens.pop()  # the EOS token is not output, as with the embedded engine
                        eos = True
                late = late_steps(completion.spec_decode_metrics) if output.finished else ()
                yield StepEvent(request.request_id, tokens, 0, 0, self.batch_depth, finish, late, eos=eos,
                                cached_tokens=cached)
                if finish is not None:
                    return
        finally:
            self._in_flight -= 1
            await outputs.aclose()  # aborts the request in vLLM if it has not finished
            if self._in_flight == 0 and self._observer is not None:
                # vLLM's stats stop with its last step: report the empty batch for the gauges.
                self._observer(StepStats(0, 0, 0, 0, 0, 0.0, 0.0))
