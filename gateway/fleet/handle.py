"""One worker as the gateway sees it: where it is, what it serves, its status, and what the gateway
has in flight there; the fleet (fleet.py), its supervisor (supervisor.py) and its probe
(probe.py) each keep their part of it up to date, and admission reads it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp

from gateway.config.config import RemoteProtocol
from gateway.fleet.draft_mix import DraftMix
from gateway.fleet.worker_http import WorkerHttp
from gateway.llamacpp import PromptScopes, SlotLease, StepCosts
from gateway.scheduling.framework import Candidate
from policies import CostModel, Method, Mode, SessionState

WorkerStatus = Literal["starting", "ready", "unhealthy", "restarting", "stopped"]


@dataclass
class WorkerHandle:
    worker_id: str
    base_url: str  # http://worker for a Unix socket, the server's URL for remote workers
    client: aiohttp.ClientSession  # health polls and metrics scrapes
    http: WorkerHttp  # the relay's requests (gateway/fleet/worker_http.py)
    modes: frozenset[Mode]
    max_k: int
    socket_path: Path | None = None  # local workers only
    remote: bool = False
    # specgate: takes the directive and reports every step; vllm: a vLLM server with specgate's
    # plugin, driven through vllm_xargs; openai: any OpenAI server, serving one fixed mode;
    # llamacpp: a llama-server, one mode and method for its life (gateway/llamacpp.py).
    protocol: RemoteProtocol = "specgate"
    status: WorkerStatus = "starting"
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    # The requests the gateway has forwarded and not yet finished, by the decision each went
    # with: their count is ``in_flight``, their drafting mix what K auto prices a step at.
    draft_mix: DraftMix = field(default_factory=DraftMix)
    reported_depth: int = 0  # the worker's own running + queued count, from its last poll
    # The gateway's own in-flight count when that poll was answered: the report's share that is
    # this gateway's requests, which it tracks itself, exactly and without the poll's lag.
    in_flight_at_report: int = 0
    batch_full: bool = False  # the policy's batch latch for this worker (gateway side)
    info: dict[str, Any] = field(default_factory=dict)
    last_error: str = ""
    started_at: float = 0.0
    cost: CostModel | None = None  # its published step costs (policy K auto), from its last poll
    tree_max_nodes: int = 0  # the most token-tree nodes its engine verifies in a step (0: chains only)
    # The speculation methods its engine offers (policies/methods.py): a specgate worker's own
    # list; a worker that publishes none runs the draft model alone.
    methods: tuple[Method, ...] = ("draft",)
    shadow_lookup: bool = False  # its requests' last reports carry shadow evidence (docs/methods.md)
    # Whether it keeps prompt K/V for reuse (its info's ``prefix_cache``; None: unknown, as a
    # server that does not say): one that says it keeps none gets no session by prefix.
    prefix_cache: bool | None = None
    # Acceptance over all the worker's sessions, folded as a session's is: the α a session new
    # to it is costed at (policies.speculation.acceptance_for_k).
    acceptance: SessionState = field(default_factory=SessionState)
    cost_error: str = ""  # why its last published cost model was unusable
    cost_raw: Any = None  # the published cost model ``cost`` was parsed from
    # A llama-server's cache scopes sent so far: each request's slot and prompt reuse there.
    prompt_scopes: PromptScopes = field(default_factory=PromptScopes)
    # ...and its step times, whose cost model (``cost``) the gateway learns, since it publishes none.
    step_costs: StepCosts = field(default_factory=StepCosts)
    # JSON logs only: the tasks relaying its stdout and stderr into the gateway's log.
    output: list[asyncio.Task[None]] = field(default_factory=list)

    def lease(self, scope: str) -> SlotLease | None:
        """A llama-server's slot and prompt reuse for a request of cache ``scope``
        (``PromptScopes.lease``; ``release`` it after); None for any other protocol."""
        return self.prompt_scopes.lease(scope) if self.protocol == "llamacpp" else None

    def release(self, lease: SlotLease | None) -> None:
        """A request that held ``lease`` (``PromptScopes.lease``) left this worker."""
        if lease is not None:
            self.prompt_scopes.release(lease)

    @property
    def in_flight(self) -> int:
        return self.draft_mix.count

    @property
    def speaks_specgate(self) -> bool:
        return self.protocol == "specgate"

    @property
    def load(self) -> int:
        # A local worker's socket is private to this gateway, so the in-flight count is exact and
        # current; the worker's own report lags by a poll. A remote worker may serve other
        # clients too: what its report holds beyond this gateway's own requests at the time counts as
        # theirs. (Not the report itself: a request that just finished would count until the next
        # poll, and a session's next turn would be priced at a batch one deeper than it is.)
        if not self.remote:
            return self.in_flight
        return self.in_flight + max(0, self.reported_depth - self.in_flight_at_report)

    def candidate(self) -> Candidate:
        return Candidate(self.worker_id, self.status == "ready", self.load, self.modes, self.draft_mix.drafting,
                         self.draft_mix.lookups, self.methods, self.prefix_cache)

    def view(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id, "status": self.status, "remote": self.remote, "protocol": self.protocol,
            "engine": self.info.get("engine"), "url": self.base_url
            if self.remote else str(self.socket_path), "pid": self.process.pid if self.process else None,
            "modes": sorted(self.modes), "max_k": self.max_k, "restarts": self.restarts, "in_flight": self.in_flight,
            "batch_depth": self.info.get("batch_depth", self.in_flight), "queue_length": self.info.get("queue_length"),
            "batch_full": self.batch_full, "precision": self.info.get("precision"), "stats": self.info.get("stats"),
            "cost_model": self.info.get("cost_model"), "acceptance": self.acceptance.acceptance_estimate,
            "tree_max_nodes": self.tree_max_nodes, "methods": list(self.methods), "shadow_lookup": self.shadow_lookup,
            "prefix_cache": self.prefix_cache,
            **({"prompt_scopes": self.prompt_scopes.view(), "step_costs": self.step_costs.view()}
               if self.protocol == "llamacpp" else {}),
            "acceptance_by_method": {s.method: s.acceptance_estimate for s in self.acceptance.lookups},
            "draft_mix": self.draft_mix.view(),
            "last_error": self.last_error or None,
        }
