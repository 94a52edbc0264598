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
}


@dataclass(frozen=True)
class AcceptanceTable:
    bands: Mapping[str, Bands] = field(default_factory=lambda: dict(DEFAULT_ACCEPTANCE))
    default_category: str = "chat"  # prompts without a tag

    def alpha(self, category: str, temperature: float) -> float:
        bands = self.bands.get(category) or self.bands[self.default_category]
        for max_t, alpha in bands:
            if temperature <= max_t:
                return alpha
        return bands[-1][1]

    def category(self, text: str) -> str:
        """The first ``[json]``/``[code]``/``[math]``/``[chat]`` tag (any table key) in the prompt's
        text, else ``default_category``. A chat's text is its rendered messages, so a tag anywhere
        in a message counts."""
        match = re.search(r"\[(" + "|".join(map(re.escape, self.bands)) + r")\]", text, re.IGNORECASE)
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
             "context_window", "tree_max_nodes"}
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
        acceptance = AcceptanceTable(problems.check(lambda: _bands(raw["acceptance"]), acceptance.bands),
                                     acceptance.default_category)
    category = raw.get("default_category", acceptance.default_category)
    if category not in acceptance.bands:
        problems.add("default_category", category, f"must be one of {', '.join(acceptance.bands)}")
        category = acceptance.default_category
    seed = _integer(raw, "seed", 0, problems)
    window = _integer(raw, "context_window", d.context_window, problems, minimum=16)
    tree_nodes = _integer(raw, "tree_max_nodes", d.tree_max_nodes, problems, minimum=0)
    if tree_nodes > MAX_TREE_NODES:
        problems.add("tree_max_nodes", tree_nodes, f"must be at most {MAX_TREE_NODES}")
        tree_nodes = d.tree_max_nodes
    draft = (None if "draft" in raw and raw["draft"] is None
             else _shape(raw, "draft", LLAMA_1B, problems))
    config = SimConfig(_shape(raw, "target", d.target, problems), draft, hardware, efficiency,
                       replace(acceptance, default_category=category),
                       problems.check(lambda: _number(raw, "time_scale", d.time_scale, "", positive=False),
                                      d.time_scale), seed, window, tree_nodes)
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
