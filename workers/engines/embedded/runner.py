"""Bridges the engine's compute loop (one thread) and the worker's asyncio event loop.

The compute loop is the one place specgate uses a thread: a model step holds the CPU for
milliseconds and must not block the event loop that streams tokens out. Commands (add,
abort) go in through a queue the loop drains between steps, so the engine itself is only
ever touched by its thread; step events come back through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from policies.cost import catch_up_pays
from policies.speculation import step_depth
from workers.costs.cost_report import CostReport
from workers.costs.online import OnlineCosts, StepCostRule
from workers.engines.embedded.engine import SpeculativeEngine
from workers.engines.embedded.step_interface import ORDINARY_LAG
from workers.engines.interface import EngineTotals, GenerationRequest, StepEvent, StepObserver, StepStats

log = logging.getLogger(__name__)
# Steps between rebuilds of the per-step rule's cost model from the online curves: they move
# slowly (workers/costs/cost_report.py), and the rule runs every step.
COST_TABLE_STEPS = 32

EventSink = Callable[[StepEvent | BaseException], None]


def fold_step(costs: OnlineCosts, engine: SpeculativeEngine, events: list[StepEvent], step_s: float) -> None:
    """The engine's last step into the online cost model (``step_s``: the whole step, the
    caller's work after it included): its timings, a prompt prefilled alone (what a request's
    prediction prices), and the drafts tested."""
    shape = engine.last_shape
    # The model's target costs are per (depth, tokens per row); a step whose rows differ in
    # length (some verifying K + 1 tokens, others one) is priced from them by interpolation
    # (policies.cost's mixed pricing), so it refines none of them. Where the one-call forward
    # does not serve (F.linear, oneDNN), rows are padded to the widest, which such a step prices.
    ragged = shape.target_tokens < shape.target_rows * shape.target_width and engine.target.fused is not None
    # A tree step's forwards are priced by the start-up tree curves, not refined online.
    costs.observe_step(shape.target_rows, shape.target_width,
                       0.0 if shape.prefill or ragged or shape.tree else engine.last_target_s,
                       shape.draft_rows, shape.draft_forwards, 0.0 if shape.tree else engine.last_draft_s,
                       step_s=0.0 if shape.tree else step_s, drafts=shape.drafts,
                       catch_up=shape.catch_up > ORDINARY_LAG)
    if shape.prefill and shape.target_rows == 1:
        costs.observe_prefill(shape.target_width, engine.last_target_s)
    for event in events:
        if event.path is not None:  # a tree: its rank-1 children are what α means (policies/tree.py)
            for _, rank, accepted in event.path.tests():
                if rank == 1:  # one test each: a tree's rank-1 outcomes are not a chain's prefix
                    costs.observe_drafts(1, int(accepted))
        else:
            costs.observe_drafts(event.proposed, event.accepted)


@dataclass(frozen=True)
class _Add:
    request: GenerationRequest
    sink: EventSink


@dataclass(frozen=True)
class _Abort:
    request_id: str


class EngineRunner:
    def __init__(self, engine: SpeculativeEngine, loop: asyncio.AbstractEventLoop,
                 on_step: StepObserver | None = None, costs: OnlineCosts | None = None) -> None:
        self.engine = engine
        self.loop = loop
        self.on_step = on_step
        self.stats = EngineTotals()
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._sinks: dict[str, EventSink] = {}
        self._pending_adds = 0
        self._thread = threading.Thread(target=self._loop, name="engine-compute", daemon=True)
        # The per-step batch rule (policy.step_depth) with the thresholds of the latest request.
        self._max_batch = 1 << 20
        self._batch_resume = 1 << 20
        self._batch_full = False
        self._max_step_drafts = 0
        # The cost rule (policy num_speculative_tokens: auto, from the latest directive): every
        # drafting sequence of a step drafts the best K for the step's depth and mix, 0 where the
        # measured costs say speculation loses (policies.cost.batch_step_k).
        self.costs = costs
        self._cost_rule = False
        self._step_costs: StepCostRule | None = None
        self._step_report: CostReport | None = None
        self._cost_table_age = COST_TABLE_STEPS
        # This loop's own per-step work after the engine's step (accounting, handing events to
        # the event loop): part of a step's cost outside the forwards, so it is added to the
        # next step's observed time (the engine cannot time it).
        self._tail_s = 0.0
        engine.step_depth_rule = self._step_depth
        engine.step_cost_rule = self._step_cost
        engine.catch_up_rule = self._catch_up

    @property
    def batch_depth(self) -> int:
        return self.engine.batch_depth

    @property
    def queue_length(self) -> int:
        return self.engine.queue_length + self._pending_adds

    @property
    def batch_full(self) -> bool:
        return self._batch_full

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=10)

    def set_batch_thresholds(self, max_batch: int, batch_resume: int, max_step_drafts: int = 0,
                             cost_rule: bool = False) -> None:
        self._max_batch, self._batch_resume, self._max_step_drafts = max_batch, batch_resume, max_step_drafts
        self._cost_rule = cost_rule

    def submit(self, request: GenerationRequest, sink: EventSink) -> None:
        """Called on the event loop; events arrive at ``sink`` on the event loop."""
        self._pending_adds += 1
        self._commands.put(_Add(request, sink))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def _step_depth(self, requested_k: int, batch_depth: int) -> int:
        decision = step_depth(requested_k, batch_depth, self._batch_full, self._max_batch, self._batch_resume,
                              self._max_step_drafts)
        self._batch_full = decision.batch_full
        return decision.k

    def _step_cost(self, requested: list[int]) -> int | None:
        """One K for the step's drafting sequences under the cost rule; None (each keeps its own
        K, as a fixed num_speculative_tokens asks) while the rule is off or the worker's
        acceptance has too little evidence behind it, as the sim engine's batch does."""
        alpha = self._rule_alpha()
        return None if alpha is None else self._cost_rule_now().k(requested, alpha)

    def _catch_up(self, lag: int, remaining: int, k: int, depth: int) -> bool:
        """Under the cost rule, whether a sequence that decoded ``lag`` tokens plain should catch
        its draft up and draft now (policies.cost.catch_up_pays); True without the rule."""
        alpha = self._rule_alpha()
        if alpha is None:
            return True
        rule = self._cost_rule_now()
        assert self._step_report is not None
        return catch_up_pays(rule.model, alpha, k, depth, remaining, *self._step_report.catch_up_prices(lag, depth))

    def _rule_alpha(self) -> float | None:
        """The worker's acceptance estimate, while the cost rule is on and has the evidence."""
        if not self._cost_rule or self.costs is None:
            return None
        return self.costs.acceptance.evidenced

    def _cost_rule_now(self) -> StepCostRule:
        """The step rule and the report it was built from, rebuilt every COST_TABLE_STEPS steps."""
        assert self.costs is not None
        if self._step_costs is None:
            self._step_report = self.costs.report()
            self._step_costs = StepCostRule(self._step_report.policy_model())
        return self._step_costs

    # -- compute thread ---------------------------------------------------------------------------
    def _deliver(self, request_id: str, item: StepEvent | BaseException) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None:
            self.loop.call_soon_threadsafe(sink, item)

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Add):
            self.loop.call_soon_threadsafe(self._added)
            try:
                self.engine.add(command.request)
            except ValueError as exc:
                self.loop.call_soon_threadsafe(command.sink, exc)
                return
            self._sinks[command.request.request_id] = command.sink
        else:
            self.engine.abort(command.request_id)
            self._sinks.pop(command.request_id, None)

    def _added(self) -> None:
        self._pending_adds -= 1

    def _loop(self) -> None:
        while True:
            commands: list[_Add | _Abort | None] = []
            if not self.engine.has_work:
                commands.append(self._commands.get())  # idle: sleep until there is something to do
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if command is None:
                    return
                self._apply(command)
            if not self.engine.has_work:
                self._went_idle()
                continue
            try:
                events = self.engine.step()
                stepped = time.perf_counter()
            except Exception as exc:  # outside any one sequence's work (a bug): fail what is in flight
                log.exception("engine step failed")
                for request_id in list(self._sinks):
                    self._deliver(request_id, exc)
                    self.engine.abort(request_id)
                self._sinks.clear()
                self._went_idle()
                continue
            self._account(events)
            for event in events:
                if event.error is not None:  # this sequence alone failed; the engine dropped it
                    log.error("sequence %s failed: %s", event.request_id, event.error, exc_info=event.error)
                    self._deliver(event.request_id, event.error)
                    self._sinks.pop(event.request_id, None)
                    continue
                self._deliver(event.request_id, event)
                if event.finish_reason is not None:
                    self._sinks.pop(event.request_id, None)
            self._tail_s = time.perf_counter() - stepped
            if not self.engine.has_work:
                self._went_idle()

    def _went_idle(self) -> None:
        """The last sequence finished or was aborted: steps stop, so report the empty batch now.

        ``on_step`` with no events refreshes gauges (batch depth, queue length) that would
        otherwise keep the last busy step's values while the engine sleeps.
        """
        if self.on_step is not None:
            self.on_step(StepStats(0, 0, 0, self.engine.batch_depth, self.engine.queue_length, 0.0, 0.0))

    def _account(self, events: list[StepEvent]) -> None:
        engine = self.engine
        if self.costs is not None:
            fold_step(self.costs, engine, events, engine.last_step_s + self._tail_s)
            self._cost_table_age -= 1
            if self._cost_table_age <= 0:  # the curves moved: choose afresh
                self._step_costs = None
                self._cost_table_age = COST_TABLE_STEPS
        stats = StepStats(
            proposed=sum(e.proposed for e in events), accepted=sum(e.accepted for e in events),
            emitted=sum(len(e.tokens) for e in events), batch_depth=engine.batch_depth,
            queue_length=engine.queue_length, step_s=engine.last_draft_s + engine.last_target_s,
            verify_s=engine.last_target_s,
            prefix_cache_bytes=None if engine.prefix is None else engine.prefix.bytes_held)
        self.stats.add(stats)
        if self.on_step is not None:
            self.on_step(stats)
