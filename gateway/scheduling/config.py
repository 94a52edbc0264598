"""config.yaml's ``routing:`` section, in the shape of the Inference Gateway's
``EndpointPickerConfig``: ``plugins`` (``type``, ``name``, ``parameters``) and
``schedulingProfiles`` (``name``, ``plugins: [{pluginRef, weight}]``), one of the plugins a
profile handler. Parsed once into frozen specs, every field checked and named
(``routing.plugins[2].parameters.minHit``); ``build`` makes the pipeline, reusing the plugin
instances (and so the state) of the pipeline it replaces where a plugin keeps its name and type.

Without a ``routing:`` section the pipeline is the one the policy's ``route_*`` keys describe
(``routing_from_policy``): today's behaviour, exactly. ``policy_key_mapping`` says where each
key went (``specgate check``). With one, the file's ``route_*`` keys are refused: two places for
one weight would disagree.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from gateway.scheduling.framework import Filter, Picker, Pipeline, Plugin, Profile, ProfileHandler, Rule, Scorer
from gateway.scheduling.registry import PLUGIN_TYPES
from policies import PolicyConfig
from policies.config import Problems
from policies.config import SectionError as ConfigError

MAX_WEIGHT = 1000.0  # as policy.route_*_weight
MAX_PLUGINS = 64
ROUTE_KEYS = tuple(f.name for f in fields(PolicyConfig) if f.name.startswith("route_"))


@dataclass(frozen=True)
class PluginSpec:
    type: str
    name: str
    parameters: Mapping[str, Any]  # every parameter, checked, defaults filled in


@dataclass(frozen=True)
class ProfileSpec:
    name: str
    plugins: tuple[tuple[str, float | None], ...]  # (pluginRef, weight: scorers only)


@dataclass(frozen=True)
class RoutingConfig:
    plugins: tuple[PluginSpec, ...]
    profiles: tuple[ProfileSpec, ...]

    def as_dict(self) -> dict[str, Any]:
        """The section as config.yaml writes it (``GET /admin/routing``)."""
        return {"plugins": [{"type": p.type, "name": p.name, "parameters": dict(p.parameters)} for p in self.plugins],
                "schedulingProfiles": [{"name": s.name, "plugins": [
                    {"pluginRef": ref} if weight is None else {"pluginRef": ref, "weight": weight}
                    for ref, weight in s.plugins]} for s in self.profiles]}


# Where each old key went: (plugin, parameter, or "weight" in the default profile).
POLICY_KEY_HOMES: dict[str, tuple[str, str]] = {
    "route_prefix_weight": ("prefix-cache-scorer", "weight"),
    "route_load_weight": ("load-scorer", "weight"),
    "route_min_prefix_hit": ("min-prefix-hit", "minHit"),
    "route_balance_abs": ("load-guard", "balanceAbs"),
    "route_balance_rel": ("load-guard", "balanceRel"),
    "route_load_factor": ("load-bound-filter", "factor"),
    "route_load_slack": ("load-bound-filter", "slack"),
    "route_index_blocks": ("prefix-cache-scorer", "lruCapacityPerServer"),
    "route_method_margin": ("method-placement", "margin"),
}


# The default profile, in its order: what the old routing did, rule by rule (docs/routing.md).
DEFAULT_PROFILE = ("ready-filter", "load-bound-filter", "load-guard", "method-placement", "sticky-placement",
                   "min-prefix-hit", "prefix-cache-scorer", "load-scorer", "max-score-picker")


def routing_from_policy(policy: PolicyConfig) -> RoutingConfig:
    """The pipeline the policy's ``route_*`` keys describe: the default profile, each key where
    ``POLICY_KEY_HOMES`` puts it."""
    parameters: dict[str, dict[str, Any]] = {name: {} for name in DEFAULT_PROFILE}
    weights: dict[str, float] = {}
    for key, (plugin, where) in POLICY_KEY_HOMES.items():
        if where == "weight":
            weights[plugin] = getattr(policy, key)
        else:
            parameters[plugin][where] = getattr(policy, key)
    plugins = (*(PluginSpec(name, name, parameters[name]) for name in DEFAULT_PROFILE),
               PluginSpec("single-profile-handler", "single-profile-handler", {}))
    return RoutingConfig(plugins, (ProfileSpec("default", tuple((n, weights.get(n)) for n in DEFAULT_PROFILE)),))


def policy_key_mapping(policy: PolicyConfig, keys: Iterable[str] = ROUTE_KEYS) -> list[str]:
    """One line per ``policy.route_*`` key of ``keys``: what it becomes in a ``routing:`` section."""
    lines = []
    for key in keys:
        plugin, where = POLICY_KEY_HOMES[key]
        value = getattr(policy, key)
        target = (f"schedulingProfiles[default].plugins[{plugin}].weight" if where == "weight"
                  else f"plugins[{plugin}].parameters.{where}")
        lines.append(f"policy.{key}: {value!r} -> routing.{target}: {value!r}")
    return lines


def parse_routing(raw: Any, types: Mapping[str, type[Plugin]] = PLUGIN_TYPES) -> RoutingConfig:
    """The ``routing:`` section, every field checked; raises a ConfigError carrying each problem."""
    problems = Problems()
    if not isinstance(raw, Mapping):
        raise ConfigError("routing", raw, "must be a mapping with plugins and schedulingProfiles")
    for key in raw:
        if key not in ("plugins", "schedulingProfiles"):
            problems.add(ConfigError(f"routing.{key}", raw[key], "unknown field; known: plugins, schedulingProfiles"))
    plugins = _parse_plugins(raw.get("plugins"), types, problems)
    roles = {p.name: types[p.type].role for p in plugins}
    profiles = _parse_profiles(raw.get("schedulingProfiles"), roles, problems)
    handlers = [p for p in plugins if roles[p.name] == "handler"]
    if len(handlers) != 1:
        problems.add(ConfigError("routing.plugins", [p.type for p in handlers],
                                 "needs exactly one profile handler (single-profile-handler)"))
    elif handlers[0].type == "single-profile-handler" and len(profiles) > 1:
        problems.add(ConfigError("routing.schedulingProfiles", [s.name for s in profiles],
                                 "single-profile-handler runs one profile: list one"))
    problems.raise_any()
    return RoutingConfig(plugins, profiles)


def _entries(raw: Any, where: str, what: str, keys: tuple[str, ...],
             problems: Problems) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """A list's mappings, each with its path, their unknown keys reported (a list of 1..MAX_PLUGINS)."""
    if not isinstance(raw, list) or not raw or len(raw) > MAX_PLUGINS:
        problems.add(ConfigError(where, raw, f"must be a list of 1..{MAX_PLUGINS} {what}"))
        return
    for i, item in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(item, Mapping):
            problems.add(ConfigError(at, item, f"must be a mapping with {', '.join(keys)}"))
            continue
        for key in item:
            if key not in keys:
                problems.add(ConfigError(f"{at}.{key}", item[key], f"unknown field; known: {', '.join(sorted(keys))}"))
        yield at, item


def _parse_plugins(raw: Any, types: Mapping[str, type[Plugin]], problems: Problems) -> tuple[PluginSpec, ...]:
    specs: list[PluginSpec] = []
    for where, item in _entries(raw, "routing.plugins", "plugins", ("type", "name", "parameters"), problems):
        kind = item.get("type")
        if not isinstance(kind, str) or kind not in types:
            problems.add(ConfigError(f"{where}.type", kind, f"unknown plugin type; known: {', '.join(sorted(types))}"))
            continue
        name = item.get("name", kind)
        if not isinstance(name, str) or not name or len(name) > 100:
            problems.add(ConfigError(f"{where}.name", name, "must be a non-empty string of at most 100 characters"))
            continue
        if any(s.name == name for s in specs):
            problems.add(ConfigError(f"{where}.name", name, "is the name of another plugin"))
            continue
        specs.append(PluginSpec(kind, name, _parameters(types[kind], item.get("parameters"), where, problems)))
    return tuple(specs)


def _parameters(cls: type[Plugin], raw: Any, where: str, problems: Problems) -> dict[str, Any]:
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        problems.add(ConfigError(f"{where}.parameters", raw, "must be a mapping"))
        raw = {}
    known = cls.parameters
    for key in raw:
        if key not in known:
            listed = ", ".join(sorted(known)) or "none"
            problems.add(ConfigError(f"{where}.parameters.{key}", raw[key], f"unknown parameter; known: {listed}"))
    values: dict[str, Any] = {}
    for key, (kind, default, low, high) in known.items():
        try:
            values[key] = _value(raw.get(key, default), f"{where}.parameters.{key}", kind, low, high,
                                 cls.choices.get(key))
        except ConfigError as exc:
            problems.add(exc)
            values[key] = default
    return values


def _value(value: Any, name: str, kind: type, low: float | None, high: float | None,
           choices: tuple[str, ...] | None) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(name, value, f"must be a {kind.__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(name, value, "must be finite")
    if low is not None and value < low:  # type: ignore[operator]
        raise ConfigError(name, value, f"must be >= {low:g}")
    if high is not None and value > high:  # type: ignore[operator]
        raise ConfigError(name, value, f"must be <= {high:g}")
    if choices is not None and value not in choices:
        raise ConfigError(name, value, f"must be one of {', '.join(choices)}")
    return value


def _parse_profiles(raw: Any, roles: Mapping[str, str], problems: Problems) -> tuple[ProfileSpec, ...]:
    profiles: list[ProfileSpec] = []
    for where, item in _entries(raw, "routing.schedulingProfiles", "profiles", ("name", "plugins"), problems):
        name = item.get("name")
        if not isinstance(name, str) or not name or any(p.name == name for p in profiles):
            problems.add(ConfigError(f"{where}.name", name, "must be a non-empty string, unique among the profiles"))
            continue
        refs = _profile_refs(item.get("plugins"), roles, f"{where}.plugins", problems)
        if sum(1 for ref, _ in refs if roles.get(ref) == "picker") != 1:
            problems.add(ConfigError(f"{where}.plugins", [ref for ref, _ in refs], "needs exactly one picker"))
        profiles.append(ProfileSpec(name, refs))
    return tuple(profiles)


def _profile_refs(raw: Any, roles: Mapping[str, str], where: str,
                  problems: Problems) -> tuple[tuple[str, float | None], ...]:
    if not isinstance(raw, list) or len(raw) > MAX_PLUGINS:
        problems.add(ConfigError(where, raw, f"must be a list of at most {MAX_PLUGINS} plugin references"))
        return ()
    refs: list[tuple[str, float | None]] = []
    for j, entry in enumerate(raw):
        at = f"{where}[{j}]"
        if not isinstance(entry, Mapping) or set(entry) - {"pluginRef", "weight"}:
            problems.add(ConfigError(at, entry, "must be a mapping with pluginRef (and weight, for a scorer)"))
            continue
        ref = entry.get("pluginRef")
        role = roles.get(ref) if isinstance(ref, str) else None
        if role is None or not isinstance(ref, str):
            problems.add(ConfigError(f"{at}.pluginRef", ref, f"names no plugin; plugins: {', '.join(roles)}"))
            continue
        if role == "handler":
            problems.add(ConfigError(f"{at}.pluginRef", ref, "is a profile handler: it chooses profiles, not in one"))
            continue
        if any(r == ref for r, _ in refs):
            problems.add(ConfigError(f"{at}.pluginRef", ref, "is listed twice in this profile"))
            continue
        weight = entry.get("weight")
        if role != "scorer":
            if weight is not None:
                problems.add(ConfigError(f"{at}.weight", weight, f"only a scorer takes a weight ({ref} is a {role})"))
            refs.append((ref, None))
            continue
        weight = 1.0 if weight is None else weight
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0.0 <= weight <= MAX_WEIGHT:
            problems.add(ConfigError(f"{at}.weight", weight, f"must be a number in 0..{MAX_WEIGHT:g}"))
            continue
        refs.append((ref, float(weight)))
    return tuple(refs)


def build(config: RoutingConfig, types: Mapping[str, type[Plugin]] = PLUGIN_TYPES,
          previous: Pipeline | None = None) -> Pipeline:
    """The pipeline ``config`` describes. A plugin of ``previous`` with the same name and type is
    reconfigured in place, so its state (the prefix index) carries over a reload."""
    plugins: dict[str, Plugin] = {}
    for spec in config.plugins:
        old = previous.plugins.get(spec.name) if previous is not None else None
        plugin = old if old is not None and type(old) is types[spec.type] else types[spec.type](spec.name)
        plugin.configure(spec.parameters)
        plugins[spec.name] = plugin
    profiles = {spec.name: _profile(spec, plugins) for spec in config.profiles}
    handler = next(p for p in plugins.values() if isinstance(p, ProfileHandler))
    return Pipeline(plugins, profiles, handler)


def _profile(spec: ProfileSpec, plugins: Mapping[str, Plugin]) -> Profile:
    stages: list[Filter | Rule] = []
    scorers: list[tuple[Scorer, float]] = []
    picker: Picker | None = None
    for ref, weight in spec.plugins:
        plugin = plugins[ref]
        if isinstance(plugin, Filter | Rule):
            stages.append(plugin)
        elif isinstance(plugin, Scorer):
            scorers.append((plugin, weight if weight is not None else 1.0))
        elif isinstance(plugin, Picker):
            picker = plugin
    assert picker is not None  # parse_routing requires one
    return Profile(spec.name, tuple(stages), tuple(scorers), picker)

