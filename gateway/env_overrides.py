"""Environment overrides for config.yaml: ``SPECGATE_<SECTION>__<KEY>=value``.

One convention for every key: the section and key of config.yaml, upper-cased, joined by a
double underscore (``SPECGATE_POLICY__MAX_BATCH=32``, ``SPECGATE_SERVER__PORT=9000``). The
value is read as one YAML document with the gateway's safe loader, so ``32`` is an int, ``0.5``
a float, ``null`` None and ``true`` a bool, and the field's own validation decides if the type
fits. A ``SPECGATE_`` variable with ``__`` that names no section or key is an error naming the
variable: a typo must not silently leave the file's value in force. Variables without ``__``
(``SPECGATE_HOME``) are not overrides; ``SPECGATE_API_KEYS`` is reserved for access control.

Precedence: command-line flags > environment > file > defaults. Overrides are applied to the
parsed file before validation, on startup and again on every policy reload, so an override
holds across file edits.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, get_type_hints

from gateway.config import (
    ConfigError,
    GatewayConfig,
    _read_yaml,
    parse_config,
    parse_policy,
)
from gateway.safe_yaml import YamlRefused, load_yaml
from policies import PolicyConfig, PolicyConfigError

PREFIX = "SPECGATE_"
# Names under the prefix that are not SECTION__KEY overrides but are still specgate's own.
RESERVED = frozenset({"SPECGATE_API_KEYS"})  # an alias for the API keys, read by access control
MAX_VALUE_BYTES = 64 << 10
Origin = Literal["default", "file", "env", "api"]


def section_keys() -> dict[str, frozenset[str]]:
    """Every section of GatewayConfig and its keys, read from the dataclasses (new sections included)."""
    hints = get_type_hints(GatewayConfig)
    return {f.name: frozenset(x.name for x in fields(hints[f.name]))
            for f in fields(GatewayConfig) if is_dataclass(hints[f.name])}


class EnvOverrideError(ConfigError):
    """An override that names nothing, does not parse, or fails its field's validation."""

    def __init__(self, variable: str, value: object, problem: str) -> None:
        ValueError.__init__(self, f"{variable}: {problem}")
        self.field = variable
        self.value = value


def read_overrides(environ: Mapping[str, str] | None = None) -> dict[str, dict[str, tuple[str, Any]]]:
    """``{section: {key: (variable, value)}}`` from the environment; raises EnvOverrideError."""
    environ = os.environ if environ is None else environ
    known = section_keys()
    out: dict[str, dict[str, tuple[str, Any]]] = {}
    for variable in sorted(environ):
        if not variable.startswith(PREFIX) or variable in RESERVED or "__" not in variable[len(PREFIX):]:
            continue
        text = environ[variable]
        section, _, key = variable[len(PREFIX):].lower().partition("__")
        if section not in known:
            raise EnvOverrideError(variable, text, f"unknown config section '{section}'; known: "
                                   f"{', '.join(sorted(known))}")
        if key not in known[section]:
            raise EnvOverrideError(variable, text, f"unknown key '{section}.{key}'; known: "
                                   f"{', '.join(sorted(known[section]))}")
        try:
            value = load_yaml(text, MAX_VALUE_BYTES)
        except YamlRefused as exc:
            raise EnvOverrideError(variable, text, str(exc)) from None
        out.setdefault(section, {})[key] = (variable, value)
    return out


def apply_overrides(raw: Mapping[str, Any], overrides: Mapping[str, Mapping[str, tuple[str, Any]]]) -> dict[str, Any]:
    """A copy of the parsed file with the overrides written over it (the file is not changed)."""
    merged = dict(raw)
    for section, values in overrides.items():
        current = merged.get(section)
        if current is None:
            current = {}
        if not isinstance(current, Mapping):
            raise ConfigError(section, current, "must be a mapping")
        merged[section] = {**current, **{key: value for key, (_, value) in values.items()}}
    return merged


def blame(exc: ConfigError | PolicyConfigError, section: str | None,
           overrides: Mapping[str, Mapping[str, tuple[str, Any]]]) -> Exception:
    """The error restated with the variable's name when the value came from the environment."""
    dotted = f"{section}.{exc.field}" if section else exc.field
    head, _, key = dotted.partition(".")
    source = overrides.get(head, {}).get(key)
    if source is None:
        return exc
    return EnvOverrideError(source[0], exc.value, str(exc))


def load_config_env(path: Path, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """``load_config`` with the environment's overrides: what ``specgate serve`` runs."""
    overrides = read_overrides(environ)
    raw = apply_overrides(_read_yaml(path), overrides)
    try:
        return parse_config(raw, path.resolve().parent, path.resolve())
    except PolicyConfigError as exc:
        raise blame(exc, "policy", overrides) from None
    except ConfigError as exc:
        raise blame(exc, None, overrides) from None


def load_policy_env(path: Path, environ: Mapping[str, str] | None = None) -> tuple[PolicyConfig, dict[str, Origin]]:
    """The policy a reload installs, and where each value came from (``env``, ``file``, ``default``)."""
    overrides = read_overrides(environ)
    section = _read_yaml(path).get("policy")
    raw = apply_overrides({"policy": section}, {"policy": overrides.get("policy", {})})["policy"]
    try:
        policy = parse_policy(raw)
    except PolicyConfigError as exc:
        raise blame(exc, "policy", overrides) from None
    return policy, policy_origins(section, overrides)


def policy_origins(file_section: Any, overrides: Mapping[str, Mapping[str, tuple[str, Any]]]) -> dict[str, Origin]:
    env = overrides.get("policy", {})
    in_file = file_section if isinstance(file_section, Mapping) else {}
    return {f.name: "env" if f.name in env else "file" if f.name in in_file else "default"
            for f in fields(PolicyConfig)}
