"""The session table: which worker a session sticks to and what the policy knows about it.

Bounded two ways so memory does not grow with traffic: at most ``max_sessions`` entries
(least recently used evicted first) and none idle longer than ``idle_ttl_s``. Time comes in
as an argument (the event loop's monotonic clock), which keeps the table testable.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from gateway.config.config import SessionsConfig
from policies import Decision, Mode, SessionState


class RandomIds:
    """Ids of 32 hex digits from ``os.urandom``, read from the OS 4 KiB at a time.

    A request without a session is given a new session id and every request a new request
    id: ``strace -c -p`` of a gateway under sequential load counted 2 ``getrandom`` calls a
    request beside its 3 writes and 2 reads. The bytes are the same cryptographic bytes, read
    256 ids at a time. Called from the event loop only; a forked child starts with an empty
    buffer, so no two processes hand out the same id.
    """

    _CHUNK = 4096

    def __init__(self) -> None:
        self._buffer = b""
        self._at = 0
        mine = weakref.ref(self)  # the fork hook cannot be removed: it must not keep the table alive
        os.register_at_fork(after_in_child=lambda: _forget(mine))

    def __call__(self) -> str:
        if self._at + 16 > len(self._buffer):
            self._buffer, self._at = os.urandom(self._CHUNK), 0
        start, self._at = self._at, self._at + 16
        return self._buffer[start:self._at].hex()


def _forget(ids: weakref.ref[RandomIds]) -> None:
    owner = ids()
    if owner is not None:
        owner._buffer, owner._at = b"", 0


@dataclass(frozen=True)
class ModeChange:
    at: float  # wall-clock seconds (time.time) for humans reading /admin
    mode: Mode
    reason: str
    k: int
    tree: str | None = None  # a token tree's notation (k its depth); None: a chain of k, or plain


@dataclass
class Session:
    session_id: str  # as the client knows it (X-Session-ID)
    last_seen: float
    worker_id: str | None = None
    policy_state: SessionState = field(default_factory=SessionState)
    last_decision: Decision | None = None
    requests: int = 0
    history: deque[ModeChange] = field(default_factory=deque)
    # The fingerprint of the API key that created it ("" while the API is open): the table is
    # keyed by (scope, id), so another key using the same id gets a session of its own.
    scope: str = ""
    # Its last request's prompt and answer, in tokens (its usage): about what the next request's
    # prompt starts with, which the server that served it holds and another would compute again.
    context_tokens: int = 0

    @property
    def mode(self) -> Mode | None:
        return self.last_decision.mode if self.last_decision else None


class SessionTable:
    def __init__(self, config: SessionsConfig) -> None:
        self.config = config
        self._sessions: OrderedDict[tuple[str, str], Session] = OrderedDict()
        self.evicted = 0
        self.random_id = RandomIds()  # new session ids, and the relay's request ids

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str, scope: str = "") -> Session | None:
        return self._sessions.get((scope, session_id))

    def find(self, session_id: str) -> list[Session]:
        """The sessions of that id in every scope (the admin view; a scan, not a hot path)."""
        return [s for (_, sid), s in self._sessions.items() if sid == session_id]

    def touch(self, session_id: str | None, now: float, scope: str = "") -> Session:
        """Returns the session (created if new or expired), marked most recently used."""
        self.expire(now)
        if session_id is None:
            session_id = "sess-" + self.random_id()  # as uuid4().hex, without building a UUID
        key = (scope, session_id)
        session = self._sessions.get(key)
        if session is None:
            session = Session(session_id, now, history=deque(maxlen=self.config.history), scope=scope)
            self._sessions[key] = session
            while len(self._sessions) > self.config.max_sessions:
                self._sessions.popitem(last=False)
                self.evicted += 1
        else:
            session.last_seen = now
            self._sessions.move_to_end(key)
        return session

    def expire(self, now: float) -> None:
        # Least recently used first, so stop at the first session still fresh.
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            if now - oldest.last_seen <= self.config.idle_ttl_s:
                break
            self._sessions.popitem(last=False)
            self.evicted += 1

    def policy_states(self) -> list[SessionState]:
        """Every session's policy state (a copy of the list: /metrics reads it while requests run)."""
        return [session.policy_state for session in self._sessions.values()]

    def counts_by_mode(self) -> dict[str, int]:
        counts = {"speculative": 0, "plain": 0, "undecided": 0}
        for session in self._sessions.values():
            counts[session.mode or "undecided"] += 1
        return counts

    def move_off(self, worker_id: str) -> int:
        """Unpins sessions from a worker that went down; they are re-routed on their next request."""
        moved = 0
        for session in self._sessions.values():
            if session.worker_id == worker_id:
                session.worker_id = None
                moved += 1
        return moved
