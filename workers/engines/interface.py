"""The one interface every worker engine implements, and the types that cross it. No torch.

A worker's HTTP server, protocol and metrics (``workers/server/app.py``) drive any engine through
``Engine``: the embedded PyTorch engine (``workers/engines/embedded/adapter.py``), vLLM's ``AsyncLLM``
with specgate's scheduler plugin (``workers/engines/vllm.py``), or the simulated GPU engine.
The shape follows vLLM's own ``AsyncLLM.generate``: a request in, an async stream of per-step
deltas out, cancelled by closing the stream. Engines speak token ids only; text, stop strings
and usage are the server's, so every engine answers the same request the same way.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from policies.methods import Method
from policies.tree import StepPath, TreeShape
from workers.api.generation import SamplingParams, ShadowSteps, SpecSteps
from workers.costs.cost_report import CostReport

FinishReason = Literal["stop", "length", "abort"]
EngineKind = Literal["embedded", "vllm", "sim"]


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    k: int = 0  # requested speculation depth; 0 = plain
    # A resumed generation (mid-stream migration): the last ``resumed_tokens`` of ``prompt_ids``
    # are output another worker generated. An engine that can computes them as decoding did, not
    # as prompt, so a greedy or seeded continuation is exactly the undisturbed run's.
    resumed_tokens: int = 0
    # Speculate with this token tree instead of a chain of ``k`` (then ``k`` == its depth); an
    # engine that serves chains only runs the chain of that depth (``Engine.tree_shapes``).
    tree: TreeShape | None = None
    # Where the proposals come from (policies/methods.py): the draft model, or a lookup method an
    # engine that offers it runs instead (``EngineInfo.methods``; one that does not runs the draft).
    method: Method = "draft"
    # The X-Session-ID the worker got (behind the gateway, the digest of the client's key and id):
    # whose earlier prompts the suffix method may match.
    session: str | None = None
    # The cache scope (the request's cache_salt; behind the gateway, the digest of its tenant and
    # salt): prefix-cache blocks and lookup documents are shared within a scope only. "": the default.
    cache_scope: str = ""


@dataclass(frozen=True)
class StepEvent:
    """What one engine step did for one sequence."""

    request_id: str
    tokens: list[int]  # emitted this step (EOS excluded)
    proposed: int  # drafts proposed this step (= K used)
    accepted: int  # drafts accepted this step
    batch_depth: int  # running sequences in this step
    finish_reason: FinishReason | None = None
    # Acceptance of earlier steps that the engine reports late (see SpecSteps); the per-step
    # proposed/accepted above are then 0.
    late_steps: tuple[SpecSteps, ...] = ()
    # The step ended on an EOS token: generated, so usage counts it (as vLLM does), but never
    # part of ``tokens`` or the text.
    eos: bool = False
    # This sequence failed alone (its sampling or its row of a forward raised): it is dropped,
    # its slot freed, and the rest of the batch goes on.
    error: Exception | None = None
    # A tree step: the tree drafted and the rank accepted at each level tested (policies.tree.StepPath).
    path: StepPath | None = None
    # The prompt tokens the engine found in its prefix cache and did not prefill, on a request's
    # first event; None from engines that do not report it (the usage then leaves it out).
    cached_tokens: int | None = None
    # A request's last event: what each lookup method it did not run would have done on its
    # output, where the engine can replay that exactly (docs/methods.md "Shadow evidence").
    shadow: tuple[ShadowSteps, ...] = ()


class EngineRequestError(ValueError):
    """The request cannot run (too long, bad token ids): the client's fault, a 400."""


@dataclass(frozen=True)
class StepStats:
    """One engine step, worker-wide: what the metrics record. A report with ``step_s`` 0 and
    nothing proposed or emitted only refreshes the gauges (the engine went idle)."""

    proposed: int  # drafts proposed across the batch
    accepted: int
    emitted: int  # tokens emitted across the batch
    batch_depth: int  # running sequences
    queue_length: int  # waiting sequences
    step_s: float  # wall time of the step (0 when the engine does not time its steps)
    verify_s: float  # of which the target's verification forward
    prefix_cache_bytes: int | None = None  # what the engine's prefix cache holds; None: it keeps none


@dataclass
class EngineTotals:
    """Counters since the engine started (``/specgate/worker``)."""

    steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    verification_s_total: float = 0.0

    def add(self, stats: StepStats) -> None:
        self.steps += 1
        self.draft_tokens += stats.proposed
        self.accepted_tokens += stats.accepted
        self.emitted_tokens += stats.emitted
        self.verification_s_total += stats.verify_s


StepObserver = Callable[[StepStats], None]


@dataclass(frozen=True)
class EngineInfo:
    """What an engine is; fixed once it has started."""

    kind: EngineKind
    max_k: int  # deepest speculation it runs; 0: plain only
    max_slots: int  # sequences batched together
    context_window: int  # prompt + output tokens a request may use
    vocab_size: int
    eos_token_ids: frozenset[int]
    # The most draft nodes of a token tree it verifies in one step (policies.tree); 0: chains only.
    tree_max_nodes: int = 0
    # The speculation methods it runs (policies/methods.py); () for a plain-only engine.
    methods: tuple[Method, ...] = ()
    # Its requests' last events carry shadow evidence (``StepEvent.shadow``) for the lookup methods
    # they did not run, at T=0 at least: the gateway need not explore those methods to learn them.
    shadow_lookup: bool = False
    # Whether it keeps prompt K/V for later requests (and reports ``StepEvent.cached_tokens``):
    # the gateway places no session by prefix on a worker that keeps none. None: unknown.
    prefix_cache: bool | None = None
    # Engine-specific (precision, vLLM version, the sim's model and its live step lateness, ...).
    details: Mapping[str, Any] = field(default_factory=dict)


class Engine(Protocol):
    """A draft+target engine behind a worker. Methods are called on the worker's event loop."""

    @property
    def info(self) -> EngineInfo: ...

    @property
    def batch_depth(self) -> int:
        """Sequences running now."""
        ...

    @property
    def queue_length(self) -> int:
        """Sequences waiting for a batch slot."""
        ...

    @property
    def batch_full(self) -> bool:
        """The per-step batch latch: steps run plain while it is set."""
        ...

    @property
    def totals(self) -> EngineTotals: ...

    async def start(self, observer: StepObserver) -> None:
        """Loads models and starts serving; ``observer`` hears every step, possibly from the
        engine's compute thread, so it must be cheap and thread-safe (metrics are)."""

    async def stop(self) -> None: ...

    @property
    def cost_model(self) -> CostReport | None:
        """What a step costs by batch depth and K, live (``workers/costs/cost_report.py``); None while
        the engine cannot tell yet. ``/specgate/worker`` publishes it as ``cost_model``."""
        ...

    def set_batch_thresholds(self, max_batch: int, batch_resume: int, max_step_drafts: int = 0,
                             cost_rule: bool = False) -> None:
        """The policy's batch rule (from the latest gateway directive) for the per-step latch, its
        per-step draft limit (0: none; ``policies.speculation.step_depth``), and with ``cost_rule``
        (policy K ``auto``) the cost model's per-step rule, where the engine has one
        (``policies.cost.step_k``)."""

    def generate(self, request: GenerationRequest) -> AsyncGenerator[StepEvent, None]:
        """Per-step events until one carries a finish reason; closing the stream aborts it.

        Raises ``EngineRequestError`` (the request's fault) or any other exception (the
        engine's fault, failing this request alone).
        """
        ...
