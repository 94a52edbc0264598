"""llama.cpp's ``llama-server`` as a worker (``workers.remote[].protocol: llamacpp``).

llama-server fixes its speculation per process (``--spec-type``, ``-md``,
``--spec-draft-n-max``); the request fields that would choose it per request are compiled out
(``tools/server/server-schema.cpp``). So each server is one method for its life, and the
gateway steers each session to the server whose method its rules want, as between vLLM servers
of one method each (gateway/placement.py).

What a server tells the gateway, and how it is read:

- **Its drafts**: each response's ``timings`` carries ``draft_n`` and ``draft_n_accepted``,
  cumulative over the request, absent when nothing was drafted (absent is 0). They come on the
  final chunk of a stream, or on every chunk with ``timings_per_token`` (which the relay asks
  for: the counters then move once per verification step, and each move is one step's own
  proposed and accepted counts). A jump that spans several steps (a whole answer's totals) is
  read as steps of the server's ``max_k`` drafts each. llama.cpp counts proposed and accepted,
  not tested: a step's tested drafts follow from its counts as a specgate step's do
  (``policies.tested_drafts``), so its α is priced as vLLM's accepted ÷ proposed is.
- **Its load**: ``llamacpp:requests_processing`` and ``llamacpp:requests_deferred`` from its
  ``/metrics`` (the server's ``--metrics`` flag; without it, the gateway's own count alone).
- **Its prompt cache**: a slot keeps its prompt's K/V for the next request (``cache_prompt``,
  on by default), and ``--cache-ram`` keeps prompts of any slot in host memory, so one tenant's
  request could start from another's tokens. ``PromptScopes`` decides, per request, the slot
  and ``cache_prompt`` that keep each cache scope's prompts its own (gateway/tenancy.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from policies import CostModel
from workers.api.generation import SpecSteps
from workers.api.wire import StepReport

TIMINGS_FIELD = "timings"
# llama-server's own request fields that choose slots or cache reuse: set by the gateway only
# (a client's would reach around the tenant rule above).
GATEWAY_OWNED_FIELDS = ("cache_prompt", "id_slot", "n_cache_reuse", "timings_per_token")
# Beyond this a count is not a count (llama.cpp's are int32): the chunk's timings are ignored.
MAX_COUNT = 1 << 31


@dataclass
class TimingsSeen:
    """One request's llama.cpp counters as last read, and the steps inferred from them so far."""

    proposed: int = 0  # draft_n
    accepted: int = 0  # draft_n_accepted
    tokens: int = 0  # predicted_n, or the text chunks counted before any timings came
    proposing_steps: int = 0
    plain_steps: int = 0
    ms: float = 0.0  # predicted_ms: the generation's time so far, as of its last step
    # The steps whose time one chunk's timings told alone, as (drafts verified, ms): what
    # StepCosts learns the server's costs from; taken by the caller, then cleared.
    step_ms: list[tuple[int, float]] = field(default_factory=list)
    prefill: tuple[int, float] | None = None  # (prompt tokens computed, ms), from the timings that tell it
    # Timings that could not be read or whose counters went back, and steps whose accepted count
    # passed their proposed: counted in specgate_step_reports_clamped_total, then cleared.
    clamps: list[str] = field(default_factory=list)

    def take_clamps(self) -> list[str]:
        taken, self.clamps = self.clamps, []
        return taken

    def take_step_ms(self) -> list[tuple[int, float]]:
        taken, self.step_ms = self.step_ms, []
        return taken


def llamacpp_body(body: dict[str, Any], streamed: bool, lease: SlotLease) -> dict[str, Any]:
    """A request as a llama-server takes it: the gateway's own fields set, a client's removed."""
    for name in GATEWAY_OWNED_FIELDS:
        body.pop(name, None)
    body["cache_prompt"] = lease.reuse
    if lease.slot is not None:
        body["id_slot"] = lease.slot
    if streamed:
        body["timings_per_token"] = True
    return body


def _count(value: Any) -> int | None:
    """A counter's value: absent is 0; anything but a non-negative integer is unreadable."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_COUNT:
        return None
    return value


def _ms(value: Any) -> float | None:
    """A duration in ms: a finite, non-negative number (not a bool); else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def timings_report(chunk: dict[str, Any], seen: TimingsSeen, max_k: int, lookup: bool,
                   counted_text: bool) -> StepReport | None:
    """The steps behind one chunk of a llama-server answer, from the move of its ``timings``
    since ``seen`` (updated); the ``timings`` field leaves the chunk (it is llama.cpp's, not
    OpenAI's). None where the chunk has no readable timings: ``counted_text`` says the caller
    counts the chunk's text as one token then, so a later total does not count it again.

    ``lookup``: the server's method is a lookup method (its steps without a proposal are plain
    steps of that method: its coverage); else they are left out of the evidence."""
    if TIMINGS_FIELD not in chunk:
        seen.tokens += counted_text
        return None
    timings = chunk.pop(TIMINGS_FIELD)
    counts = [_count(timings.get(name)) for name in ("draft_n", "draft_n_accepted", "predicted_n")] \
        if isinstance(timings, Mapping) else [None]
    if None in counts:
        seen.clamps.append("unreadable_timings")
        seen.tokens += counted_text
        return None
    proposed, accepted, tokens = (int(c or 0) for c in counts)
    d_proposed, d_accepted = proposed - seen.proposed, accepted - seen.accepted
    # Tokens counted from text before any timings came may run ahead of the server's count.
    d_tokens = max(0, tokens - seen.tokens)
    if d_proposed < 0 or d_accepted < 0:
        seen.clamps.append("negative")  # counters never go back within a request: not this request's
        seen.tokens += counted_text
        return None
    if d_accepted > d_proposed:
        seen.clamps.append("accepted_over_proposed")
        d_accepted = d_proposed
    seen.proposed, seen.accepted, seen.tokens = proposed, seen.accepted + d_accepted, max(tokens, seen.tokens)
    steps = _split(d_proposed, d_accepted, max(1, max_k))
    seen.proposing_steps += len(steps)
    # Every step emits one token of its own and its accepted drafts: what is left was plain. The
    # first token is the prompt's (llama.cpp samples it from the prompt's last logits), no step.
    plain = max(seen.plain_steps, tokens - 1 - seen.proposing_steps - seen.accepted)
    new_plain, seen.plain_steps = plain - seen.plain_steps, plain
    prompt_n, prompt_ms = _count(timings.get("prompt_n")), _ms(timings.get("prompt_ms"))
    if seen.prefill is None and prompt_n and prompt_ms:
        seen.prefill = (prompt_n, prompt_ms)
    ms = _ms(timings.get("predicted_ms"))
    if ms is not None and ms >= seen.ms:
        # A chunk that tells one step alone (a step's first token; its later tokens come at once).
        if len(steps) + new_plain == 1 and ms > seen.ms:
            seen.step_ms.append((steps[0][0] if steps else 0, ms - seen.ms))
        seen.ms = ms
    plain_group = (SpecSteps(0, 0, new_plain),) if lookup and new_plain else ()
    if steps:  # the chunk's first step is the report's own; the rest follow it
        first_p, first_a = steps[0]
        late = tuple(SpecSteps(p, a, 1) for p, a in steps[1:]) + plain_group
        return StepReport(first_p, first_a, 0, first_p, d_tokens, late)
    if new_plain:  # plain steps only: the report's own is the first of them
        rest = (SpecSteps(0, 0, new_plain - 1),) if lookup and new_plain > 1 else ()
        return StepReport(0, 0, 0, 0, d_tokens, rest)
    # Neither: a token of a step already counted (a step sends its tokens a chunk each), or no
    # token at all. The caller counts the chunk's text, as for any server that reports no steps.
    return None


class StepCosts:
    """A llama-server's step times, learned from its per-token timings, as the cost model the
    policy prices its speculation with (a specgate worker measures and publishes its own; a
    llama-server publishes none).

    A plain step's time and a drafting step's time are each a decayed mean over the server's last
    ~``HALF_LIFE`` such steps, at whatever batch depth it ran them. The server drafts what its
    n-gram type or draft model finds, whatever K a decision names, so a drafting step of any K is
    priced at the mean drafting step's cost: the rules weigh what running there costs, not a K
    they cannot choose. No model until ``MIN_STEPS`` of each kind were timed."""

    HALF_LIFE = 64
    DECAY = 0.5 ** (1.0 / HALF_LIFE)
    MIN_STEPS = 8

    def __init__(self) -> None:
        self._sum = [0.0, 0.0]  # decayed ms of plain steps, of drafting steps
        self._weight = [0.0, 0.0]
        self._count = [0, 0]
        self._prefill = [0.0, 0.0]  # decayed prompt ms and prompt tokens computed (not cached)

    def observe(self, k: int, ms: float) -> None:
        kind = int(k > 0)
        self._sum[kind] = self._sum[kind] * self.DECAY + ms
        self._weight[kind] = self._weight[kind] * self.DECAY + 1.0
        self._count[kind] += 1

    def observe_prefill(self, tokens: int, ms: float) -> None:
        """A request's prompt: ``tokens`` computed (those its slot did not hold) in ``ms``."""
        self._prefill = [self._prefill[0] * self.DECAY + ms, self._prefill[1] * self.DECAY + tokens]

    @property
    def plain_step_ms(self) -> float | None:
        return self._sum[0] / self._weight[0] if self._count[0] >= self.MIN_STEPS else None

    @property
    def prefill_ms_per_token(self) -> float | None:
        return self._prefill[0] / self._prefill[1] if self._prefill[1] >= 64 else None

    def relative_draft_cost(self) -> float | None:
        """A drafting step's time over a plain step's; None until both were timed often enough."""
        if min(self._count) < self.MIN_STEPS:
            return None
        plain, drafting = (self._sum[i] / self._weight[i] for i in (0, 1))
        return max(1.0, drafting / plain) if plain > 0 else None

    def model(self, max_k: int) -> CostModel | None:
        relative = self.relative_draft_cost()
        if relative is None or max_k < 1:
            return None
        return CostModel((1,), ((1.0,) + (relative,) * max_k,))

    def view(self) -> dict[str, object]:
        relative = self.relative_draft_cost()
        return {"plain_steps_timed": self._count[0], "drafting_steps_timed": self._count[1],
                "plain_step_ms": round(self._sum[0] / self._weight[0], 3) if self._weight[0] else None,
                "drafting_step_ms": round(self._sum[1] / self._weight[1], 3) if self._weight[1] else None,
                "relative_draft_cost": None if relative is None else round(relative, 3),
                "prefill_ms_per_token": None if self.prefill_ms_per_token is None
                else round(self.prefill_ms_per_token, 3)}


def _split(proposed: int, accepted: int, max_k: int) -> list[tuple[int, int]]:
    """``proposed`` drafts as the fewest steps of at most ``max_k`` each, and ``accepted`` spread
    over them as evenly as each step's proposals allow: one step's counts are its own."""
    if proposed <= 0:
        return []
    n = -(-proposed // max_k)
    sizes = [proposed // n + (1 if i < proposed % n else 0) for i in range(n)]
    out = []
    left = accepted
    for i, size in enumerate(sizes):
        share = min(size, -(-left // (n - i)))
        out.append((size, share))
        left -= share
    return out


def read_depth(metrics_text: str) -> tuple[int, int] | None:
    """Requests a llama-server is processing and deferring, from its Prometheus text; None
    where it exports neither (started without ``--metrics``)."""
    processing = deferred = None
    for line in metrics_text.splitlines():
        if line.startswith("llamacpp:requests_processing"):
            processing = _gauge(line)
        elif line.startswith("llamacpp:requests_deferred"):
            deferred = _gauge(line)
    if processing is None and deferred is None:
        return None
    return processing or 0, deferred or 0


def _gauge(line: str) -> int | None:
    try:
        value = float(line.rsplit(" ", 1)[1])
    except (IndexError, ValueError):
        return None
    return int(value) if 0 <= value < MAX_COUNT else None


@dataclass(frozen=True)
class SlotLease:
    """What one request sends a llama-server about its cache: the slot it must run in (None:
    the server picks) and whether it may start from what that slot holds (``cache_prompt``)."""

    slot: int | None
    reuse: bool


class PromptScopes:
    """The cache scopes (gateway/tenancy.py) a gateway has sent one llama-server, and what a
    request of a scope may therefore reuse there.

    While every request the gateway sent the server was of one scope, the server holds that
    scope's prompts alone: requests reuse its cache, and the server picks their slots (by prompt
    similarity, as it does for any client). Once a second scope was sent:

    - by default, no request reuses anything (``cache_prompt: false``): llama-server's host
      prompt cache (``--cache-ram``, on by default) moves prompts between slots, so no slot is
      one scope's. Give each tenant its own server where its prompts should stay cached;
    - with ``scoped_slots`` (the server's ``-np``, started with ``--cache-ram 0``), each request
      runs in a slot of its own (``id_slot``): an idle one its scope used last reuses it, any
      other idle one is taken over without reuse, and where every slot is taken, the request
      reuses nothing and the server picks.

    The record starts with the gateway: a server older than it, or shared with other clients,
    may hold prompts it never sent (docs/llamacpp.md)."""

    def __init__(self, scoped_slots: int = 0) -> None:
        self._only: str | None = None  # the one scope sent so far
        self._mixed = False
        self._owner: list[str | None] = [None] * scoped_slots  # the scope each slot last ran
        self._busy = [0] * scoped_slots  # this gateway's requests running in each slot
        self._last_used = [0] * scoped_slots
        self._clock = 0

    def lease(self, scope: str) -> SlotLease:
        """A request of ``scope`` is about to be sent: its slot and reuse (``release`` it after)."""
        if not self._mixed:
            if self._only is None or self._only == scope:
                self._only = scope
                return SlotLease(None, True)
            self._mixed = True
            # Until now only one scope ran, in whichever slots the server picked.
            self._owner = [self._only] * len(self._owner)
        idle = [i for i in range(len(self._owner)) if not self._busy[i]]
        if not idle:
            return SlotLease(None, False)
        own = [i for i in idle if self._owner[i] == scope]
        slot = max(own, key=lambda i: self._last_used[i]) if own else min(idle, key=lambda i: self._last_used[i])
        self._clock += 1
        self._busy[slot] += 1
        self._last_used[slot] = self._clock
        self._owner[slot] = scope
        return SlotLease(slot, bool(own))

    def release(self, lease: SlotLease) -> None:
        if lease.slot is not None and self._busy[lease.slot] > 0:
            self._busy[lease.slot] -= 1

    def view(self) -> dict[str, object]:
        return {"scopes": "mixed" if self._mixed else "none" if self._only is None else "one",
                "scoped_slots": len(self._owner), "slots_busy": sum(1 for b in self._busy if b)}
