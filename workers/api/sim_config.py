"""The ``workers.sim`` section (config.yaml, or a sim worker's ``--sim-config``): the simulated
deployment's description (``SimConfig``: model shapes, hardware, efficiencies, acceptance
table) and its parser.

Why here, in the layer the gateway imports: the gateway validates this section at start (a bad
field exits non-zero naming it) and hands it to the sim workers it starts, so, like the request
schema, it is a contract between the two sides. It is pure data and its parsing, no clock and
no I/O; the model that steps batches on it stays with the engine (``workers/engines/sim/roofline.py``).

Every bad field is reported, not the first: each is read through ``_Problems.check``, which
records the error and goes on with the default, and the parse ends with one ``SimConfigError``
whose ``problems`` lists them all (the gateway turns each into a ``ConfigError``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from policies.tree import MAX_TREE_NODES

# -- the deployment it models ---------------------------------------------------------------------
PUBLISHED_K = 5  # the deployment's num_speculative_tokens; its acceptance rates are quoted at this K


@dataclass(frozen=True)
class ModelShape:
    params: float  # parameters
    bytes_per_param: float = 2.0  # bf16
    kv_bytes_per_token: float = 0.0  # K and V, all layers

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param


# Llama-3.3-70B: 80 layers, 8 KV heads of 128 (GQA): 80 × 2 × 8 × 128 × 2 bytes per token.
LLAMA_70B = ModelShape(70.55e9, 2.0, 80 * 2 * 8 * 128 * 2)
# Llama-3.2-1B: 16 layers, 8 KV heads of 64.
LLAMA_1B = ModelShape(1.236e9, 2.0, 16 * 2 * 8 * 64 * 2)


@dataclass(frozen=True)
class Hardware:
    gpus: int = 4  # tensor parallel degree of one replica (one worker)
    bandwidth_gb_s: float = 3350.0  # per GPU, datasheet (H100 SXM HBM3)
    peak_tflops: float = 989.0  # per GPU, datasheet dense bf16 (H100 SXM)


@dataclass(frozen=True)
class Efficiency:
    """What the deployment achieves of the datasheet. The first three are fitted to the published
    facts (``fit_efficiency``; python -m bench.sim_fit); ``prefill_flops_fraction`` is assumed."""

    bandwidth_fraction: float = 0.398
    flops_fraction: float = 0.0936
    forward_overhead_ms: float = 2.89  # per forward pass: launches, TP all-reduce latency, scheduling
    # Prefill runs large GEMMs, far closer to peak than the small-token decode path the fit sees.
    prefill_flops_fraction: float = 0.4


@dataclass(frozen=True)
class Facts:
    """The published figures the efficiencies are fitted to (docs/sim.md)."""

    plain_tok_s_b1: float = 34.0  # tokens/s per stream, plain, batch 1
    spec_tok_s_b1: float = 109.0  # tokens/s per stream, K=5, at ``rate``
    rate: float = 0.814  # the acceptance behind spec_tok_s_b1 (vLLM's accepted/proposed: the code figure)
    k: int = PUBLISHED_K
    breakeven_batch: int = 64  # speculation's gain falls to 1.0 here (at ``rate``)
    context: int = 1024  # tokens in each sequence's KV cache for these figures (assumed)


# -- acceptance -------------------------------------------------------------------------------------
def vllm_rate(alpha: float, k: int) -> float:
    """vLLM's ``spec_decode_draft_acceptance_rate`` (accepted / proposed) for per-token α at K:
    E[accepted] = α + α² + … + α^K = α(1 − α^K)/(1 − α), over K proposed."""
    if alpha >= 1.0:
        return 1.0
    return alpha * (1.0 - alpha ** k) / (k * (1.0 - alpha))


def alpha_from_rate(rate: float, k: int = PUBLISHED_K) -> float:
    """Inverts ``vllm_rate`` (increasing in α) by bisection."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"acceptance rate must be in [0, 1], got {rate}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if vllm_rate(mid, k) < rate else (lo, mid)
    return (lo + hi) / 2


Bands = tuple[tuple[float, float], ...]  # ((max temperature, per-token α), ...), ascending


def _published(low: float, mid: float, high: float) -> Bands:
    return ((0.3, alpha_from_rate(low)), (0.8, alpha_from_rate(mid)), (math.inf, alpha_from_rate(high)))


# Rates (vLLM's accepted/proposed at K=5) → per-token α. Low-temperature json/code/math are the
# deployment's published figures; "above 0.8, below 0.5" is published for all; the rest assumed
# (docs/sim.md). Reasoning (math) at mid temperature is set to α = 0.6 directly (issue #10).
DEFAULT_ACCEPTANCE: Mapping[str, Bands] = {
    "json": _published(0.882, 0.75, 0.45),
    "code": _published(0.814, 0.70, 0.45),
    "math": ((0.3, alpha_from_rate(0.647)), (0.8, 0.60), (math.inf, alpha_from_rate(0.40))),
    "chat": _published(0.60, 0.50, 0.40),
    # The lookup methods' workloads (issue #43). No draft figure is published for them: an agent's
    # tool calls and a code edit are taken to draft as code does, a RAG answer and a summary of a
    # long document as chat does (assumed; docs/sim.md, "Methods").
    "agent": _published(0.814, 0.70, 0.45),
    "code_edit": _published(0.814, 0.70, 0.45),
    "rag": _published(0.60, 0.50, 0.40),
    "summary": _published(0.60, 0.50, 0.40),
}


# -- lookup methods (prompt lookup, suffix match; policies/methods.py) ---------------------------------
@dataclass(frozen=True)
class LookupCell:
    """A lookup method on one workload: how often a step finds a match, and how well its point-mass
    proposals pass (per-token α by temperature band, as the draft's)."""

    coverage: float  # share of steps that propose anything; the rest are plain steps
    bands: Bands


# Published speed-ups over plain (vLLM on GPUs, tokens/s at T=0; issue #43): ShareGPT chat, HumanEval
# code, SWE-Bench agent, for n-gram and suffix decoding.
PUBLISHED_LOOKUP_SPEEDUP: Mapping[str, Mapping[str, float]] = {
    "ngram": {"chat": 91 / 76, "code": 100 / 77, "agent": 175 / 76},
    "suffix": {"chat": 113 / 76, "code": 148 / 77, "agent": 286 / 76},
}
# One equation per cell, two unknowns: the coverage is assumed (the share of the output a lookup can
# find: little in open chat, most of an agent's repeated tool output; suffix, which also searches
# earlier outputs, finds more), and α is fitted to the speed-up.
ASSUMED_LOOKUP_COVERAGE: Mapping[str, Mapping[str, float]] = {
    "ngram": {"chat": 0.30, "code": 0.40, "agent": 0.70},
    "suffix": {"chat": 0.45, "code": 0.60, "agent": 0.90},
}
LOOKUP_SUMMARY_RATE = 0.065  # long-document summaries: 5-8% acceptance (vLLM's rate) for lookup
LOOKUP_SUMMARY_COVERAGE = 0.9  # assumed: a long document matches nearly everywhere, mostly wrongly
# Above T=0.3 a point mass passes less often (p(x) flattens): α × these, per band (assumed; hot
# sampling is where lookup loses, and the policy's temperature rule sends it plain first).
LOOKUP_TEMPERATURE_FACTORS = (1.0, 0.85, 0.5)


def lookup_speedup(alpha: float, coverage: float, k: int = PUBLISHED_K) -> float:
    """Tokens per step over plain at batch 1, where the sim's verification of K + 1 tokens costs a
    plain step (memory-bound: docs/sim.md) and a lookup costs nothing: c·(E(α, K) − 1) + 1."""
    emitted = k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return coverage * (emitted - 1.0) + 1.0


def fit_lookup_alpha(speedup: float, coverage: float, k: int = PUBLISHED_K) -> float:
    """The α at which ``lookup_speedup`` meets ``speedup`` (bisection; 1.0 where even α = 1 falls short)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if lookup_speedup(mid, coverage, k) < speedup else (lo, mid)
    return (lo + hi) / 2


def _lookup_cell(alpha: float, coverage: float) -> LookupCell:
    bands = tuple((max_t, alpha * f) for max_t, f in zip((0.3, 0.8, math.inf), LOOKUP_TEMPERATURE_FACTORS,
                                                            strict=True))
    return LookupCell(coverage, bands)


def _default_lookup() -> dict[str, dict[str, LookupCell]]:
    out: dict[str, dict[str, LookupCell]] = {}
    for method, speedups in PUBLISHED_LOOKUP_SPEEDUP.items():
        coverage = ASSUMED_LOOKUP_COVERAGE[method]
        cells = {c: _lookup_cell(fit_lookup_alpha(s, coverage[c]), coverage[c]) for c, s in speedups.items()}
        # Assumed, not published: a code edit repeats its input as SWE-Bench's agent does; a RAG
        # answer sits halfway between code and the agent (coverage and speed-up both); json drafts
        # as code, math as chat.
        rag_c = (coverage["code"] + coverage["agent"]) / 2
        rag_s = (speedups["code"] + speedups["agent"]) / 2
        cells |= {"code_edit": cells["agent"], "rag": _lookup_cell(fit_lookup_alpha(rag_s, rag_c), rag_c),
                  "json": cells["code"], "math": cells["chat"],
                  "summary": _lookup_cell(alpha_from_rate(LOOKUP_SUMMARY_RATE), LOOKUP_SUMMARY_COVERAGE)}
        out[method] = cells
    return out


DEFAULT_LOOKUP: Mapping[str, Mapping[str, LookupCell]] = _default_lookup()


def _band_alpha(bands: Bands, temperature: float) -> float:
    for max_t, alpha in bands:
        if temperature <= max_t:
            return alpha
    return bands[-1][1]


@dataclass(frozen=True)
class AcceptanceTable:
    bands: Mapping[str, Bands] = field(default_factory=lambda: dict(DEFAULT_ACCEPTANCE))
    default_category: str = "chat"  # prompts without a tag
    # Per lookup method, per category (a category it lacks: the default category's, else chat's).
    lookup: Mapping[str, Mapping[str, LookupCell]] = field(default_factory=lambda: dict(DEFAULT_LOOKUP))

    def alpha(self, category: str, temperature: float) -> float:
        """The draft model's per-token α."""
        return _band_alpha(self.bands.get(category) or self.bands[self.default_category], temperature)

    def lookup_cell(self, method: str, category: str) -> LookupCell:
        cells = self.lookup.get(method) or DEFAULT_LOOKUP[method]
        return (cells.get(category) or cells.get(self.default_category) or cells.get("chat")
                or next(iter(cells.values())))

    def lookup_alpha(self, method: str, category: str, temperature: float) -> tuple[float, float]:
        """A lookup method's (per-token α, coverage) on ``category`` at ``temperature``."""
        cell = self.lookup_cell(method, category)
        return _band_alpha(cell.bands, temperature), cell.coverage

    def category(self, text: str) -> str:
        """The first ``[json]``/``[code]``/``[math]``/``[chat]``/``[agent]``... tag (any key of the
        draft's or a lookup method's table) in the prompt's text, else ``default_category``. A
        chat's text is its rendered messages, so a tag anywhere in a message counts. Unknown to the
        draft's table (a config that lists its own bands), a category drafts as the default's."""
        names = dict.fromkeys([*self.bands, *(c for cells in self.lookup.values() for c in cells)])
        match = re.search(r"\[(" + "|".join(map(re.escape, names)) + r")\]", text, re.IGNORECASE)
        return match.group(1).lower() if match else self.default_category


# -- the configuration ------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimConfig:
    target: ModelShape = LLAMA_70B
    draft: ModelShape | None = LLAMA_1B  # None: the deployment cannot speculate
    hardware: Hardware = field(default_factory=Hardware)
    efficiency: Efficiency = field(default_factory=Efficiency)
    acceptance: AcceptanceTable = field(default_factory=AcceptanceTable)
    # Real seconds per simulated second: 1 runs at the modelled speed; 0 answers at once.
    time_scale: float = 1.0
    seed: int = 0  # output tokens and acceptance draws of requests without their own seed
    context_window: int = 8192
    # The most draft nodes of a token tree a step verifies (policies.tree); 0: chains only.
    tree_max_nodes: int = MAX_TREE_NODES
    # Tokens of KV a worker keeps for prefix reuse (workers/engines/sim/prefix_cache.py); 0: off,
    # every request prefills its whole prompt. Off by default so existing sim figures stand.
    prefix_cache_tokens: int = 0

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> SimConfig:
        """From config.yaml's ``workers.sim`` (or ``--sim-config``); errors name the field."""
        return parse(raw or {})


# -- parsing ----------------------------------------------------------------------------------------------
class SimConfigError(ValueError):
    """A bad ``workers.sim`` field. ``problems`` lists every bad field of the parse that raised
    it (this one first), so ``specgate check`` can name them all."""

    def __init__(self, field: str, value: object, problem: str) -> None:
        super().__init__(f"{field}: {problem} (got {value!r})")
        self.field, self.value, self.problem = field, value, problem
        self.problems: list[SimConfigError] = [self]

T = TypeVar("T")


class _Problems:
    """Collects the parse's bad fields: each is read through ``check``, which records its
    error and returns a stand-in (the default), so the parse goes on to the next field."""

    def __init__(self) -> None:
        self.found: list[SimConfigError] = []

    def check(self, parse: Callable[[], T], stand_in: T) -> T:
        try:
            return parse()
        except SimConfigError as exc:
            self.found.extend(exc.problems)
            return stand_in

    def add(self, field: str, value: object, problem: str) -> None:
        self.found.append(SimConfigError(field, value, problem))

    def raise_any(self) -> None:
        if self.found:
            first = self.found[0]
            first.problems = list(self.found)
            raise first


def _number(raw: Mapping[str, Any], name: str, default: float, prefix: str, positive: bool = True) -> float:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SimConfigError(f"{prefix}{name}", value, "must be a number")
    if value < 0 or (positive and value == 0):
        raise SimConfigError(f"{prefix}{name}", value, "must be > 0" if positive else "must be >= 0")
    return float(value)


def _mapping(raw: Mapping[str, Any], name: str, allowed: set[str], problems: _Problems) -> Mapping[str, Any]:
    """The sub-mapping ``name`` without its unknown keys (each recorded); {} if not a mapping."""
    value = raw.get(name) or {}
    if not isinstance(value, Mapping):
        problems.add(name, value, "must be a mapping")
        return {}
    for key in value:
        if key not in allowed:
            problems.add(f"{name}.{key}", value[key], f"unknown field; known: {', '.join(sorted(allowed))}")
    return {k: v for k, v in value.items() if k in allowed}


def _shape(raw: Mapping[str, Any], name: str, default: ModelShape, problems: _Problems) -> ModelShape:
    m = _mapping(raw, name, {"params", "bytes_per_param", "kv_bytes_per_token"}, problems)
    p = f"{name}."
    return ModelShape(
        problems.check(lambda: _number(m, "params", default.params, p), default.params),
        problems.check(lambda: _number(m, "bytes_per_param", default.bytes_per_param, p), default.bytes_per_param),
        problems.check(lambda: _number(m, "kv_bytes_per_token", default.kv_bytes_per_token, p, positive=False),
                       default.kv_bytes_per_token))


def _integer(raw: Mapping[str, Any], name: str, default: int, problems: _Problems, minimum: int | None = None,
             prefix: str = "") -> int:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        problems.add(f"{prefix}{name}", value, "must be an integer" + ("" if minimum is None else f" >= {minimum}"))
        return default
    return value


def parse(raw: Mapping[str, Any]) -> SimConfig:
    if not isinstance(raw, Mapping):
        raise SimConfigError("(section)", raw, "must be a mapping")
    problems = _Problems()
    known = {"target", "draft", "hardware", "efficiency", "acceptance", "default_category", "time_scale", "seed",
             "context_window", "tree_max_nodes", "lookup", "prefix_cache_tokens"}
    for key in raw:
        if key not in known:
            problems.add(str(key), raw[key], f"unknown field; known: {', '.join(sorted(known))}")
    d = SimConfig()
    h = _mapping(raw, "hardware", {"gpus", "bandwidth_gb_s", "peak_tflops"}, problems)
    hardware = Hardware(
        _integer(h, "gpus", d.hardware.gpus, problems, minimum=1, prefix="hardware."),
        problems.check(lambda: _number(h, "bandwidth_gb_s", d.hardware.bandwidth_gb_s, "hardware."),
                       d.hardware.bandwidth_gb_s),
        problems.check(lambda: _number(h, "peak_tflops", d.hardware.peak_tflops, "hardware."),
                       d.hardware.peak_tflops))
    e = _mapping(raw, "efficiency", set(vars(d.efficiency)), problems)
    def efficiency_field(name: str, default: float) -> float:
        return problems.check(lambda: _number(e, name, default, "efficiency.", positive=name != "forward_overhead_ms"),
                              default)
    efficiency = Efficiency(**{name: efficiency_field(name, default) for name, default in vars(d.efficiency).items()})
    acceptance = d.acceptance
    if "acceptance" in raw:
        acceptance = replace(acceptance, bands=problems.check(lambda: _bands(raw["acceptance"]), acceptance.bands))
    if "lookup" in raw:
        acceptance = replace(acceptance, lookup=problems.check(lambda: _lookup(raw["lookup"]), acceptance.lookup))
    category = raw.get("default_category", acceptance.default_category)
    if category not in acceptance.bands:  # the draft's table: every category drafts as some row of it
        problems.add("default_category", category, f"must be one of {', '.join(acceptance.bands)}")
        category = acceptance.default_category
    seed = _integer(raw, "seed", 0, problems)
    window = _integer(raw, "context_window", d.context_window, problems, minimum=16)
    tree_nodes = _integer(raw, "tree_max_nodes", d.tree_max_nodes, problems, minimum=0)
    if tree_nodes > MAX_TREE_NODES:
        problems.add("tree_max_nodes", tree_nodes, f"must be at most {MAX_TREE_NODES}")
        tree_nodes = d.tree_max_nodes
    prefix_tokens = _integer(raw, "prefix_cache_tokens", d.prefix_cache_tokens, problems, minimum=0)
    draft = (None if "draft" in raw and raw["draft"] is None
             else _shape(raw, "draft", LLAMA_1B, problems))
    config = SimConfig(_shape(raw, "target", d.target, problems), draft, hardware, efficiency,
                       replace(acceptance, default_category=category),
                       problems.check(lambda: _number(raw, "time_scale", d.time_scale, "", positive=False),
                                      d.time_scale), seed, window, tree_nodes, prefix_tokens)
    problems.raise_any()
    return config


def _bands(raw: Any) -> Mapping[str, Bands]:
    """``{category: [[max_temperature | null, alpha], ...]}``; null (or .inf) means any temperature."""
    if not isinstance(raw, Mapping) or not raw:
        raise SimConfigError("acceptance", raw, "must be a non-empty mapping of category to bands")
    out: dict[str, Bands] = {}
    for category, bands in raw.items():
        name = f"acceptance.{category}"
        if not isinstance(category, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", category):
            raise SimConfigError(name, category, "category names are lowercase words")
        if not isinstance(bands, list) or not bands:
            raise SimConfigError(name, bands, "must be a list of [max_temperature, alpha] pairs")
        parsed = []
        for band in bands:
            ok = isinstance(band, list | tuple) and len(band) == 2
            max_t, alpha = band if ok else (None, None)
            max_t = math.inf if max_t is None else max_t
            if (not ok or isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= 1
                    or isinstance(max_t, bool) or not isinstance(max_t, int | float)):
                raise SimConfigError(name, band, "each band is [max_temperature (or null), alpha in 0..1]")
            parsed.append((float(max_t), float(alpha)))
        if parsed != sorted(parsed):
            raise SimConfigError(name, bands, "bands must be in ascending max_temperature")
        out[category] = tuple(parsed)
    return out


def _lookup(raw: Any) -> Mapping[str, Mapping[str, LookupCell]]:
    """``{method: {category: {coverage: c, acceptance: bands}}}`` over the defaults: a cell given
    replaces that cell (its ``acceptance`` as ``_bands`` reads a category's), the rest stay."""
    if not isinstance(raw, Mapping):
        raise SimConfigError("lookup", raw, "must be a mapping of method to categories")
    out = {method: dict(cells) for method, cells in DEFAULT_LOOKUP.items()}
    for method, cells in raw.items():
        if method not in out:
            raise SimConfigError(f"lookup.{method}", cells, f"unknown lookup method; known: {', '.join(out)}")
        if not isinstance(cells, Mapping):
            raise SimConfigError(f"lookup.{method}", cells, "must be a mapping of category to a cell")
        for category, cell in cells.items():
            name = f"lookup.{method}.{category}"
            if not isinstance(cell, Mapping) or set(cell) != {"coverage", "acceptance"}:
                raise SimConfigError(name, cell, "must be {coverage: 0..1, acceptance: [[max_t, alpha], ...]}")
            coverage = cell["coverage"]
            if isinstance(coverage, bool) or not isinstance(coverage, int | float) or not 0 <= coverage <= 1:
                raise SimConfigError(f"{name}.coverage", coverage, "must be a number in 0..1")
            try:
                bands = _bands({category: cell["acceptance"]})[category]
            except SimConfigError as exc:
                raise SimConfigError(f"{name}.acceptance", exc.value, exc.problem) from None
            out[method][category] = LookupCell(float(coverage), bands)
    return out
