"""The ``auth:`` section of config.yaml and its environment aliases.

- ``auth.api_keys``: the keys clients send as ``Authorization: Bearer``; empty: the API is open
  (refused on a non-loopback address unless ``server.allow_unauthenticated``). An entry is a key,
  its own tenant, or ``{key: ..., tenant: name}``: keys of one named tenant share their caches
  (sessions stay per key; gateway/tenancy.py).
- ``auth.cache_scope_secret``: the key of the hash that turns a request's (tenant, cache_salt)
  into the cache scope sent to workers; replicas that share workers set the same one (unset: a
  fixed key, so the scope is a plain digest of the tenant's fingerprint or name and the salt).
- ``auth.admin_token``: with one, ``/admin/*`` wants it; without, ``/admin/*`` answers loopback
  clients only.
- ``auth.protect_probes``: ``/metrics``, ``/health`` and ``/ready`` want an API key or the
  admin token too (default: open, for load balancers and Prometheus).
- ``auth.worker_token``: sent to ``protocol: specgate`` remote workers, which check it.

Environment variables override the file, as the ``SPECGATE_*`` override convention has it:
``SPECGATE_API_KEYS`` (comma-separated) for ``auth.api_keys`` (each key its own tenant: a key may
hold any printable character but a space, so no separator could name a tenant inside it),
``SPECGATE_ADMIN_TOKEN``, ``SPECGATE_WORKER_TOKEN`` and ``SPECGATE_CACHE_SCOPE_SECRET``. Errors
name the field, never a secret's value.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.config.errors import ConfigError, Problems

API_KEYS_ENV, ADMIN_TOKEN_ENV, WORKER_TOKEN_ENV = "SPECGATE_API_KEYS", "SPECGATE_ADMIN_TOKEN", "SPECGATE_WORKER_TOKEN"
CACHE_SCOPE_SECRET_ENV = "SPECGATE_CACHE_SCOPE_SECRET"
# A tenant's name: shown in the admin views and metrics-free logs, so plain and short.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MIN_SECRET_CHARS = 8  # shorter secrets are guessable; refuse them rather than protect nothing
MAX_SECRET_CHARS = 512
MAX_API_KEYS = 1024


class ApiKey(str):
    """An API key (the string itself, compared as one) whose ``auth.api_keys`` entry names a
    tenant: the keys of one tenant share their caches (gateway/tenancy.py)."""

    tenant: str

    def __new__(cls, key: str, tenant: str) -> ApiKey:
        out = super().__new__(cls, key)
        out.tenant = tenant
        return out


def tenant_of(key: str) -> str | None:
    """The tenant a configured key's entry names; None: the key is its own tenant."""
    return key.tenant if isinstance(key, ApiKey) else None


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
    cache_scope_secret: str | None = None

    def __repr__(self) -> str:  # a config printed in a log or a traceback shows no secret
        admin = "<set>" if self.admin_token else None
        named = sorted({t for key in self.api_keys if (t := tenant_of(key)) is not None})
        return (f"AuthConfig(api_keys=<{len(self.api_keys)} keys>, tenants={named}, admin_token={admin}, "
                f"protect_probes={self.protect_probes}, worker_token={'<set>' if self.worker_token else None}, "
                f"cache_scope_secret={'<set>' if self.cache_scope_secret else None})")


def _secret(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(name, REDACTED, "must be a string")
    if value != value.strip() or not value.isprintable() or " " in value:
        raise ConfigError(name, REDACTED, "must be printable, without spaces")
    if not MIN_SECRET_CHARS <= len(value) <= MAX_SECRET_CHARS:
        raise ConfigError(name, REDACTED, f"must be {MIN_SECRET_CHARS} to {MAX_SECRET_CHARS} characters")
    return value


def _tenant(value: Any, name: str) -> str:
    if not isinstance(value, str) or TENANT_NAME.fullmatch(value) is None:
        raise ConfigError(name, value, "must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter "
                                       "or digit")
    return value


def _entry(item: Any, name: str) -> tuple[str, str | None]:
    """A key, or ``{key, tenant}``: (the key, the tenant it names or None)."""
    if isinstance(item, Mapping):
        unknown = sorted(str(k) for k in item if k not in ("key", "tenant"))
        if unknown:
            raise ConfigError(f"{name}.{unknown[0]}", REDACTED, "unknown field; known: key, tenant")
        if "key" not in item:
            raise ConfigError(f"{name}.key", None, "is required in an entry that names a tenant")
        key = _secret(item["key"], f"{name}.key")
        return key, _tenant(item["tenant"], f"{name}.tenant") if item.get("tenant") is not None else None
    return _secret(item, name), None


def _keys(raw: Any, name: str) -> tuple[str, ...]:
    """The keys, each a str, or an ``ApiKey`` where its entry names a tenant."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(name, REDACTED, "must be a list of keys or {key, tenant} entries")
    if len(raw) > MAX_API_KEYS:
        raise ConfigError(name, len(raw), f"at most {MAX_API_KEYS} keys")
    problems = Problems()
    entries: dict[str, str | None] = {}
    for i, item in enumerate(raw):
        no_entry: tuple[str, str | None] = ("", None)
        key, tenant = problems.check(functools.partial(_entry, item, f"{name}[{i}]"), no_entry)
        if not key:
            continue
        if key in entries and entries[key] != tenant:  # one key, two tenants: which caches would it see?
            problems.add(ConfigError(f"{name}[{i}].tenant", tenant, "this key is listed before with another tenant"))
        entries.setdefault(key, tenant)  # duplicates are harmless; keep the first of each
    problems.raise_any()
    return tuple(key if tenant is None else ApiKey(key, tenant) for key, tenant in entries.items())


def parse_auth(raw: Any, env: Mapping[str, str] | None = None) -> AuthConfig:
    """Every field checked (the ConfigError raised carries each problem, gateway/config/errors.py)."""
    env = os.environ if env is None else env
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError("auth", REDACTED, "must be a mapping")
    problems = Problems()
    allowed = {"api_keys", "admin_token", "protect_probes", "worker_token", "cache_scope_secret"}
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
    scope_secret = _optional_secret(raw.get("cache_scope_secret"), "auth.cache_scope_secret",
                                    env.get(CACHE_SCOPE_SECRET_ENV), CACHE_SCOPE_SECRET_ENV, problems)
    protect = raw.get("protect_probes", False)
    if not isinstance(protect, bool):
        problems.add(ConfigError("auth.protect_probes", protect, "must be a bool"))
        protect = False
    problems.raise_any()
    return AuthConfig(api_keys, admin_token, protect, worker_token, scope_secret)


def _optional_secret(value: Any, name: str, from_env: str | None, variable: str, problems: Problems) -> str | None:
    """The file's secret, or the environment's, which outranks it; None when neither sets one."""
    secret = problems.check(lambda: _secret(value, name), None) if value is not None else None
    if from_env:
        secret = problems.check(lambda: _secret(from_env, variable), None)
    return secret
