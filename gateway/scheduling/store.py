"""The live routing pipeline: built once at start-up, rebuilt in place on each reload of the
config file (with the policy: gateway/policy_store.py), so that its plugins keep their state (the
prefix scorer's index) across reloads. Requests read ``store.pipeline`` once at admission; a
reload affects new requests only. GIE reads its config at start-up only: the live reload is
specgate's addition.

Without a ``routing:`` section the pipeline follows the policy's ``route_*`` keys, including a
``PUT /admin/policy`` that changes them; with one, the section alone says how requests route.
"""

from __future__ import annotations

import logging
from typing import Any

from gateway.scheduling.config import RoutingConfig, build, routing_from_policy
from gateway.scheduling.framework import Pipeline
from gateway.scheduling.plugins.prefix_cache_scorer import PrefixCacheScorer
from gateway.scheduling.plugins.prefix_index import PrefixIndex
from policies import PolicyConfig

log = logging.getLogger(__name__)


class RoutingStore:
    def __init__(self, section: RoutingConfig | None, policy: PolicyConfig) -> None:
        self.section = section  # the file's routing section; None: the policy's route_* keys
        self.config = section or routing_from_policy(policy)
        self.pipeline: Pipeline = build(self.config)

    def install(self, section: RoutingConfig | None, policy: PolicyConfig) -> None:
        """A reload's routing (checked already): the section, else the policy's keys."""
        config = section or routing_from_policy(policy)
        self.section = section
        if config != self.config:
            self.pipeline = build(config, previous=self.pipeline)
            self.config = config
            log.info("routing reloaded: %s", config.as_dict())

    def view(self) -> dict[str, Any]:
        """What runs (``GET /admin/routing``): the section as config.yaml writes it, and its source."""
        return {"routing": self.config.as_dict(),
                "source": "routing section" if self.section is not None else "policy route_* keys"}

    def prefix_index(self) -> PrefixIndex | None:
        """The prefix scorer's index (``/admin/workers``), if the pipeline has one."""
        plugin = self.pipeline.plugin(PrefixCacheScorer)
        return plugin.index if isinstance(plugin, PrefixCacheScorer) else None

    def forget(self, worker_id: str) -> None:
        self.pipeline.forget(worker_id)
