"""Parsing ``workers.sim`` (config.yaml, or a sim worker's ``--sim-config``) into a ``SimConfig``.

Every bad field is reported, not the first: each is read through ``_Problems.check``, which
records the error and goes on with the default, and the parse ends with one ``SimConfigError``
whose ``problems`` lists them all (the gateway turns each into a ``ConfigError``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

from workers.engines.sim.model import (
    LLAMA_1B,
    AcceptanceTable,
    Bands,
    Efficiency,
    Hardware,
    ModelShape,
    SimConfig,
    SimConfigError,
)

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
             "context_window"}
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
    draft = (None if "draft" in raw and raw["draft"] is None
             else _shape(raw, "draft", LLAMA_1B, problems))
    config = SimConfig(_shape(raw, "target", d.target, problems), draft, hardware, efficiency,
                       replace(acceptance, default_category=category),
                       problems.check(lambda: _number(raw, "time_scale", d.time_scale, "", positive=False),
                                      d.time_scale), seed, window)
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
