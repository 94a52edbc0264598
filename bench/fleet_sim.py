"""A simulated fleet in virtual time: sessions, router, policy and sim replicas, no clock, no I/O.

A discrete-event simulation. Every replica is a ``SimBatch`` (the very code the sim worker
engine steps, with the same roofline and acceptance sampler); the router is the gateway's
``choose_worker``; the policies call the gateway's pure functions (``decide``,
``record_decision``, ``observe``, ``batch_latch``) at the same points the gateway does, with
what the gateway knows of each worker (its published cost model, its acceptance, the draft mix
of the requests in flight there: ``gateway.fleet.draft_mix``), and the replicas apply ``step_depth``
per step as every specgate engine does (with K auto, the cost rule too: ``StepCostRule``).
Seeded throughout: the same arguments give the same figures.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.fleet.draft_mix import DraftMix
from gateway.fleet.routing import Candidate, choose_worker
from policies import (
    CostModel,
    Decision,
    PolicyConfig,
    RequestFacts,
    SessionState,
    WorkerState,
    batch_latch,
    decide,
    observe,
    observe_path,
    record_decision,
    worker_acceptance,
)
from workers.api.sim_config import SimConfig
from workers.costs.online import StepCostRule
from workers.engines.sim.engine import derived_cost_report
from workers.engines.sim.roofline import NO_CAP, BatchStep, SimBatch, SimSeq, StepRule, gain

# -- policies -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FleetPolicy:
    """One way of deciding speculation. ``config`` set: specgate's rules (the gateway's functions,
    with the engine's per-step latch). Otherwise a fixed K per request and a per-step K cap by
    batch depth (``k_by_depth``: ascending (max depth, K) bands), as vLLM's own rule."""

    name: str
    config: PolicyConfig | None = None
    k: int = 0
    k_by_depth: tuple[tuple[int, int], ...] = ()

    def step_rule(self, batch: SimBatch) -> StepRule:
        if self.config is not None:
            batch.max_batch, batch.batch_resume = self.config.max_batch, self.config.batch_resume
            batch.max_step_drafts = self.config.max_step_drafts
            return batch.latch_rule
        bands = self.k_by_depth

        def by_depth(depth: int) -> int:
            for max_depth, k in bands:
                if depth <= max_depth:
                    return k
            return NO_CAP if not bands else bands[-1][1]
        return by_depth


def vllm_k_table(config: SimConfig, alpha: float, k_max: int, context: int,
                 depths: Sequence[int] = (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 128, 192, 256)
                 ) -> tuple[tuple[int, int], ...]:
    """The table an operator would profile offline: per depth band, the K in 0..k_max with the
    best modelled throughput at one acceptance (the deployment's reported one)."""
    bands = []
    for depth in depths:
        best = max(range(k_max + 1), key=lambda k: 1.0 if k == 0 else gain(config, alpha, depth, k, context))
        bands.append((depth, best))
    return tuple(bands)


# -- workload -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionKind:
    name: str  # also the sim's prompt category
    category: str
    temperature: float
    max_tokens: tuple[int, int]  # uniform range of a request's output length
    prompt_tokens: tuple[int, int] = (256, 1024)


CODE = SessionKind("code", "code", 0.2, (128, 384))
REASONING = SessionKind("reasoning", "math", 0.7, (256, 768))
CHAT = SessionKind("chat", "chat", 1.0, (64, 256))
KINDS = (CODE, REASONING, CHAT)


@dataclass(frozen=True)
class Phase:
    name: str
    duration_s: float
    sessions_per_kind: int  # sessions of each kind alive in this phase (closed loop)


DEFAULT_PHASES = (Phase("light", 300, 4), Phase("steady", 600, 16), Phase("burst", 300, 80),
                  Phase("recovery", 300, 16))
THINK_TIME_S = 1.0  # mean pause between a session's requests (exponential)


# -- statistics -----------------------------------------------------------------------------------------


class LogHistogram:
    """Counts on log-spaced bins (0.5% wide) from 0.1 ms to 1000 s: percentiles without keeping samples."""

    LO, BINS_PER_DECADE, DECADES = 1e-4, 460, 7

    def __init__(self) -> None:
        self.counts = [0] * (self.BINS_PER_DECADE * self.DECADES + 1)
        self.n = 0

    def add(self, value: float, count: int = 1) -> None:
        i = 0 if value <= self.LO else min(len(self.counts) - 1,
                                          int(math.log10(value / self.LO) * self.BINS_PER_DECADE))
        self.counts[i] += count
        self.n += count

    def quantile(self, q: float) -> float | None:
        if not self.n:
            return None
        target, seen = q * self.n, 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= target:
                return float(self.LO * 10 ** ((i + 0.5) / self.BINS_PER_DECADE))
        return None


@dataclass
class PhaseStats:
    tokens: int = 0
    spec_tokens: int = 0  # emitted by steps that drafted
    switches: int = 0
    requests: int = 0
    itl: LogHistogram = field(default_factory=LogHistogram)
    ttft: LogHistogram = field(default_factory=LogHistogram)


# -- the simulation -------------------------------------------------------------------------------------


@dataclass
class _Session:
    sid: int
    kind: SessionKind
    rng: random.Random
    retire_at: float
    worker: str | None = None
    state: SessionState = field(default_factory=SessionState)
    last_mode: str | None = None


@dataclass
class _Request:
    session: _Session
    arrived: float
    worker: str
    decision: Decision  # what it was sent with (its part of the worker's draft mix)
    first_at: float | None = None
    last_at: float = 0.0


@dataclass
class _Replica:
    name: str
    batch: SimBatch
    in_flight: int = 0
    gateway_latch: bool = False  # the gateway's batch latch for this worker (batch_latch)
    # What the gateway knows of the worker for K auto: its published costs (the sim engine's
    # derived cost model, parsed as the gateway parses it) and its acceptance over all sessions.
    cost: CostModel | None = None
    acceptance: SessionState = field(default_factory=SessionState)
    mix: DraftMix = field(default_factory=DraftMix)  # the in-flight requests by K, as the gateway tracks them
    busy: bool = False


@dataclass
class FleetResult:
    policy: str
    phases: dict[str, PhaseStats]
    overall: PhaseStats
    timeline: list[int]  # tokens per timeline bucket
    bucket_s: float
    phase_bounds: list[tuple[str, float, float]]


class FleetSim:
    def __init__(self, config: SimConfig, policy: FleetPolicy, phases: Sequence[Phase] = DEFAULT_PHASES,
                 replicas: int = 2, max_slots: int = 256, max_k: int = 8, seed: int = 0, bucket_s: float = 10.0,
                 progress: Callable[[float], None] | None = None, trees: bool = False) -> None:
        self.config, self.policy, self.phases = config, policy, list(phases)
        # Whether the workers publish token trees (the sim's tree_max_nodes) for the policy to
        # choose: bench.policy's main table compares chain policies and runs without them.
        self.tree_max_nodes = config.tree_max_nodes if trees else 0
        self.tree_requests = self.tree_steps = 0
        self.rng = random.Random(seed)
        self.replicas = {}
        cost = CostModel.from_json(derived_cost_report(config, max_k, max_slots).to_json())
        for i in range(replicas):
            batch = SimBatch(config, max_slots, max_k)
            batch.step_rule = policy.step_rule(batch)
            if policy.config is not None and policy.config.auto_k:  # the directive's cost_rule, as the gateway sends it
                batch.cost_rule = StepCostRule(cost)
            self.replicas[f"worker-{i}"] = _Replica(f"worker-{i}", batch, cost=cost)
        self.requests: dict[str, _Request] = {}
        self.events: list[tuple[float, int, _Session | tuple[_Replica, BatchStep]]] = []
        self.counter = 0
        self.now = 0.0
        self.bounds: list[tuple[str, float, float]] = []
        t = 0.0
        for phase in self.phases:
            self.bounds.append((phase.name, t, t + phase.duration_s))
            t += phase.duration_s
        self.end = t
        self.stats = {p.name: PhaseStats() for p in self.phases}
        self.overall = PhaseStats()
        self.bucket_s = bucket_s
        self.timeline = [0] * (int(self.end / bucket_s) + 1)
        self.progress = progress
        self.next_sid = self.next_rid = 0

    def _push(self, at: float, payload: _Session | tuple[_Replica, BatchStep]) -> None:
        self.counter += 1  # ties break by insertion order: deterministic
        heapq.heappush(self.events, (at, self.counter, payload))

    def _phase_at(self, t: float) -> str:
        for name, lo, hi in self.bounds:
            if lo <= t < hi:
                return name
        return self.bounds[-1][0]

    def run(self) -> FleetResult:
        # Sessions: each phase's population; one alive across phases stays (same session, same state).
        alive: dict[str, list[tuple[float, float]]] = {}
        for kind in KINDS:
            for name, lo, hi in self.bounds:
                want = next(p.sessions_per_kind for p in self.phases if p.name == name)
                spans = alive.setdefault(kind.name, [])
                # Extend sessions that were alive until ``lo``; start new ones for the excess.
                current = [i for i, (_, end) in enumerate(spans) if end == lo]
                for i in current[:want]:
                    spans[i] = (spans[i][0], hi)
                for _ in range(want - len(current[:want])):
                    spans.append((lo, hi))
            for start, end in alive[kind.name]:
                session = _Session(self.next_sid, kind, random.Random(self.rng.getrandbits(64)), end)
                self.next_sid += 1
                self._push(start + session.rng.expovariate(1 / THINK_TIME_S), session)
        report_every, next_report = self.end / 20, self.end / 20
        while self.events:
            at, _, payload = heapq.heappop(self.events)
            if at > self.end:
                break
            self.now = at
            if self.progress is not None and at >= next_report:
                self.progress(at / self.end)
                next_report += report_every
            if isinstance(payload, _Session):
                self._request(payload)
            else:
                self._step_done(*payload)
        return FleetResult(self.policy.name, self.stats, self.overall, self.timeline, self.bucket_s, self.bounds)

    def _request(self, session: _Session) -> None:
        if self.now >= session.retire_at:
            return
        candidates = [Candidate(r.name, True, r.in_flight, frozenset({"speculative", "plain"}))
                      for r in self.replicas.values()]
        worker_id = choose_worker(session.worker, candidates)
        assert worker_id is not None
        replica = self.replicas[worker_id]
        session.worker = worker_id
        kind = session.kind
        temperature = kind.temperature
        policy = self.policy
        if policy.config is not None:  # the gateway's admission, as gateway/relay/relay.py runs it
            replica.gateway_latch = batch_latch(replica.gateway_latch, replica.in_flight, policy.config)
            worker = WorkerState(replica.in_flight, replica.gateway_latch, replica.batch.max_k, cost=replica.cost,
                                 acceptance=worker_acceptance(replica.acceptance, policy.config),
                                 mix=replica.mix.step_mix(), tree_max_nodes=self.tree_max_nodes)
            decision = decide(session.state, worker, RequestFacts(temperature), policy.config)
            session.state = record_decision(session.state, decision, policy.config.auto_k)
        else:
            decision = Decision("speculative", policy.k, "default") if policy.k > 0 else Decision("plain", 0, "default")
        k, mode = decision.k, decision.mode
        self.tree_requests += decision.tree is not None
        stats = self.stats[self._phase_at(self.now)]
        if session.last_mode is not None and session.last_mode != mode:
            stats.switches += 1
            self.overall.switches += 1
        session.last_mode = mode
        stats.requests += 1
        self.overall.requests += 1
        rng = session.rng
        self.next_rid += 1
        rid = f"r{self.next_rid}"
        seq = SimSeq(rid, k, self.config.acceptance.alpha(kind.category, temperature), rng.randint(*kind.max_tokens),
                     rng.randint(*kind.prompt_tokens), random.Random(rng.getrandbits(64)), tree=decision.tree)
        self.requests[rid] = _Request(session, self.now, worker_id, decision)
        replica.in_flight += 1
        replica.mix.add(decision)
        replica.batch.add(seq)
        if not replica.busy:
            self._start_step(replica)

    def _start_step(self, replica: _Replica) -> None:
        step = replica.batch.step()
        if step is None:
            replica.busy = False
            return
        replica.busy = True
        self._push(self.now + step.duration_s, (replica, step))

    def _step_done(self, replica: _Replica, step: BatchStep) -> None:
        now = self.now
        stats = self.stats[self._phase_at(now)]
        overall = self.overall
        bucket = min(len(self.timeline) - 1, int(now / self.bucket_s))
        policy = self.policy.config
        for r in step.results:
            request = self.requests[r.seq.request_id]
            n = r.emitted
            stats.tokens += n
            overall.tokens += n
            self.timeline[bucket] += n
            if r.k > 0:
                stats.spec_tokens += n
                overall.spec_tokens += n
                self.tree_steps += r.path is not None
                if policy is not None:  # the gateway folds every step report into the session
                    session = request.session
                    if r.path is not None:  # a tree step: by its path (rank-1 tests into α)
                        session.state = observe_path(session.state, r.path, policy)
                        replica.acceptance = observe_path(replica.acceptance, r.path, policy)
                    else:
                        session.state = observe(session.state, r.k, r.accepted, policy)
                        replica.acceptance = observe(replica.acceptance, r.k, r.accepted, policy)
            if request.first_at is None:
                request.first_at = now
                stats.ttft.add(now - request.arrived)
                overall.ttft.add(now - request.arrived)
            else:
                gap = (now - request.last_at) / n
                stats.itl.add(gap, n)
                overall.itl.add(gap, n)
            request.last_at = now
            if r.finished:
                del self.requests[r.seq.request_id]
                replica.in_flight -= 1
                replica.mix.remove(request.decision)
                session = request.session
                self._push(now + session.rng.expovariate(1 / THINK_TIME_S), session)
        self._start_step(replica)
