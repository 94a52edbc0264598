"""The live policy and routing: what is active, when and from where it was loaded, and how it
is replaced.

Three ways in: the config file changes on disk and SIGHUP (both through the one config watcher,
gateway/config/watcher.py), and ``PUT /admin/policy``. A file reload installs the ``policy:``
and ``routing:`` sections together, or neither: a candidate that fails to parse or validate is
rejected with the field and value named, and the running policy and pipeline stay. Requests
read ``store.active`` (and the pipeline) once at admission, so a reload affects new requests only.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from gateway.config.config import ConfigError, _read_yaml, parse_routing_section
from gateway.config.env_overrides import Origin, policy_env, policy_origins, read_overrides
from gateway.config.watcher import ReloadSource
from gateway.observe.metrics import GatewayMetrics
from gateway.scheduling.config import POLICY_KEY_HOMES, ROUTE_KEYS
from gateway.scheduling.store import RoutingStore
from policies import FieldError, PolicyConfig
from policies.config import raise_problems

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedPolicy:
    policy: PolicyConfig
    loaded_at: float  # wall-clock seconds
    source: ReloadSource


@dataclass(frozen=True)
class ReloadResult:
    ok: bool
    error: str | None = None
    field: str | None = None


class PolicyStore:
    def __init__(self, initial: PolicyConfig, path: Path | None, metrics: GatewayMetrics,
                 routing: RoutingStore | None = None) -> None:
        self.current = LoadedPolicy(initial, time.time(), "startup")
        # The routing pipeline, reloaded with the policy (without a section: the policy's keys).
        self.routing = routing if routing is not None else RoutingStore(None, initial)
        self.path = path
        self.metrics = metrics
        self.last_error: str | None = None
        # Where each active value came from (GET /admin/policy): the file, a SPECGATE_POLICY__*
        # variable, or the default; a PUT makes them all "api" until the next reload.
        self.origins: dict[str, Origin] = self._startup_origins()

    def _startup_origins(self) -> dict[str, Origin]:
        file_section = None
        if self.path is not None:
            with contextlib.suppress(ConfigError):  # the startup load already reported a bad file
                file_section = _read_yaml(self.path).get("policy")
        try:
            overrides = read_overrides()
        except ConfigError:
            overrides = {}
        return policy_origins(file_section, overrides)

    @property
    def active(self) -> PolicyConfig:
        return self.current.policy

    def routing_clash(self, candidate: PolicyConfig) -> ConfigError | None:
        """Where the file has a ``routing:`` section, a policy from the API that changes a
        ``route_*`` key is refused: the section alone says how requests route."""
        if self.routing.section is None:
            return None
        for key in ROUTE_KEYS:
            if getattr(candidate, key) != getattr(self.current.policy, key):
                return ConfigError(f"policy.{key}", getattr(candidate, key), "is set by the config file's routing "
                                   f"section ({POLICY_KEY_HOMES[key][0]}); edit it there")
        return None

    def apply(self, candidate: PolicyConfig, source: ReloadSource,
              origins: dict[str, Origin] | None = None) -> None:
        """Installs ``candidate``, and the routing it describes where the file has no routing
        section (a file reload has installed the file's section first)."""
        self.origins = origins or dict.fromkeys(candidate.as_dict(), "api")
        changed = candidate != self.current.policy
        self.routing.install(self.routing.section, candidate)
        self.current = LoadedPolicy(candidate, time.time(), source)
        self.last_error = None
        self.metrics.policy_reloads.labels(model=self.metrics.model, source=source, result="ok").inc()
        log.info("policy reloaded from %s%s: %s", source, "" if changed else " (unchanged)", candidate.as_dict())

    def reject(self, error: Exception, source: ReloadSource) -> ReloadResult:
        """Keeps the running policy; the error (every problem of a candidate) goes to the log,
        ``last_error`` and the result."""
        message = error.summary() if isinstance(error, FieldError) else str(error)
        self.last_error = message
        self.metrics.policy_reloads.labels(model=self.metrics.model, source=source, result="failed").inc()
        # A bad candidate is its sender's input (a client's PUT, an operator's edit), not a fault
        # of this server: a warning, however many a reload storm brings.
        log.warning("policy reload from %s rejected, keeping the running policy: %s", source, message)
        return ReloadResult(False, message, error.field if isinstance(error, FieldError) else None)

    def reload_file(self, source: ReloadSource) -> ReloadResult:
        if self.path is None:
            return ReloadResult(False, "gateway was started without a config file")
        try:
            raw = _read_yaml(self.path)
        except FieldError as exc:
            return self.reject(exc, source)
        found: list[FieldError] = []
        try:
            # The environment's overrides are applied again on every reload (they outrank the file).
            candidate, origins = policy_env(raw.get("policy"))
        except FieldError as exc:
            found.extend(exc.problems)
        try:
            section = parse_routing_section(raw)
        except FieldError as exc:
            found.extend(exc.problems)
        try:
            raise_problems(found)
        except FieldError as exc:
            return self.reject(exc, source)
        self.routing.install(section, candidate)  # checked: it cannot fail now
        self.apply(candidate, source, origins)
        return ReloadResult(True)
