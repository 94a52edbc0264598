"""The pipeline's parts: a request's scheduling cycle, the plugin roles, a profile, the pipeline.

A profile lists its plugins in order. Filters narrow the endpoints; ordered rules (specgate's
addition to GIE's roles: the rules a weighted sum does not express) may settle the placement
with their reason, or say that load alone places it; the scorers' weighted sum then goes to the
picker. Each run of the pipeline is one ``Cycle``: the plugins read the request's features and
the fleet's snapshot from it, and leave what later plugins need (the prefix hits, the load
guard's hotspots) in it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from policies import Method, Mode
from workers.api.wire import CompletionRequest

RouteReason = Literal["sticky", "prefix", "load", "method"]
ROUTE_REASONS: tuple[RouteReason, ...] = ("sticky", "prefix", "load", "method")
# What a session's requests run, for method-aware placement: the draft model's steps or a
# lookup method's (None: plain, or not known yet).
StepKind = Literal["draft", "lookup"]
Role = Literal["filter", "rule", "scorer", "picker", "handler"]
BOTH_MODES: frozenset[Mode] = frozenset({"speculative", "plain"})
# A plugin's parameters: name -> (kind: int, float or str; default; minimum; maximum).
Parameters = Mapping[str, tuple[type, Any, float | None, float | None]]
Choices = Mapping[str, tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker in the fleet's snapshot."""

    worker_id: str
    ready: bool
    load: int  # running + queued sequences (the worker's report, or the gateway's in-flight count)
    modes: frozenset[Mode]
    drafting: int = 0  # the gateway's requests in flight there that run the draft model
    looking: int = 0  # ...and that run a lookup method
    methods: tuple[Method, ...] = ("draft",)  # the speculation methods it offers
    prefix_cache: bool | None = None  # False: it says it keeps no prompt K/V (None: unknown)


@dataclass(frozen=True, slots=True)
class Route:
    worker_id: str  # the session's worker: sticky while ready, else the pipeline's pick
    # Where that worker serves one mode only: the least-loaded ready worker serving the other
    # (None when it serves both, or no ready worker serves the other).
    other_id: str | None = None
    reason: RouteReason = "load"


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """What the pipeline knows of a request."""

    session_worker: str | None  # the session's worker, if it has one
    kind: StepKind | None = None  # what the session's requests run (method-aware placement)
    request: CompletionRequest | None = None  # its prompt (the prefix scorer's blocks)


@dataclass(slots=True)
class Cycle:
    """One placement: the request, the ready workers in listed order, and what plugins leave."""

    features: RequestFeatures
    ready: tuple[Candidate, ...]
    most: int  # the highest load among the ready workers
    bound: float = float("inf")  # the load bound (load-bound-filter)
    hotspots: frozenset[str] = frozenset()  # the load guard's: workers load alone moves requests off
    load_only: bool = False  # an ordered rule said load alone places this request
    blocks: tuple[int, ...] = ()  # the prompt's prefix blocks (prefix-cache-scorer)
    shares: dict[str, float] = field(default_factory=dict)  # of them, seen sent to each worker before
    hits: dict[str, float] = field(default_factory=dict)  # ...times what each worker holds: expected hits

    def own(self, endpoints: Sequence[Candidate]) -> Candidate | None:
        """The session's worker among ``endpoints``, if it is there."""
        current = self.features.session_worker
        if current is None:
            return None
        return next((c for c in endpoints if c.worker_id == current), None)


@dataclass(frozen=True, slots=True)
class Settled:
    endpoint: Candidate
    reason: RouteReason


class Plugin:
    """A plugin: its type (the config's ``type``), its role, its name (``name``, default the
    type), and its parameters, checked by ``configure`` (which a reload calls again on the same
    instance, so a plugin keeps its state)."""

    type_name: ClassVar[str]
    role: ClassVar[Role]
    parameters: ClassVar[Parameters] = {}
    choices: ClassVar[Choices] = {}  # a str parameter's allowed values

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def wants_kind(self) -> bool:
        """Whether it reads the session's kind of step (``RequestFeatures.kind``)."""
        return False

    def configure(self, values: Mapping[str, Any]) -> None:
        """Takes checked parameter values (``config.parse_routing``), each set or defaulted."""
        for key, value in values.items():
            setattr(self, key, value)


class Filter(Plugin):
    role = "filter"

    def filter(self, cycle: Cycle, endpoints: list[Candidate]) -> list[Candidate]:
        raise NotImplementedError


class Rule(Plugin):
    role = "rule"

    def apply(self, cycle: Cycle, endpoints: list[Candidate]) -> Settled | None:
        """Settles the placement with a reason, or None to let the profile go on (it may set
        ``cycle.load_only``)."""
        raise NotImplementedError


class Scorer(Plugin):
    role = "scorer"

    def pre_cycle(self, cycle: Cycle) -> None:
        """Before the profile runs: what the scorer's state says of this request (once a cycle)."""

    def score(self, cycle: Cycle, endpoints: list[Candidate]) -> list[float]:
        """One score in [0, 1] per endpoint, in their order."""
        raise NotImplementedError


class Picker(Plugin):
    role = "picker"

    def pick(self, cycle: Cycle, endpoints: list[Candidate], scores: list[float]) -> Settled:
        raise NotImplementedError


class ProfileHandler(Plugin):
    role = "handler"

    def choose(self, cycle: Cycle, profiles: Mapping[str, Profile]) -> Profile:
        raise NotImplementedError


def least_loaded(endpoints: Sequence[Candidate]) -> Candidate:
    """The least-loaded endpoint; ties go to the first listed, so routing is deterministic."""
    return min(endpoints, key=_load)


def _load(candidate: Candidate) -> int:
    return candidate.load


@dataclass(frozen=True)
class Profile:
    """A scheduling profile: its filters and rules in order, its weighted scorers, its picker."""

    name: str
    stages: tuple[Filter | Rule, ...]
    scorers: tuple[tuple[Scorer, float], ...]
    picker: Picker
    # Derived once (the request path's hot loop, bench.overhead): each stage's bound method and
    # whether it filters, the scorers with a pre-cycle step, and the weighted ones.
    _steps: tuple[tuple[Any, bool], ...] = field(init=False, repr=False, compare=False)
    _pre_cycle: tuple[Any, ...] = field(init=False, repr=False, compare=False)
    _weighted: tuple[tuple[Any, float], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        steps = tuple((s.filter, True) if isinstance(s, Filter) else (s.apply, False) for s in self.stages)
        object.__setattr__(self, "_steps", steps)
        object.__setattr__(self, "_pre_cycle", tuple(
            s.pre_cycle for s, _ in self.scorers if type(s).pre_cycle is not Scorer.pre_cycle))
        object.__setattr__(self, "_weighted", tuple((s.score, w) for s, w in self.scorers if w))

    def run(self, cycle: Cycle) -> Settled | None:
        endpoints = list(cycle.ready)
        for pre_cycle in self._pre_cycle:
            pre_cycle(cycle)
        for step, filters in self._steps:
            if filters:
                endpoints = step(cycle, endpoints)
                if not endpoints:
                    return None
                continue
            settled: Settled | None = step(cycle, endpoints)
            if settled is not None:
                return settled
        if cycle.load_only:
            return Settled(least_loaded(endpoints), "load")
        totals = [0.0] * len(endpoints)
        for score, weight in self._weighted:
            for i, value in enumerate(score(cycle, endpoints)):
                totals[i] += weight * value
        return self.picker.pick(cycle, endpoints, totals)


@dataclass(frozen=True)
class Placed:
    """The pipeline's answer: the route and the cycle that chose it (its hits, bound, hotspots)."""

    route: Route
    cycle: Cycle


class Pipeline:
    """Plugins by name, profiles by name and the handler that picks one per request."""

    def __init__(self, plugins: Mapping[str, Plugin], profiles: Mapping[str, Profile],
                 handler: ProfileHandler) -> None:
        self.plugins, self.profiles, self.handler = dict(plugins), dict(profiles), handler
        self._pre_request = [p for p in self.plugins.values() if hasattr(p, "pre_request")]
        self._post_response = [p for p in self.plugins.values() if hasattr(p, "post_response")]
        self._forget = [p for p in self.plugins.values() if hasattr(p, "forget")]
        # Whether a profile places by the session's kind of step (placement then decides the
        # session's method on its own worker first: gateway/placement.py).
        self.wants_kind = any(stage.wants_kind for profile in self.profiles.values()
                              for stage in (*profile.stages, *(s for s, w in profile.scorers if w)))

    def place(self, features: RequestFeatures, candidates: Sequence[Candidate],
              hits: Mapping[str, float] | None = None) -> Placed | None:
        """Where the request goes and why, among the ready ``candidates``; None when none is ready
        (or a profile's filters left none). ``hits``: each worker's expected prefix hit where
        the caller knows it (else the prefix scorer's index says)."""
        ready = tuple(c for c in candidates if c.ready)
        if not ready:
            return None
        cycle = Cycle(features, ready, max(c.load for c in ready))
        if hits:
            cycle.hits.update(hits)
        settled = self.handler.choose(cycle, self.profiles).run(cycle)
        if settled is None:
            return None
        return Placed(_paired(settled, ready), cycle)

    def plugin(self, kind: type[Plugin]) -> Plugin | None:
        """The first configured plugin of a type (``prefix-cache-scorer``'s index, for the admin view)."""
        return next((p for p in self.plugins.values() if isinstance(p, kind)), None)

    def pre_request(self, cycle: Cycle, worker_id: str) -> None:
        """The request goes to ``worker_id`` (the placement's last stage may have moved it)."""
        for plugin in self._pre_request:
            plugin.pre_request(cycle, worker_id)

    def post_response(self, worker_id: str, share: float, prompt_tokens: int, cached_tokens: int) -> None:
        """What a worker reported of a request placed there when ``share`` of its prompt was expected
        cached: ``cached_tokens`` of its ``prompt_tokens`` came from its cache."""
        for plugin in self._post_response:
            plugin.post_response(worker_id, share, prompt_tokens, cached_tokens)

    def forget(self, worker_id: str) -> None:
        """A worker left the fleet (or restarted empty): plugins drop what they kept of it."""
        for plugin in self._forget:
            plugin.forget(worker_id)


def _paired(settled: Settled, ready: Sequence[Candidate]) -> Route:
    """The mode pair: where the chosen worker serves one fixed mode, the least-loaded ready worker
    serving the other rides along (``Route.other_id``), so placement can send the request where
    the mode the rules want runs."""
    chosen = settled.endpoint
    if len(chosen.modes) != 1:  # both modes (or none: it runs what it can, worker_plain_only)
        return Route(chosen.worker_id, reason=settled.reason)
    missing = next(iter(BOTH_MODES - chosen.modes))
    serving = [c for c in ready if c is not chosen and missing in c.modes]
    other = least_loaded(serving) if serving else None
    return Route(chosen.worker_id, other.worker_id if other is not None else None, settled.reason)

