"""The ``policy:`` section of config.yaml, parsed once into a frozen, validated object.

Every field is named exactly as in config.yaml. Validation errors name the field and the
value, so an operator's bad edit is rejected with a message that says what to fix; every field
and every rule is checked, so an edit with several mistakes gets a message for each
(``FieldError.problems``). The rules are ``rule_problems``, top to bottom.
"""

from __future__ import annotations

import difflib
import functools
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, TypeVar

from policies.methods import METHODS
from policies.tree import TreeShape, TreeShapeError

T = TypeVar("T")

EXCERPT_CHARS = 200  # error messages quote at most this much of a value
# A summary lists at most this many problems and counts the rest: a hostile body can hold
# thousands of unknown keys, and the summary is an HTTP answer and a log line.
MAX_LISTED_PROBLEMS = 10


def bounded_repr(value: object, limit: int = EXCERPT_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters.

    Error messages quote values that clients and operators sent; an unbounded repr of a huge
    (or alias-expanded) value would make the error itself the attack. An int too long for
    ``repr`` (Python refuses over 4300 digits) is described by its size instead.
    """
    try:
        text = repr(value)
    except ValueError:
        return f"<int of {value.bit_length() if isinstance(value, int) else '?'} bits>"
    except RecursionError:
        return "<too deeply nested to show>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def bounded_text(text: str, limit: int = EXCERPT_CHARS) -> str:
    """``text`` itself (no quotes), cut to ``limit`` characters: for names taken from input."""
    return text if len(text) <= limit else f"{text[:limit]}..."


class FieldError(ValueError):
    """A field of operator input failed validation; ``field`` and ``value`` say which and what.

    Parsers check every field, so that an edit with three mistakes is refused with three
    messages, not fixed one rerun at a time. They raise the first problem found, carrying all of
    them in ``problems`` (itself included): ``str()`` stays that one message, ``summary()``
    lists every one. The policy's errors and config.yaml's (gateway/config/errors.py) are both.
    """

    def __init__(self, message: str, field: str, value: object) -> None:
        super().__init__(message)
        self.field = field
        self.value = value
        self.problems: tuple[FieldError, ...] = (self,)

    def summary(self) -> str:
        """Every problem, one message each, joined by "; " (at most MAX_LISTED_PROBLEMS; the rest counted)."""
        listed = "; ".join(str(problem) for problem in self.problems[:MAX_LISTED_PROBLEMS])
        more = len(self.problems) - MAX_LISTED_PROBLEMS
        return listed if more <= 0 else f"{listed}; and {more} more"


def raise_problems(found: Iterable[FieldError]) -> None:
    """Raises the first of ``found`` (single problems: pass an error's ``problems``) carrying them
    all, each message once; returns if there is none."""
    unique: dict[str, FieldError] = {}
    for problem in found:
        unique.setdefault(str(problem), problem)
    if not unique:
        return
    listed = tuple(unique.values())
    for problem in listed:  # each one stands for itself again: only the first carries the list
        problem.problems = (problem,)
    listed[0].problems = listed
    raise listed[0]


class SectionError(FieldError):
    """A field of a config section failed validation: ``field`` (its dotted path) and ``value``."""

    def __init__(self, field: str, value: object, problem: str) -> None:
        field = bounded_text(field, 100)  # an unknown key is the file's text
        super().__init__(f"{field}: {problem} (got {bounded_repr(value)})", field, value)


class Problems:
    """Every field problem of one parse, in the order found.

    A parser reads each field through ``check``: a bad one is recorded and a stand-in (its
    default) returned, so parsing goes on to the next field; ``raise_any`` ends the parse with
    one error carrying them all (``FieldError.problems``).
    """

    def __init__(self) -> None:
        self.found: list[FieldError] = []

    def check(self, parse: Callable[[], T], stand_in: T) -> T:
        try:
            return parse()
        except FieldError as exc:
            self.found.extend(exc.problems)
            return stand_in

    def add(self, error: FieldError) -> None:
        self.found.extend(error.problems)

    def failed(self, field: str) -> bool:
        """Whether ``field`` has a problem already (a rule that reads it would only restate it)."""
        return any(problem.field == field for problem in self.found)

    def raise_any(self) -> None:
        raise_problems(self.found)


class PolicyConfigError(FieldError):
    """A policy field failed validation; ``field`` and ``value`` say which and what."""

    def __init__(self, field: str, value: object, problem: str) -> None:
        field = bounded_text(field, 100)  # an unknown key is the sender's text
        super().__init__(f"policy.{field}: {problem} (got {bounded_repr(value)})", field, value)


@dataclass(frozen=True)
class PolicyConfig:
    acceptance_floor: float = 0.60  # go plain when a session's acceptance estimate falls below this
    acceptance_resume: float = 0.70  # ...and resume speculation only once it is back above this
    min_proposals: int = 32  # drafted tokens of evidence before acceptance can trigger a fallback
    acceptance_half_life: float = 64.0  # tested drafts after which old evidence weighs half
    # The latch trips only once the estimate is below the floor by more than this many standard
    # errors (policies/acceptance.py): at 1.5, under 1% of sessions at α 0.70 are latched by bad
    # luck within 512 drafts, and 95% at α 0.45 within 96 (docs/policy.md). 0: the bare estimate.
    acceptance_latch_stderrs: float = 1.5
    # The cost model reads a session's α shrunk towards the worker's (or acceptance_resume) with
    # this many pseudo-drafts of weight: a Beta prior, so a session's first drafts move it gently.
    acceptance_prior_drafts: float = 16.0
    max_batch: int = 64  # plain while a worker's batch depth is above this
    batch_resume: int = 56  # ...and speculative again only once it is below this
    max_temperature: float = 0.8  # plain for requests sampled hotter than this
    probe_every: int = 8  # a low-acceptance session is re-probed with speculation every N requests
    # K, drafts proposed per step; "auto": per session, the K the worker's measured costs say
    # buys the most tokens per second (policies/cost.py)
    num_speculative_tokens: int | Literal["auto"] = 6
    min_gain: float = 0.05  # auto: a K must promise (1 + min_gain)x plain's throughput, else plain (no_gain)
    k_switch_gain: float = 0.05  # auto: a session keeps its K unless another promises (1 + this)x its throughput
    # At or below this batch depth a GPU step is memory-bound and drafting costs little, so even a
    # hot or low-acceptance session gains from speculating: the temperature and acceptance rules
    # wait until the batch is deeper (bench.policy, docs/sim.md). 0: those rules apply at any depth.
    # "auto": they wait wherever the worker's measured costs say this session's acceptance buys
    # min_gain at the worker's depth and mix (policies/cost.py) -- no depth read off a table.
    free_batch: int | Literal["auto"] = 0
    # Drafts per engine step across the batch: beyond it each sequence drafts
    # max(1, round(max_step_drafts / batch depth)) instead of K, because once the target's
    # verification is compute-bound every draft verified costs time. 0: no limit.
    max_step_drafts: int = 0
    # auto: the token trees a session may run instead of a chain, in TreeShape's notation
    # (policies/tree.py); each is priced on the worker's tree costs against every chain K and
    # plain (policies/tree_choice.py). Branching at the top, where a level is reached most often,
    # two children (rank 2 is worth most), depths 4-6 around the chain's best K, at most 22
    # nodes. Empty: chains only.
    tree_shapes: tuple[str, ...] = ("2+3", "2x2+2", "3+4", "2x2+4")
    # The prior for a rank r >= 2 the session has no evidence for: beta_r = this x beta_(r-1).
    # 0.70: the published 76.2% (5-token chain) and 84.8% (tree), read as accepted tokens per step / depth,
    # with the tree assumed 2x2+3: per-token alpha 0.911, and beta_2 = 0.70 x beta_1 (docs/sim.md)
    # (the published chain -> tree figures of issue #36).
    tree_rank_prior: float = 0.70
    # A tree priced on that prior (fewer than min_proposals rank-2 tests) runs at most every Nth request.
    tree_explore_every: int = 4
    # auto: a session keeps a chain (or plain) rather than a tree, or its tree rather than a chain or
    # another tree, unless the other promises (1 + this)x its throughput.
    tree_switch_gain: float = 0.05
    # The speculation methods a session may use (policies/methods.py): the draft model, prompt
    # lookup (ngram) and suffix matching (suffix). Per session, the one that promises the most
    # tokens per unit of time on the worker's costs, from that session's acceptance of each.
    methods: tuple[str, ...] = ("draft",)
    # A method the session has not tried is tried on at most every Nth request (its first try
    # is its only evidence); once tried it is priced on its own acceptance and coverage.
    method_explore_every: int = 2
    # Placing a request not bound to a worker (gateway/fleet/routing.py): the load guard first --
    # load alone decides while the most loaded worker is ahead of the least by more than
    # route_balance_abs and more than route_balance_rel times (SGLang's rule) -- then, where some
    # worker is expected to hold at least route_min_prefix_hit of the prompt, the best
    # route_prefix_weight x hit + route_load_weight x (1 - load / the highest load); else least loaded.
    route_prefix_weight: float = 3.0
    route_load_weight: float = 2.0
    route_min_prefix_hit: float = 0.1
    route_balance_abs: int = 4
    route_balance_rel: float = 1.5
    # Bounded loads (consistent hashing with bounded loads; HAProxy's hash-balance-factor): a worker
    # takes a session's next request (sticky) or a prefix-placed one only while its load after it
    # stays within route_load_factor x the fleet's mean load (counting that request) +
    # route_load_slack. The guard above needs a wide gap at shallow queues (4 ahead); this bound
    # holds the hotspot a cache-affine session mix makes. 0: no bound.
    route_load_factor: float = 2.0
    route_load_slack: float = 2.0
    route_index_blocks: int = 65536  # prompt blocks the gateway remembers per worker (LRU; 0: no prefix routing)
    # Method-aware placement: a session whose method (the draft model, or a lookup method) its
    # worker's in-flight requests disagree with moves to a worker within the load bound whose
    # in-flight requests agree with it by at least this many more (agreeing minus disagreeing).
    # One batch then runs one kind of step: a lookup step stops paying for the draft forwards of
    # the sequences beside it. 0: off (a session stays with its worker and its prefix cache).
    route_method_margin: int = 0

    def __post_init__(self) -> None:
        raise_problems(rule_problems(self.as_dict()))

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> PolicyConfig:
        """Builds from parsed YAML/JSON; missing keys take their defaults, unknown keys are errors.

        Every key and every rule is checked: the PolicyConfigError raised carries all problems.
        """
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise PolicyConfigError("(section)", raw, "must be a mapping of policy fields")
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        problems: list[PolicyConfigError] = []
        for key, value in raw.items():
            if key not in known:
                problems.append(PolicyConfigError(str(key), value, _unknown(str(key), known)))
                continue
            try:
                values[key] = _typed(key, value, str(known[key].type))
            except PolicyConfigError as exc:
                problems.append(exc)
        # A mistyped field is checked against no rule: it keeps its default here, and is ``bad``.
        defaults = {name: f.default for name, f in known.items()}
        problems.extend(rule_problems({**defaults, **values}, bad={problem.field for problem in problems}))
        raise_problems(problems)
        return cls(**values)

    @property
    def auto_k(self) -> bool:
        """K is chosen per session from the workers' measured costs (policies/cost.py)."""
        return self.num_speculative_tokens == "auto"

    @property
    def trees(self) -> tuple[TreeShape, ...]:
        """``tree_shapes`` parsed (validated at construction)."""
        return _shapes(self.tree_shapes)

    def as_dict(self) -> dict[str, float | int | str | tuple[str, ...]]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _unknown(key: str, known: Collection[str]) -> str:
    """An unknown field's problem: the known fields it is closest to (listing all of them would make
    each of a hostile body's thousands of problems a paragraph)."""
    close = difflib.get_close_matches(key[:100], list(known), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return f"unknown field; {hint}(the policy's fields: docs/config.md)"


AUTO_FIELDS = ("num_speculative_tokens", "free_batch")  # integer fields that also take "auto"
MAX_TREE_SHAPES = 8  # candidates per decision, and the bound on the metrics' tree label


@functools.lru_cache(maxsize=64)
def _shapes(texts: tuple[str, ...]) -> tuple[TreeShape, ...]:
    return tuple(TreeShape.parse(text) for text in texts)


def _typed(key: str, value: Any, expected: str) -> Any:
    """The value as its field's type (an int for a float field becomes a float); raises PolicyConfigError."""
    if key in AUTO_FIELDS and value == "auto":
        return value
    if key == "methods":
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise PolicyConfigError(key, value, f"must be a list of methods among {', '.join(METHODS)}")
        return tuple(value)
    if key == "tree_shapes":
        # YAML reads a one-level tree (3) as a number: its notation is its digits.
        if not isinstance(value, list | tuple) or not all(
                isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)) for v in value):
            raise PolicyConfigError(key, value, "must be a list of tree shapes like 2x2+3")
        return tuple(str(v) for v in value)
    if expected == "int" or key in AUTO_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise PolicyConfigError(key, value, "must be an integer")
    elif expected == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise PolicyConfigError(key, value, "must be a number")
        try:
            return float(value)
        except OverflowError:
            raise PolicyConfigError(key, value, "is too large") from None
    return value


def rule_problems(values: Mapping[str, Any], bad: Collection[str] = ()) -> list[PolicyConfigError]:
    """Every rule that ``values`` (every field, well typed) break: at most one problem per field.

    ``bad``: fields already refused, whose rules are skipped. A rule comparing two fields is
    checked only while the other one is valid: otherwise it would restate that field's problem.
    """
    found: dict[str, PolicyConfigError] = {}

    def valid(name: str) -> bool:
        return name not in bad and name not in found

    def require(holds: bool, name: str, problem: str) -> None:
        if valid(name) and not holds:
            found[name] = PolicyConfigError(name, values[name], problem)

    for name in ("acceptance_floor", "acceptance_resume"):
        require(0.0 <= values[name] <= 1.0, name, "must be between 0 and 1")
    floor = values["acceptance_floor"]
    if valid("acceptance_floor"):
        require(values["acceptance_resume"] >= floor, "acceptance_resume", f"must be >= acceptance_floor ({floor})")
    require(values["min_proposals"] >= 0, "min_proposals", "must be >= 0")
    half_life = values["acceptance_half_life"]
    require(half_life > 0 and math.isfinite(half_life), "acceptance_half_life",
            "must be a positive number of drafted tokens")
    stderrs = values["acceptance_latch_stderrs"]
    require(0 <= stderrs <= 10 and math.isfinite(stderrs), "acceptance_latch_stderrs", "must be in 0..10")
    prior_drafts = values["acceptance_prior_drafts"]
    require(0 <= prior_drafts <= 1e6 and math.isfinite(prior_drafts), "acceptance_prior_drafts",
            "must be a number of drafts in 0..1000000")
    max_batch = values["max_batch"]
    require(max_batch >= 1, "max_batch", "must be >= 1")
    if valid("max_batch"):
        require(1 <= values["batch_resume"] <= max_batch, "batch_resume", f"must be in 1..max_batch ({max_batch})")
    else:
        require(values["batch_resume"] >= 1, "batch_resume", "must be >= 1")
    temperature = values["max_temperature"]
    require(temperature >= 0 and math.isfinite(temperature), "max_temperature", "must be >= 0")
    require(values["probe_every"] >= 1, "probe_every", "must be >= 1")
    k = values["num_speculative_tokens"]
    require(k == "auto" or (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 16),
            "num_speculative_tokens", "must be in 1..16 or auto")
    for name in ("min_gain", "k_switch_gain"):
        require(0.0 <= values[name] <= 1.0, name, "must be between 0 and 1")
    free_batch = values["free_batch"]
    require(free_batch == "auto" or (isinstance(free_batch, int) and free_batch >= 0), "free_batch",
            "must be >= 0 or auto")
    require(values["max_step_drafts"] >= 0, "max_step_drafts", "must be >= 0")
    require(0.0 <= values["tree_rank_prior"] <= 1.0, "tree_rank_prior", "must be between 0 and 1")
    require(values["tree_explore_every"] >= 1, "tree_explore_every", "must be >= 1")
    require(0.0 <= values["tree_switch_gain"] <= 1.0, "tree_switch_gain", "must be between 0 and 1")
    problem = _tree_shapes_problem(values["tree_shapes"])
    require(problem is None, "tree_shapes", problem or "")
    require(values["method_explore_every"] >= 1, "method_explore_every", "must be >= 1")
    for name in ("route_prefix_weight", "route_load_weight"):
        require(0.0 <= values[name] <= 1000.0, name, "must be in 0..1000")
    require(0.0 <= values["route_min_prefix_hit"] <= 1.0, "route_min_prefix_hit", "must be between 0 and 1")
    require(values["route_balance_abs"] >= 0, "route_balance_abs", "must be >= 0")
    require(values["route_balance_rel"] >= 1.0 and math.isfinite(values["route_balance_rel"]), "route_balance_rel",
            "must be >= 1")
    require(values["route_load_factor"] == 0.0 or 1.0 <= values["route_load_factor"] <= 1000.0, "route_load_factor",
            "must be 0 (no bound) or in 1..1000")
    # At least one: a worker may always hold one request more than the mean, so an idle fleet's
    # sessions stay sticky and the least-loaded worker is within every bound.
    require(1.0 <= values["route_load_slack"] <= 1000.0, "route_load_slack", "must be in 1..1000")
    require(0 <= values["route_index_blocks"] <= 1 << 24, "route_index_blocks", "must be in 0..16777216")
    require(0 <= values["route_method_margin"] <= 1000, "route_method_margin", "must be in 0..1000")
    problem = _methods_problem(values["methods"])
    require(problem is None, "methods", problem or "")
    return list(found.values())


def _methods_problem(names: Any) -> str | None:
    """What is wrong with ``methods`` (None: nothing)."""
    if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
        return f"must be a list of methods among {', '.join(METHODS)}"
    if not names:
        return f"must list at least one method among {', '.join(METHODS)}"
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        return f"unknown method {bounded_text(unknown[0], 40)!r}; known: {', '.join(METHODS)}"
    if len(set(names)) != len(names):
        return "lists a method twice"
    return None


def _tree_shapes_problem(texts: Any) -> str | None:
    """What is wrong with ``tree_shapes`` (None: nothing)."""
    if not isinstance(texts, tuple) or not all(isinstance(t, str) for t in texts):
        return "must be a list of tree shapes like 2x2+3"
    if len(texts) > MAX_TREE_SHAPES:
        return f"at most {MAX_TREE_SHAPES} shapes"
    seen: set[TreeShape] = set()
    for text in texts:
        try:
            shape = TreeShape.parse(text)
        except TreeShapeError as exc:
            return str(exc)
        if shape.is_chain:
            return f"{text!r:.40} is a chain: chains are chosen by K, list trees only"
        if shape in seen:
            return f"{text!r:.40} is listed twice"
        seen.add(shape)
    return None
