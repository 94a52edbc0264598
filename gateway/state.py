"""The gateway's shared state, held in the app under one typed key."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from gateway.config.config import GatewayConfig
from gateway.fleet.fleet import Fleet
from gateway.observe.chunk_outcome import ChunkOutcome, record_chunk
from gateway.observe.metrics import GatewayMetrics
from gateway.policy_store import PolicyStore
from gateway.scheduling.store import RoutingStore
from gateway.sessions.store import MemoryStore, SessionStore
from gateway.sessions.table import SessionTable


@dataclass(frozen=True)
class GatewayState:
    config: GatewayConfig
    metrics: GatewayMetrics
    sessions: SessionTable
    policy: PolicyStore
    fleet: Fleet
    # Per-session controller state shared with other replicas (state.backend: redis), else a no-op.
    store: SessionStore = field(default_factory=MemoryStore)

    @property
    def routing(self) -> RoutingStore:
        """The live routing pipeline, reloaded with the policy; one instance shared by the relay
        and the endpoint picker."""
        return self.policy.routing

    def settle(self, outcome: ChunkOutcome) -> None:
        """One chunk's outcome (gateway/accounting.py) into the metrics, in one call, and a
        worker's report of its cache into the routing pipeline's post-response step."""
        record_chunk(self.metrics, outcome)
        if outcome.cached is not None:
            self.routing.pipeline.post_response(outcome.worker_id, *outcome.cached)


STATE_KEY = web.AppKey("gateway", GatewayState)
