"""Where a session's controller state lives between requests: this process, or Redis shared by replicas.

``state.backend: memory`` (the default) keeps it in the session table alone. With ``redis``,
several gateway replicas (or one restarted) see the same session: each request reads the
session's Redis copy once at admission (``load``) and queues the session for writing when it
ends (``save``); a background writer sends everything queued in one pipeline per batch, so no
request ever waits for a write. Redis slow or down costs no request more than
``state.timeout_s`` once per ``state.retry_s``: the gateway serves from its local state
(degraded) and counts it. Last writer wins per session (docs/state.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import orjson

from gateway.config.config import GatewayConfig
from gateway.observe.ops_metrics import OpsMetrics
from gateway.sessions.table import ModeChange, Session
from policies import REASONS, Decision, LookupState, Method, SessionState, TreeShape, TreeShapeError
from policies.acceptance import legacy_weight
from policies.config import PolicyConfig
from policies.methods import is_method
from policies.tree import parse_shape
from policies.tree_choice import CELLS, EMPTY_CELL

# Schema 1's tested drafts -> a weight of evidence (``legacy_weight`` at the policy's half-life).
LegacyWeight = Callable[[int], float]

if TYPE_CHECKING:
    from gateway.sessions.redis_resp import RedisClient

log = logging.getLogger(__name__)

# Bumped on any change to the stored layout. 2: the acceptance estimate's weight of evidence and
# the lifetime proposed/accepted counts (the estimator of policies/acceptance.py); schema 1, whose
# estimate was a bare EWMA, still reads (``_legacy_state``). Other versions read as absent.
SCHEMA_VERSION = 2
LEGACY_SCHEMA = 1
DEFAULT_HALF_LIFE = PolicyConfig().acceptance_half_life
WRITE_BATCH = 256  # sessions per pipeline: one batch stays well inside timeout_s on any network
_MODES = ("speculative", "plain")


class CorruptState(ValueError):
    """A stored value that is not this schema's session state (corrupt, foreign or another version)."""


class WrongType(CorruptState):
    """Redis answered WRONGTYPE: the session's key holds another program's value of another type."""


# -- the stored form -------------------------------------------------------------------------------
def dump_session(session: Session) -> bytes:
    """The controller fields as compact JSON; wall-clock ``at`` only, no monotonic times (per process)."""
    s, d = session.policy_state, session.last_decision
    out: dict[str, Any] = {
        "v": SCHEMA_VERSION,
        "state": [s.acceptance_estimate, s.acceptance_weight, s.proposals_seen, s.drafts_proposed, s.drafts_accepted,
                  s.low_acceptance, s.plain_since_probe, s.auto_k],
        "decision": _stored_decision(d.mode, d.k, d.reason, d.tree) if d is not None else None,
        "history": [[c.at, c.mode, c.reason, c.k, *([c.tree] if c.tree is not None else [])]
                    for c in session.history],
        "requests": session.requests,
        "worker": session.worker_id,
    }
    # Token trees (K auto): added to the same schema version, absent while there is nothing to
    # keep, so sessions stored before trees (and by gateways without them) read alike.
    if s.auto_tree is not None or s.since_tree or s.ranks:
        out["tree"] = {"auto": None if s.auto_tree is None else str(s.auto_tree), "since": s.since_tree,
                       "ranks": [[i, beta, weight, tests] for i, (beta, weight, tests) in enumerate(s.ranks)
                                 if tests > 0]}
    # Speculation methods (policy.methods): added the same way, absent while the session has
    # chosen none.
    if s.lookups or s.method != "draft" or s.since_method or (d is not None and d.method is not None):
        out["methods"] = {"method": s.method, "since": s.since_method,
                          "decision": None if d is None else d.method,
                          "lookups": [[x.method, x.acceptance_estimate, x.acceptance_weight, x.proposals_seen,
                                       x.drafts_proposed, x.drafts_accepted, x.low_acceptance, x.steps_weight,
                                       x.proposing_weight, x.steps_seen, x.shadow_steps, x.shadow_drafts_proposed,
                                       x.shadow_drafts_accepted, x.shadow_drafts_tested] for x in s.lookups]}
    return orjson.dumps(out)


def _stored_decision(mode: str, k: int, reason: str, tree: TreeShape | str | None) -> list[Any]:
    return [mode, k, reason] if tree is None else [mode, k, reason, str(tree)]


def _int(value: Any, optional: bool = False) -> Any:
    # bool is an int to Python, never a count here; no count or K is negative.
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CorruptState(f"expected a count, got {value!r}")
    return value


def _float(value: Any, optional: bool = False, unit: bool = False) -> Any:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or (unit and not 0 <= value <= 1):
        raise CorruptState(f"expected a number{' in 0..1' if unit else ''}, got {value!r}")
    return float(value)


def _decision(mode: Any, k: Any, reason: Any, tree: Any = None) -> Decision:
    if mode not in _MODES or reason not in REASONS:
        raise CorruptState(f"unknown mode or reason {mode!r}, {reason!r}")
    shape = _tree(tree)
    if shape is not None and (mode != "speculative" or k != shape.depth):
        raise CorruptState(f"a tree {tree!r} with mode {mode!r} and k {k!r}")
    return Decision(mode, _int(k), reason, shape)


def _tree(text: Any) -> TreeShape | None:
    if text is None:
        return None
    if not isinstance(text, str):
        raise CorruptState(f"expected a tree shape, got {text!r:.60}")
    try:
        return parse_shape(text)
    except TreeShapeError as exc:
        raise CorruptState(str(exc)) from None


def _tree_state(state: SessionState, raw: Any, legacy: LegacyWeight | None) -> SessionState:
    """The session's tree fields (``dump_session``'s "tree"), onto the state read before them.
    ``legacy``: schema 1's cells, [cell, β, tests], whose weight is read off the tests."""
    if raw is None:
        return state
    if not isinstance(raw, dict):
        raise CorruptState(f"tree must be an object, got {raw!r:.60}")
    cells = [EMPTY_CELL] * CELLS
    for i, beta, *rest in raw["ranks"]:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < CELLS:
            raise CorruptState(f"rank cell {i!r:.20} out of range")
        if len(rest) != (1 if legacy else 2):
            raise CorruptState(f"a rank cell of {2 + len(rest)} fields")
        tests = _int(rest[-1])
        weight = legacy(tests) if legacy else _weight(rest[0])
        cells[i] = (_float(beta, unit=True), weight, tests)
    ranks = tuple(cells) if any(tests for _, _, tests in cells) else ()
    return replace(state, auto_tree=_tree(raw["auto"]), since_tree=_int(raw["since"]), ranks=ranks)


def _method(value: Any) -> Method:
    if not is_method(value):
        raise CorruptState(f"expected a speculation method, got {value!r}")
    return value


def _method_state(state: SessionState, decision: Decision | None, raw: Any) -> tuple[SessionState, Decision | None]:
    """The "methods" object (absent: the draft model alone, as before methods)."""
    if raw is None:
        return state, decision
    lookups = []
    for entry in raw["lookups"]:
        # The 11th field, shadow steps, came later, and the 12th-14th, the shadow steps' drafts
        # (counted in proposed/accepted before): a value stored without them has none.
        method, estimate, weight, seen, proposed, accepted, low, steps_w, proposing_w, steps, *rest = entry
        if not isinstance(low, bool) or len(rest) not in (0, 1, 4):
            raise CorruptState(f"a lookup entry must have 10, 11 or 14 fields and a bool low_acceptance, "
                               f"got {entry!r}")
        shadow = [_int(x) for x in rest] + [0] * (4 - len(rest))
        lookups.append(LookupState(_method(method), _float(estimate, optional=True, unit=True), _weight(weight),
                                   _int(seen), _int(proposed), _int(accepted), low, _weight(steps_w),
                                   _weight(proposing_w), _int(steps), *shadow))
    state = replace(state, method=_method(raw["method"]), since_method=_int(raw["since"]), lookups=tuple(lookups))
    if decision is not None and raw["decision"] is not None:
        decision = replace(decision, method=_method(raw["decision"]))
    return state, decision


def _weight(value: Any) -> float:
    weight = _float(value)
    if not 0.0 <= weight < 1e12:
        raise CorruptState(f"expected a weight of evidence, got {value!r}")
    return float(weight)


def _state(fields: Any, legacy: LegacyWeight | None) -> SessionState:
    """The "state" list: schema 2's eight fields, or schema 1's five (a bare EWMA and its lifetime
    tested drafts, read as ``legacy_weight`` drafts of evidence at that estimate; the lifetime
    proposed/accepted counts it never kept start at 0)."""
    if legacy:
        estimate, seen, low, since_probe, auto_k = fields
        weight, proposed, accepted = legacy(_int(seen)), 0, 0
    else:
        estimate, weight, seen, proposed, accepted, low, since_probe, auto_k = fields
        weight, proposed, accepted = _weight(weight), _int(proposed), _int(accepted)
    if not isinstance(low, bool):
        raise CorruptState(f"low_acceptance must be a bool, got {low!r}")
    estimate = _float(estimate, optional=True, unit=True)
    return SessionState(estimate, weight if estimate is not None else 0.0, _int(seen), proposed, accepted, low,
                        _int(since_probe), _int(auto_k, optional=True))


def parse_session(raw: bytes | str, half_life: float = DEFAULT_HALF_LIFE
                  ) -> tuple[SessionState, Decision | None, list[ModeChange], int, str | None]:
    """The stored fields, checked field by field; raises ``CorruptState`` for anything else.
    ``half_life``: the policy's ``acceptance_half_life``, which bounds a schema-1 estimate's weight."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise CorruptState(f"not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("v") not in (SCHEMA_VERSION, LEGACY_SCHEMA):
        raise CorruptState("not a session state of this schema version")
    # Schema 1 kept tested drafts, not weights: read as ``legacy_weight`` drafts of evidence.
    legacy = functools.partial(legacy_weight, half_life=half_life) if data["v"] == LEGACY_SCHEMA else None
    try:
        state = _state(data["state"], legacy)
        state = _tree_state(state, data.get("tree"), legacy)
        decision = _decision(*data["decision"]) if data["decision"] is not None else None
        state, decision = _method_state(state, decision, data.get("methods"))
        history = []
        for at, mode, reason, k, *tree in data["history"]:
            if len(tree) > 1:
                raise CorruptState(f"a history entry of {4 + len(tree)} fields")
            checked = _decision(mode, k, reason, *tree)
            history.append(ModeChange(_float(at), checked.mode, checked.reason, checked.k,
                                      None if checked.tree is None else str(checked.tree)))
        worker = data["worker"]
        if worker is not None and not isinstance(worker, str):
            raise CorruptState(f"worker must be a string, got {worker!r}")
        return state, decision, history, _int(data["requests"]), worker
    except (KeyError, TypeError, ValueError) as exc:  # missing fields, wrong shapes (CorruptState is a ValueError)
        raise CorruptState(str(exc)) from None


def apply_session(session: Session, raw: bytes | str, half_life: float = DEFAULT_HALF_LIFE) -> None:
    """The stored copy into the local session, in place (callers hold this very object)."""
    state, decision, history, requests, worker = parse_session(raw, half_life)
    session.policy_state, session.last_decision = state, decision
    session.history.clear()  # keeps the deque's maxlen (sessions.history)
    session.history.extend(history)
    session.requests, session.worker_id = requests, worker


# -- the stores ------------------------------------------------------------------------------------
class SessionStore:
    """The interface every store keeps (the relay and the endpoint picker call it); its methods
    are the memory backend's no-ops."""

    backend = "memory"

    @property
    def up(self) -> bool:
        return True

    async def load(self, session: Session) -> None:
        """The shared copy into ``session`` (just touched), if there is one newer than what this process knows."""

    def save(self, session: Session) -> None:
        """Queues ``session`` for writing (its request ended); never waits."""

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The writer while the body runs (a cleanup context); what is queued is written as it ends."""
        yield

    def describe(self) -> dict[str, Any]:
        return {"state_backend": self.backend, "state_backend_up": self.up}


class MemoryStore(SessionStore):
    """``state.backend: memory``: the session table is the state."""


class RedisStore(SessionStore):
    backend = "redis"

    def __init__(self, config: GatewayConfig, metrics: OpsMetrics) -> None:
        self.state_config, self.metrics = config.state, metrics
        # Bounds a schema-1 estimate's weight when one is read (the configured, not the live, half-life).
        self.half_life = config.policy.acceptance_half_life
        self.ttl_ms = max(1, int(config.sessions.idle_ttl_s * 1000))  # the session table's own idle TTL
        self.client: RedisClient | None = None  # made in running(): on the serving loop
        self._queued: dict[tuple[str, str], Session] = {}
        self._writing: set[tuple[str, str]] = set()
        # What this process last wrote or read per session (the local object, a hash of the bytes):
        # a Redis copy equal to it holds nothing that object lacks, and applying it would drop the
        # steps of a request still running here. A session the table evicted and made anew is
        # another object, which has none of it. Bounded as the session table is.
        self._synced: OrderedDict[tuple[str, str], tuple[weakref.ref[Session], int]] = OrderedDict()
        self._synced_max = config.sessions.max_sessions
        self._wake = asyncio.Event()
        self._down_until = 0.0  # monotonic; Redis untried before this after a failure
        self._up = True
        # RedisDown (and RedisTimeout) are OSErrors; an error reply is one too, set in running().
        self._errors: tuple[type[BaseException], ...] = (OSError, TimeoutError)

    @property
    def up(self) -> bool:
        return self._up

    def key(self, session: Session) -> str:
        # The scope (a key fingerprint, or "") holds no colon, so the id after it may.
        return f"{self.state_config.key_prefix}session:{session.scope}:{session.session_id}"

    def _usable(self) -> bool:
        return self.client is not None and time.monotonic() >= self._down_until

    async def load(self, session: Session) -> None:
        local = (session.scope, session.session_id)
        if not self._usable() or local in self._queued or local in self._writing:
            return  # degraded, or this process's own state is newer than any copy (its write is pending)
        assert self.client is not None
        try:
            raw = await self.client.get(self.key(session))  # the client bounds it by state.timeout_s
        except CorruptState as exc:  # another program's key of another type (WRONGTYPE): not an outage
            self._recovered()
            self._corrupt(session, exc)
            return
        except self._errors as exc:
            self._failed("load", exc)
            return
        self._recovered()
        if raw is None or local in self._queued or local in self._writing:
            return  # absent (new, expired, or written before Redis came back): local state stands
        digest = hash(raw)
        known = self._synced.get(local)
        if known is not None and known[0]() is session and known[1] == digest:
            return
        try:
            apply_session(session, raw, self.half_life)
        except CorruptState as exc:
            self._corrupt(session, exc)
            return
        self._remember(local, session, digest)

    def save(self, session: Session) -> None:
        if not self._usable():
            return  # down: sessions not seen after Redis is back are not backfilled
        self._queued[(session.scope, session.session_id)] = session
        self._wake.set()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        from gateway.sessions.redis_resp import RedisClient, RedisReplyError  # only with backend redis

        self._errors = (RedisReplyError, OSError, TimeoutError)
        # One connection; after a failure the next call (retry_s later) connects again. WRONGTYPE
        # raises CorruptState: to the store, a key of another type is a value it cannot read.
        self.client = RedisClient(self.state_config.redis_url, self.state_config.timeout_s, wrong_type=WrongType)
        try:
            await self.client.ping()
            log.info("session state in redis (%s*)", self.state_config.key_prefix)
        except self._errors as exc:
            self._failed("ping", exc)
        writer = asyncio.create_task(self._write_loop(), name="session-state-writer")
        try:
            yield
        finally:
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
            while self._queued and self._usable():  # the last requests' state, written before exit
                await self._flush()
            await self.client.close()
            self.client = None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "state_queued": len(self._queued)}

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queued:
                await self._flush()

    async def _flush(self) -> None:
        """One pipeline of up to ``WRITE_BATCH`` queued sessions, serialized now: their latest state."""
        batch = {local: self._queued.pop(local) for local in list(itertools.islice(self._queued, WRITE_BATCH))}
        if not self._usable():
            return  # down: dropped (written again on each session's next request once Redis is back)
        assert self.client is not None
        values = {local: dump_session(session) for local, session in batch.items()}
        self._writing.update(batch)
        try:  # one write of SET ... PX ttl per session, bounded by state.timeout_s (the client's)
            await self.client.set_many([(self.key(session), values[local], self.ttl_ms)
                                        for local, session in batch.items()])
        except asyncio.CancelledError:  # shutdown: back in the queue, for the last flush
            for local, session in batch.items():
                self._queued.setdefault(local, session)
            raise
        except self._errors as exc:
            self._failed("save", exc)
            return
        except Exception as exc:  # a bug, not an outage: the writer must outlive it
            log.exception("writing session state failed")
            self._failed("save", exc)
            return
        finally:
            self._writing.difference_update(batch)
        self._recovered()
        for local, value in values.items():
            self._remember(local, batch[local], hash(value))

    def _remember(self, local: tuple[str, str], session: Session, digest: int) -> None:
        self._synced[local] = (weakref.ref(session), digest)
        self._synced.move_to_end(local)
        while len(self._synced) > self._synced_max:
            self._synced.popitem(last=False)

    def _corrupt(self, session: Session, exc: BaseException) -> None:
        # Local state stands; the session's next write replaces the value.
        self.metrics.state_backend_errors.labels(reason="corrupt").inc()
        log.warning("ignored the stored state of session %s: %s", session.session_id, exc)

    def _failed(self, op: str, exc: BaseException) -> None:
        self.metrics.state_backend_errors.labels(reason="timeout" if isinstance(exc, TimeoutError) else "error").inc()
        self._down_until = time.monotonic() + self.state_config.retry_s
        self._queued.clear()  # no backfill: each session writes again on its next request
        if self._up:  # once per outage
            self._up = False
            self.metrics.state_backend_up.set(0)
            log.warning("state backend redis failed (%s: %s); serving from local session state, trying again "
                        "every %.3g s", op, str(exc) or type(exc).__name__, self.state_config.retry_s)

    def _recovered(self) -> None:
        if not self._up:
            self._up = True
            self.metrics.state_backend_up.set(1)
            log.info("state backend redis is back; sessions write their state on their next request")


def create_store(config: GatewayConfig, metrics: OpsMetrics) -> SessionStore:
    return RedisStore(config, metrics) if config.state.backend == "redis" else MemoryStore()
