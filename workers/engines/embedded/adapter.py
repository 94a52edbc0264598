"""The embedded PyTorch engine (``workers/engines/embedded/engine.py``) behind the worker's engine interface.

The model steps run on the runner's compute thread (``workers/engines/embedded/runner.py``); this adapter turns
its per-step callbacks into the async event stream ``Engine.generate`` promises.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from policies.methods import METHODS, Method
from workers.costs.cost_report import CostReport
from workers.costs.online import OnlineCosts
from workers.engines.embedded.eagle3.costs import head_costs
from workers.engines.embedded.eagle3.head import Eagle3Head
from workers.engines.embedded.engine import SpeculativeEngine
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.lookup.ngram import DEFAULT_PROMPT_LOOKUP_MAX, DEFAULT_PROMPT_LOOKUP_MIN
from workers.engines.embedded.lookup.proposer import LookupSettings
from workers.engines.embedded.lookup.suffix import DEFAULT_MAX_BYTES
from workers.engines.embedded.measurement.measure import measure_or_load
from workers.engines.embedded.measurement.precision import torch_threads_serving
from workers.engines.embedded.measurement.settings import MeasureSettings
from workers.engines.embedded.memory import return_freed_heap
from workers.engines.embedded.projections import TORCH_DTYPES, Products, products_named, resolve_dtype
from workers.engines.embedded.quantized import TargetDtype, load_target
from workers.engines.embedded.runner import EngineRunner
from workers.engines.interface import (
    EngineInfo,
    EngineRequestError,
    EngineTotals,
    GenerationRequest,
    StepEvent,
    StepObserver,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedSettings:
    target: Path
    draft: Path | None
    max_slots: int = 16  # sequences batched together
    max_k: int = 8  # deepest speculation this worker runs
    # The target's. "auto": chosen by measurement at start-up (measurement/measure.py) among
    # bfloat16, float32 and, where make install laid them out, the GGUF's q4_1 blocks (quantized.py).
    dtype: Literal["auto", "float32", "bfloat16", "q4_1"] = "auto"
    # The draft's: float32 by default, because for a model this small bfloat16's upcasts around
    # every norm cost more than its cheaper matmuls save; its numerics never reach the output.
    draft_dtype: Literal["float32", "bfloat16"] = "float32"
    # "auto" picks among configurations whose verification is bit-identical to plain decoding
    # (checked at start-up); False admits faster ones that are only close.
    exact: bool = True
    cost_cache_dir: Path | None = None  # None: ~/.cache/specgate/costs (workers/costs/cache.py)
    cost_budget_s: float = 4.0  # start-up measurement's time budget (a cache hit skips it)
    max_model_len: int | None = None  # longest sequence (prompt + generation + K) a slot holds; None: the model's
    # Lookup methods (lookup/proposer.py; checked there, LookupSettingsError names the field).
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN  # ngram: the shortest n-gram matched (vLLM's name)
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX  # ngram: the longest, tried first
    suffix_cache_bytes: int = DEFAULT_MAX_BYTES  # suffix: the worker's store's memory bound
    prefix_cache_bytes: int = 0  # prompt K/V kept for reuse (prefix_cache.py); 0: none
    eagle3: Path | None = None  # an EAGLE-3 head in speculators' format (method eagle3); None: none

    def __post_init__(self) -> None:
        _ = self.lookup  # checked when the worker starts, not at the first request

    @property
    def lookup(self) -> LookupSettings:
        return LookupSettings(self.prompt_lookup_min, self.prompt_lookup_max, self.suffix_cache_bytes)


def load_speculative_engine(settings: EmbeddedSettings, target: LlamaForCausalLM | None = None,
                            packed: bool = True, products: Products = "float32") -> SpeculativeEngine:
    """The engine with ``settings.dtype`` as given ("auto": by CPU flags, ``resolve_dtype``; "q4_1":
    from the GGUF's blocks);
    a worker passes the dtype, packing and products its cost measurement chose, and the target
    it loaded to measure (``EmbeddedEngine.start``)."""
    if target is None:
        dtype = settings.dtype if settings.dtype == "q4_1" else resolve_dtype(settings.dtype)
        target = load_target(settings.target, dtype, packed, products)
    draft = None
    if settings.draft is not None:
        draft = LlamaForCausalLM.load_draft(settings.draft, TORCH_DTYPES[settings.draft_dtype], products,
                                            target=settings.target)
    if settings.dtype == "bfloat16" and not target.prepacked:
        log.warning("bfloat16 target without oneDNN prepacking on this CPU (no AVX512-BF16/AMX?): expect slow "
                    "steps and no bit-identical verification; workers.dtype: auto picks float32 here")
    # Served from their laid-out copies only: the source weights would double the projections' memory.
    freed = target.release_sources() + (draft.release_sources() if draft is not None else 0)
    log.info("released %.0f MiB of projection weights the kernels hold laid out", freed / 2**20)
    positions = min(target.cfg.max_position_embeddings, settings.max_model_len or target.cfg.max_position_embeddings)
    eagle = None
    if settings.eagle3 is not None:  # HeadFormatError (a ValueError) names the field that does not fit
        eagle = Eagle3Head.load(settings.eagle3, target.cfg, target.embed_rows,
                                settings.max_slots, positions)
    return SpeculativeEngine(target, draft, max_slots=settings.max_slots, max_k=settings.max_k,
                             max_positions=settings.max_model_len, lookup=settings.lookup,
                             prefix_cache_bytes=settings.prefix_cache_bytes, eagle=eagle)


def offered_methods(engine: SpeculativeEngine) -> tuple[Method, ...]:
    """What the engine proposes with: the draft model and the head where loaded, the lookup methods
    wherever it speculates at all."""
    if engine.max_k <= 0:
        return ()
    offered = {"draft": engine.draft is not None, "eagle3": engine.eagle is not None, "ngram": True, "suffix": True}
    return tuple(m for m in METHODS if offered[m])


class EmbeddedEngine:
    def __init__(self, settings: EmbeddedSettings) -> None:
        self.settings = settings
        self._runner: EngineRunner | None = None
        self._info: EngineInfo | None = None
        self._costs: OnlineCosts | None = None

    @property
    def runner(self) -> EngineRunner:
        if self._runner is None:
            raise RuntimeError("engine not started")
        return self._runner

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("engine not started")
        return self._info

    @property
    def batch_depth(self) -> int:
        return self.runner.batch_depth

    @property
    def queue_length(self) -> int:
        return self.runner.queue_length

    @property
    def batch_full(self) -> bool:
        return self.runner.batch_full

    @property
    def totals(self) -> EngineTotals:
        return self.runner.stats

    @property
    def cost_model(self) -> CostReport | None:
        return None if self._costs is None else self._costs.report()

    async def start(self, observer: StepObserver) -> None:
        s = self.settings
        # Measured (or read from the cache) before the worker answers its first health check.
        threads = torch.get_num_threads()  # workers.threads: the kernels' threads, and torch's while measuring
        rowgemm.set_threads(threads)
        measuring = MeasureSettings(s.target, s.draft, s.max_slots, s.max_k, s.dtype, s.draft_dtype, s.exact,
                                    s.cost_budget_s, threads)
        report, target = measure_or_load(measuring, s.cost_cache_dir)
        precision = report.precision
        assert precision is not None
        torch.set_num_threads(torch_threads_serving(precision, threads))
        dtype: TargetDtype = ("bfloat16" if precision.target == "bfloat16" else "q4_1" if precision.target == "q4_1"
                              else "float32")
        engine = load_speculative_engine(dataclasses.replace(s, dtype=dtype), target, precision.prepacked,
                                         products_named(precision.products))
        return_freed_heap()
        if engine.eagle is not None:  # the head's forwards, timed as the draft's were (a few ms; not cached)
            report = dataclasses.replace(report, **head_costs(engine.eagle, report))
        self._costs = OnlineCosts(report)
        self._runner = EngineRunner(engine, asyncio.get_running_loop(), observer, self._costs)
        self._runner.start()
        self._info = EngineInfo(
            kind="embedded", max_k=engine.max_k, max_slots=engine.max_slots,
            context_window=engine.max_positions, vocab_size=engine.target.cfg.vocab_size,
            eos_token_ids=engine.eos_ids, tree_max_nodes=engine.max_tree_nodes,
            methods=offered_methods(engine),
            shadow_lookup=engine.lookup is not None, prefix_cache=engine.prefix is not None,
            details={"precision": {"target": dtype, "draft": s.draft_dtype if engine.draft else None,
                                   "target_prepacked": engine.target.prepacked,
                                   "products": engine.target.products,
                                   "draft_products": engine.draft.products if engine.draft else None,
                                   "exact": precision.exact, "why": precision.why,
                                   # the kernels' build, chosen by measurement on this machine
                                   "kernels": rowgemm.chosen_build()}})

    async def stop(self) -> None:
        if self._runner is not None:
            self._runner.stop()

    def set_batch_thresholds(self, max_batch: int, batch_resume: int, max_step_drafts: int = 0,
                             cost_rule: bool = False) -> None:
        self.runner.set_batch_thresholds(max_batch, batch_resume, max_step_drafts, cost_rule)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[StepEvent, None]:
        events: asyncio.Queue[StepEvent | BaseException] = asyncio.Queue()
        runner = self.runner
        runner.submit(request, events.put_nowait)
        finished = False
        try:
            while not finished:
                item = await events.get()
                if isinstance(item, ValueError):
                    raise EngineRequestError(str(item))
                if isinstance(item, BaseException):
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            if not finished:
                runner.abort(request.request_id)
