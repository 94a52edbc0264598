"""The simulated GPU engine: tokens on a GPU deployment's timing model, no model run. No torch.

One asyncio task steps the batch (``SimBatch`` in ``sim_model``, shared with bench.policy's
virtual-time fleet): it computes the step's modelled duration, sleeps until the step's end
time, then hands each sequence its tokens. Hundreds of streams cost one task and one queue
each, no threads. How late the loop wakes against the model's schedule is measured and shown
in ``/specgate/worker`` (``sim.lateness``): on a busy CPU the live system runs slower than
the model, and the benches report by how much.

Output tokens are random ids from the vocabulary outside the special ids, from a generator
seeded by the request's ``seed`` (else the config's seed and the request's arrival order), so
a seeded request's text is the same on every run. The prompt's category (``[json]``,
``[code]``, ``[math]``, ``[chat]``, ``[agent]``, ``[code_edit]``, ``[rag]``, ``[summary]`` tag),
its temperature and its speculation method (the directive's: the draft model, or a lookup method
with its own acceptance and coverage, docs/sim.md "Methods") set its acceptance.

With ``workers.sim.prefix_cache_tokens`` > 0 the worker keeps a prefix cache (``prefix_cache``):
a prompt's leading blocks that an earlier request's prompt or output left there are not
prefilled again, and the first step event reports them (``cached_tokens``, the usage's
``prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policies.methods import METHODS, Method, is_lookup, is_method
from workers.api.generation import ShadowSteps
from workers.api.sim_config import SimConfig
from workers.costs.cost_report import CostReport, depth_grid, report_from_forward_times
from workers.costs.online import StepCostRule
from workers.engines.interface import (
    EngineInfo,
    EngineRequestError,
    EngineTotals,
    GenerationRequest,
    StepEvent,
    StepObserver,
    StepStats,
)
from workers.engines.sim.prefix_cache import PrefixCache
from workers.engines.sim.roofline import SimBatch, SimSeq, StepCost, config_summary
from workers.engines.sim.shadow import SHADOW_SEED, sim_shadow
from workers.text import TextCodec

# What the sim simulates: the draft model and the lookup methods (no EAGLE-3 head: no acceptance table for one).
SIM_METHODS: tuple[Method, ...] = tuple(m for m in METHODS if m != "eagle3")

COST_CONTEXT = 1024  # cached tokens per sequence the derived cost model assumes


@dataclass(frozen=True)
class SimSettings:
    tokenizer_dir: Path  # the target model directory: vocabulary, EOS ids, and the text categories read from
    max_slots: int = 256  # sequences batched together (vLLM's max_num_seqs default)
    max_k: int = 8
    config: SimConfig = field(default_factory=SimConfig)


@dataclass
class Lateness:
    """How far behind the modelled schedule the step loop woke (seconds)."""

    steps: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    samples: list[float] = field(default_factory=list)  # the last 4096, for percentiles

    def add(self, late_s: float) -> None:
        self.steps += 1
        self.total_s += late_s
        self.max_s = max(self.max_s, late_s)
        self.samples.append(late_s)
        if len(self.samples) > 8192:
            del self.samples[:4096]

    def view(self) -> dict[str, Any]:
        ordered = sorted(self.samples)
        def pct(q: float) -> float | None:
            return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3) if ordered else None
        return {"steps": self.steps, "mean_ms": round(1000 * self.total_s / self.steps, 3) if self.steps else None,
                "p50_ms": pct(0.5), "p99_ms": pct(0.99), "max_ms": round(1000 * self.max_s, 3)}


class SimEngine:
    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        self.config = settings.config
        self.batch = SimBatch(self.config, settings.max_slots, settings.max_k)
        self.lateness = Lateness()
        self._totals = EngineTotals()
        self._cost_report: CostReport | None = None
        self._sinks: dict[str, asyncio.Queue[StepEvent]] = {}
        self._ids: dict[str, random.Random] = {}  # each request's output-token generator
        self.prefix_cache = PrefixCache(self.config.prefix_cache_tokens)
        # Per request, while the cache is on: its prompt and output so far (cached when it
        # finishes), and its cached prompt tokens until its first event reports them.
        self._tokens: dict[str, list[int]] = {}
        self._scopes: dict[str, str] = {}  # each request's cache scope (the prefix cache's blocks are per scope)
        self._cached: dict[str, int] = {}
        # Per request whose shadow evidence is exact (T=0 or seeded; shadow.py): what its replay draws from.
        self._shadows: dict[str, tuple[str, float, Method | None, int, int, random.Random]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._observer: StepObserver | None = None
        self._arrivals = 0
        self._info: EngineInfo | None = None
        self._codec: TextCodec | None = None
        self._first_id = 0

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("engine not started")
        return self._info

    @property
    def batch_depth(self) -> int:
        return len(self.batch.running)

    @property
    def queue_length(self) -> int:
        return len(self.batch.waiting)

    @property
    def batch_full(self) -> bool:
        return self.batch.batch_full

    @property
    def totals(self) -> EngineTotals:
        return self._totals

    async def start(self, observer: StepObserver) -> None:
        self._observer = observer
        model_dir = self.settings.tokenizer_dir
        self._codec = TextCodec.from_model_dir(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        eos = config.get("eos_token_id")
        eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
        specials = [i for i, t in self._codec.tokenizer.get_added_tokens_decoder().items() if t.special]
        self._first_id = max([*specials, *eos_ids, -1]) + 1  # random ids above every special id
        # A live view: the lateness figures change as the engine steps.
        details: dict[str, Any] = {**config_summary(self.config)}
        details["sim"]["lateness"] = self.lateness.view()
        if self.prefix_cache.enabled:
            details["sim"]["prefix_cache"] = self._prefix_view()
        self._details = details
        self._info = EngineInfo(kind="sim", max_k=self.batch.max_k, max_slots=self.settings.max_slots,
                                context_window=self.config.context_window,
                                vocab_size=int(config.get("vocab_size", self._codec.tokenizer.get_vocab_size())),
                                eos_token_ids=eos_ids, details=details, tree_max_nodes=self.batch_tree_nodes,
                                methods=SIM_METHODS if self.batch.max_k > 0 else (),
                                shadow_lookup=self.batch.max_k > 0, prefix_cache=self.prefix_cache.enabled)
        self._task = asyncio.create_task(self._loop(), name="sim-step-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def batch_tree_nodes(self) -> int:
        """The most tree nodes a step verifies: the config's, 0 without a draft."""
        return self.config.tree_max_nodes if self.batch.max_k > 0 else 0

    @property
    def cost_model(self) -> CostReport:
        if self._cost_report is None:
            self._cost_report = derived_cost_report(self.config, self.settings.max_k, self.settings.max_slots)
        return self._cost_report

    def set_batch_thresholds(self, max_batch: int, batch_resume: int, max_step_drafts: int = 0,
                             cost_rule: bool = False) -> None:
        self.batch.max_batch, self.batch.batch_resume = max_batch, batch_resume
        self.batch.max_step_drafts = max_step_drafts
        # K auto: each step's K also cut to the best at its mix, on the published costs.
        if not cost_rule:
            self.batch.cost_rule = None
        elif self.batch.cost_rule is None:
            self.batch.cost_rule = StepCostRule(self.cost_model.policy_model())

    def _seq(self, request: GenerationRequest) -> SimSeq:
        assert self._codec is not None
        if request.max_tokens < 1 or len(request.prompt_ids) + request.max_tokens > self.config.context_window:
            raise EngineRequestError("prompt + max_tokens exceed the context window")
        table = self.config.acceptance
        category = table.category(self._codec.decode(request.prompt_ids))
        self._arrivals += 1
        seed = request.params.seed if request.params.seed is not None else self.config.seed * 1_000_003 + self._arrivals
        self._ids[request.request_id] = random.Random(seed)
        method = request.method
        if not is_method(method):
            raise EngineRequestError(f"unknown speculation method {method!r}")
        temperature = request.params.temperature
        cached = 0
        if self.prefix_cache.enabled:
            cached = self.prefix_cache.lookup(request.prompt_ids, request.cache_scope)
            self._tokens[request.request_id] = list(request.prompt_ids)
            self._scopes[request.request_id] = request.cache_scope
            self._cached[request.request_id] = cached
            self._details["sim"]["prefix_cache"] = self._prefix_view()
        # The cached tokens are KV the step reads, never prefilled: prefill is charged for the rest.
        prefill = len(request.prompt_ids) - cached
        if self.batch.max_k > 0 and (temperature <= 0.0 or request.params.seed is not None):
            self._shadows[request.request_id] = (category, temperature, method if request.k > 0 else None,
                                                 request.k or self.batch.max_k, request.max_tokens,
                                                 random.Random(seed ^ SHADOW_SEED))
        if is_lookup(method):
            alpha, coverage = table.lookup_alpha(method, category, temperature)
            return SimSeq(request.request_id, request.k, alpha, request.max_tokens, prefill,
                          random.Random(seed ^ 0x5EED), context=cached, lookup=True, coverage=coverage)
        # A tree's K is its depth (SimSeq); one this deployment does not verify runs as that chain (SimBatch.add).
        return SimSeq(request.request_id, request.k, table.alpha(category, temperature),
                      request.max_tokens, prefill, random.Random(seed ^ 0x5EED), context=cached, tree=request.tree)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[StepEvent, None]:
        seq = self._seq(request)
        events: asyncio.Queue[StepEvent] = asyncio.Queue()
        self._sinks[request.request_id] = events
        self.batch.add(seq)
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await events.get()
                finished = item.finish_reason is not None
                yield item
        finally:
            self._sinks.pop(request.request_id, None)
            self._ids.pop(request.request_id, None)
            self._tokens.pop(request.request_id, None)
            self._scopes.pop(request.request_id, None)
            self._cached.pop(request.request_id, None)
            self._shadows.pop(request.request_id, None)
            if not finished:
                self.batch.abort(request.request_id)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        scale = self.config.time_scale
        vocab_hi = self.info.vocab_size - 1
        while True:
            if not self.batch.has_work:
                self._wake.clear()
                await self._wake.wait()
            started = loop.time()
            step = self.batch.step()
            if step is None:
                continue
            if scale > 0:
                deadline = started + step.duration_s * scale
                await asyncio.sleep(max(0.0, deadline - loop.time()))
                self.lateness.add(max(0.0, loop.time() - deadline))
                if self.lateness.steps % 64 == 0:
                    self._details["sim"]["lateness"] = self.lateness.view()
            else:
                await asyncio.sleep(0)  # answers at once, but lets the server write between steps
            proposed = accepted = emitted = 0
            for r in step.results:
                rid = r.seq.request_id
                ids = self._ids.get(rid)
                sink = self._sinks.get(rid)
                if ids is None or sink is None:  # aborted while the step ran
                    continue
                tokens = [ids.randint(self._first_id, vocab_hi) for _ in range(r.emitted)]
                proposed, accepted, emitted = proposed + r.k, accepted + r.accepted, emitted + r.emitted
                cached = self._cached.pop(rid, None)
                if self.prefix_cache.enabled:
                    self._remember(rid, tokens, first=cached is not None, finished=r.finished)
                shadow = self._shadow(rid) if r.finished else ()
                sink.put_nowait(StepEvent(rid, tokens, r.k, r.accepted, step.depth,
                                          "length" if r.finished else None, path=r.path, cached_tokens=cached,
                                          shadow=shadow))
            stats = StepStats(proposed, accepted, emitted, step.depth, len(self.batch.waiting),
                              step.duration_s * scale, step.verify_s * scale)
            self._totals.add(stats)
            if self._observer is not None:
                self._observer(stats)

    def _shadow(self, rid: str) -> tuple[ShadowSteps, ...]:
        """A finished request's shadow evidence (shadow.py); () where it would not be exact."""
        facts = self._shadows.pop(rid, None)
        if facts is None:
            return ()
        category, temperature, ran, k, output_tokens, rng = facts
        ran = ran if ran is not None and is_lookup(ran) else None
        return sim_shadow(self.config.acceptance, category, temperature, ran, k, output_tokens, rng)

    def _remember(self, rid: str, tokens: list[int], first: bool, finished: bool) -> None:
        """The prefix cache learns a prompt once its prefill step ran (a concurrent request with
        the same system prompt hits it, as in vLLM), and the prompt with its output at the end."""
        held = self._tokens.get(rid)
        if held is None:
            return
        scope = self._scopes.get(rid, "")
        if first:
            self.prefix_cache.insert(held, scope)
        held.extend(tokens)
        if finished:
            self.prefix_cache.insert(held, scope)
            self._details["sim"]["prefix_cache"] = self._prefix_view()

    def _prefix_view(self) -> dict[str, int | float]:
        return self.prefix_cache.view(self.config.target.kv_bytes_per_token)


def derived_cost_report(config: SimConfig, max_k: int, max_slots: int) -> CostReport:
    """The sim's published cost model, derived from its own roofline, not measured: a step of
    every sequence at ``COST_CONTEXT`` cached tokens, for the batch depths a worker would
    measure. The virtual-time fleet (bench/fleet_sim.py) gives the policy the same one."""
    cost = StepCost(config)
    depths = depth_grid(max_slots)
    target_s = [[cost.forward(config.target, d * n, d * COST_CONTEXT) for n in range(1, max_k + 2)]
                for d in depths]
    draft_s = [cost.forward(config.draft, d, d * COST_CONTEXT) if config.draft is not None else 0.0 for d in depths]
    # The step's time outside its forwards, as the model has it: a whole modelled step less its
    # forwards (0 today: the model's fixed overhead is per forward, already in the forward
    # times; this follows the model if it grows a per-step term).
    contexts = [[COST_CONTEXT] * d for d in depths]
    overhead_s = [cost.step_time([0] * d, ctx)[0] - t[0] for d, ctx, t in zip(depths, contexts, target_s, strict=True)]
    draft_overhead_s = [(cost.step_time([max_k] * d, ctx)[0] - t[max_k] - max_k * dr - o) / max_k
                        if max_k and config.draft is not None else 0.0
                        for d, ctx, t, dr, o in zip(depths, contexts, target_s, draft_s, overhead_s, strict=True)]
    return report_from_forward_times(depths, target_s, draft_s, source="derived", overhead_s=overhead_s,
                                     draft_overhead_s=draft_overhead_s, **tree_costs(config, max_k))


def tree_costs(config: SimConfig, max_k: int) -> dict[str, tuple[float, ...] | None]:
    """The published tree curves, at batch depth 1 and ``COST_CONTEXT`` cached tokens, relative
    to a plain step there (``plain_step_ms[0]``): ``tree_verify_cost[n-1]``, the target's forward
    of one row of n = 1..T tokens (T = tree_max_nodes + 1: the root and every node), and
    ``tree_draft_cost[n-1]``, one draft forward over n = 1..tree_max_nodes tokens (a level). The
    roofline's, as the chain's curves are: a row of n tree tokens costs what n chain tokens do
    (docs/sim.md, "Token trees"). None for both where the deployment runs chains only."""
    nodes = config.tree_max_nodes
    if nodes <= 0 or max_k <= 0 or config.draft is None:
        return {"tree_verify_cost": None, "tree_draft_cost": None}
    cost = StepCost(config)
    plain = cost.forward(config.target, 1, COST_CONTEXT)
    verify = tuple(round(cost.forward(config.target, n, COST_CONTEXT) / plain, 4) for n in range(1, nodes + 2))
    draft = tuple(round(cost.forward(config.draft, n, COST_CONTEXT) / plain, 4) for n in range(1, nodes + 1))
    return {"tree_verify_cost": verify, "tree_draft_cost": draft}
