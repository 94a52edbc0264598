"""The ``auth:`` section of config.yaml and its environment aliases.

- ``auth.api_keys``: the keys clients send as ``Authorization: Bearer``; empty: the API is open
  (refused on a non-loopback address unless ``server.allow_unauthenticated``).
- ``auth.admin_token``: with one, ``/admin/*`` wants it; without, ``/admin/*`` answers loopback
  clients only.
- ``auth.protect_probes``: ``/metrics``, ``/health`` and ``/ready`` want an API key or the
  admin token too (default: open, for load balancers and Prometheus).
- ``auth.worker_token``: sent to ``protocol: specgate`` remote workers, which check it.

Environment variables override the file, as the ``SPECGATE_*`` override convention has it:
``SPECGATE_API_KEYS`` (comma-separated) for ``auth.api_keys``, ``SPECGATE_ADMIN_TOKEN`` and
``SPECGATE_WORKER_TOKEN``. Errors name the field, never a secret's value.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.config.errors import ConfigError, Problems

API_KEYS_ENV, ADMIN_TOKEN_ENV, WORKER_TOKEN_ENV = "SPECGATE_API_KEYS", "SPECGATE_ADMIN_TOKEN", "SPECGATE_WORKER_TOKEN"
MIN_SECRET_CHARS = 8  # shorter secrets are guessable; refuse them rather than protect nothing
MAX_SECRET_CHARS = 512
MAX_API_KEYS = 1024


class _Redacted:
    """Stands in for a secret in an error message."""

    def __repr__(self) -> str:
        return "<redacted>"


REDACTED: Any = _Redacted()


@dataclass(frozen=True)
class AuthConfig:
    api_keys: tuple[str, ...] = ()
    admin_token: str | None = None
    protect_probes: bool = False
    worker_token: str | None = None

    def __repr__(self) -> str:  # a config printed in a log or a traceback shows no secret
        admin = "<set>" if self.admin_token else None
        return (f"AuthConfig(api_keys=<{len(self.api_keys)} keys>, admin_token={admin}, "
                f"protect_probes={self.protect_probes}, worker_token={'<set>' if self.worker_token else None})")


def _secret(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(name, REDACTED, "must be a string")
    if value != value.strip() or not value.isprintable() or " " in value:
        raise ConfigError(name, REDACTED, "must be printable, without spaces")
    if not MIN_SECRET_CHARS <= len(value) <= MAX_SECRET_CHARS:
        raise ConfigError(name, REDACTED, f"must be {MIN_SECRET_CHARS} to {MAX_SECRET_CHARS} characters")
    return value


def _keys(raw: Any, name: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(name, REDACTED, "must be a list of strings")
    if len(raw) > MAX_API_KEYS:
        raise ConfigError(name, len(raw), f"at most {MAX_API_KEYS} keys")
    keys = tuple(_secret(key, f"{name}[{i}]") for i, key in enumerate(raw))
    return tuple(dict.fromkeys(keys))  # duplicates are harmless; keep the first of each


def parse_auth(raw: Any, env: Mapping[str, str] | None = None) -> AuthConfig:
    """Every field checked (the ConfigError raised carries each problem, gateway/config/errors.py)."""
    env = os.environ if env is None else env
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError("auth", REDACTED, "must be a mapping")
    problems = Problems()
    allowed = {"api_keys", "admin_token", "protect_probes", "worker_token"}
    for key in raw:
        if key not in allowed:
            problems.add(ConfigError(f"auth.{key}", REDACTED, f"unknown field; known: {', '.join(sorted(allowed))}"))
    no_keys: tuple[str, ...] = ()
    api_keys = problems.check(lambda: _keys(raw.get("api_keys"), "auth.api_keys"), no_keys)
    if env.get(API_KEYS_ENV):
        api_keys = problems.check(
            lambda: _keys([k.strip() for k in env[API_KEYS_ENV].split(",") if k.strip()], API_KEYS_ENV), no_keys)
    admin_token = _optional_secret(raw.get("admin_token"), "auth.admin_token", env.get(ADMIN_TOKEN_ENV),
                                   ADMIN_TOKEN_ENV, problems)
    worker_token = _optional_secret(raw.get("worker_token"), "auth.worker_token", env.get(WORKER_TOKEN_ENV),
                                    WORKER_TOKEN_ENV, problems)
    protect = raw.get("protect_probes", False)
    if not isinstance(protect, bool):
        problems.add(ConfigError("auth.protect_probes", protect, "must be a bool"))
        protect = False
    problems.raise_any()
    return AuthConfig(api_keys, admin_token, protect, worker_token)


def _optional_secret(value: Any, name: str, from_env: str | None, variable: str, problems: Problems) -> str | None:
    """The file's secret, or the environment's, which outranks it; None when neither sets one."""
    secret = problems.check(lambda: _secret(value, name), None) if value is not None else None
    if from_env:
        secret = problems.check(lambda: _secret(from_env, variable), None)
    return secret
