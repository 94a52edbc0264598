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

from gateway.config.config import ConfigError, GatewayConfig, _read_yaml, parse_config, parse_policy
from gateway.config.safe_yaml import YamlRefused, load_yaml
from policies import FieldError, PolicyConfig, PolicyConfigError, raise_problems

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
        FieldError.__init__(self, f"{variable}: {problem}", variable, value)


Overrides = dict[str, dict[str, tuple[str, Any]]]  # {section: {key: (variable, value)}}


def scan_overrides(environ: Mapping[str, str] | None = None) -> tuple[Overrides, list[EnvOverrideError]]:
    """The overrides the environment sets, and a problem for each variable that is not one."""
    environ = os.environ if environ is None else environ
    known = section_keys()
    out: Overrides = {}
    problems: list[EnvOverrideError] = []
    for variable in sorted(environ):
        if not variable.startswith(PREFIX) or variable in RESERVED or "__" not in variable[len(PREFIX):]:
            continue
        text = environ[variable]
        section, _, key = variable[len(PREFIX):].lower().partition("__")
        if section not in known:
            problems.append(EnvOverrideError(variable, text, f"unknown config section '{section}'; known: "
                                             f"{', '.join(sorted(known))}"))
        elif key not in known[section]:
            problems.append(EnvOverrideError(variable, text, f"unknown key '{section}.{key}'; known: "
                                             f"{', '.join(sorted(known[section]))}"))
        else:
            try:
                out.setdefault(section, {})[key] = (variable, load_yaml(text, MAX_VALUE_BYTES))
            except YamlRefused as exc:
                problems.append(EnvOverrideError(variable, text, str(exc)))
    return out, problems


def read_overrides(environ: Mapping[str, str] | None = None) -> Overrides:
    """``{section: {key: (variable, value)}}`` from the environment; raises EnvOverrideError (every bad variable)."""
    overrides, problems = scan_overrides(environ)
    raise_problems(problems)
    return overrides


def apply_overrides(raw: Mapping[str, Any], overrides: Mapping[str, Mapping[str, tuple[str, Any]]]) -> dict[str, Any]:
    """A copy of the parsed file with the overrides written over it (the file is not changed).

    A section the file gives as something other than a mapping is left as it is: its parser
    refuses it, naming the section.
    """
    merged = dict(raw)
    for section, values in overrides.items():
        current = merged.get(section)
        if current is None:
            current = {}
        if isinstance(current, Mapping):
            merged[section] = {**current, **{key: value for key, (_, value) in values.items()}}
    return merged


def blame(problem: FieldError, overrides: Mapping[str, Mapping[str, tuple[str, Any]]]) -> FieldError:
    """The problem restated with the variable's name when the value came from the environment."""
    dotted = f"policy.{problem.field}" if isinstance(problem, PolicyConfigError) else problem.field
    head, _, key = dotted.partition(".")
    source = overrides.get(head, {}).get(key)
    if source is None:
        return problem
    return EnvOverrideError(source[0], problem.value, str(problem))


def load_config_env(path: Path, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """``load_config`` with the environment's overrides: what ``specgate serve`` runs.

    Raises the first problem carrying all of them: every bad variable, then every bad field
    (named by its variable when the environment set its value).
    """
    raw = _read_yaml(path)
    overrides, env_problems = scan_overrides(environ)
    found: list[FieldError] = list(env_problems)
    config = None
    try:
        config = parse_config(apply_overrides(raw, overrides), path.resolve().parent, path.resolve())
    except FieldError as exc:
        found.extend(blame(problem, overrides) for problem in exc.problems)
    raise_problems(found)
    assert config is not None
    return config


def policy_env(section: Any, environ: Mapping[str, str] | None = None) -> tuple[PolicyConfig, dict[str, Origin]]:
    """A policy mapping (the file's ``policy:`` section, or a bare policy file) with the
    environment's overrides applied, and where each value came from; raises every problem."""
    overrides, env_problems = scan_overrides(environ)
    raw = apply_overrides({"policy": section}, {"policy": overrides.get("policy", {})})["policy"]
    found: list[FieldError] = list(env_problems)
    policy = None
    try:
        policy = parse_policy(raw)
    except FieldError as exc:
        found.extend(blame(problem, overrides) for problem in exc.problems)
    raise_problems(found)
    assert policy is not None
    return policy, policy_origins(section, overrides)


def load_policy_env(path: Path, environ: Mapping[str, str] | None = None) -> tuple[PolicyConfig, dict[str, Origin]]:
    """The policy a reload installs, and where each value came from (``env``, ``file``, ``default``)."""
    return policy_env(_read_yaml(path).get("policy"), environ)


def policy_origins(file_section: Any, overrides: Mapping[str, Mapping[str, tuple[str, Any]]]) -> dict[str, Origin]:
    env = overrides.get("policy", {})
    in_file = file_section if isinstance(file_section, Mapping) else {}
    return {f.name: "env" if f.name in env else "file" if f.name in in_file else "default"
            for f in fields(PolicyConfig)}
