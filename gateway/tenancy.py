"""Who a request's caches belong to: its caller (session scope and tenant) and its cache scope.

Sessions are scoped per API key (``Caller.scope``), caches per tenant: a key is its own tenant
unless its ``auth.api_keys`` entry names one, and an open API is one tenant. A request's cache
scope is (tenant, ``cache_salt``), vLLM's per-request field: requests of different scopes never
share a cached block, a lookup document or a prefix-routing entry.

What leaves the gateway is never the key, the tenant's name or the client's salt, but keyed
digests of them (``auth.cache_scope_secret``):
- ``cache_salt`` in the body a worker gets is the scope's digest (a specgate worker keys its
  prefix cache and lookup store by it; vLLM's prefix caching honours it as it does any salt);
- ``X-Session-ID`` towards a specgate worker is the digest of (key scope, session id), so two
  keys that use the same id never meet in a worker's lookup store.
The default scope (an open API and no salt) sends no salt: it is what every worker's cache
held before scopes existed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from workers.api.wire import CACHE_SALT_FIELD, CompletionRequest

# The hash key when auth.cache_scope_secret is unset: the digests then hide a key (its
# fingerprint goes in, never the key) but a guessable tenant name or salt can be tried against them.
DEFAULT_SCOPE_SECRET = b"specgate cache scope v1"
SCOPE_DIGEST_BYTES = 16  # 32 hex digits: within vLLM's 128 characters, and a collision is out of reach


@dataclass(frozen=True)
class Caller:
    """Who sent a request: ``scope`` keys its sessions ("" when the API is open, else "key-" +
    the key's fingerprint); ``tenant`` keys its caches ("" open, "key-..." for a key that is its
    own tenant, "tenant-" + the name for a named one)."""

    scope: str = ""
    tenant: str = ""


OPEN = Caller()


def _digest(secret: str | None, *parts: str) -> str:
    key = secret.encode("utf-8", "surrogateescape") if secret else DEFAULT_SCOPE_SECRET
    message = b"\0".join(part.encode("utf-8", "surrogatepass") for part in parts)
    return hashlib.blake2b(message, key=key[:64], digest_size=SCOPE_DIGEST_BYTES).hexdigest()


def cache_scope(tenant: str, salt: str | None, secret: str | None) -> str:
    """The scope's digest; "" for the default scope (an open API, no salt)."""
    if not tenant and salt is None:
        return ""
    # The salt's presence is part of the input: (tenant, no salt) and (tenant, "") never meet
    # ("" is refused anyway, at parsing).
    return _digest(secret, "cache", tenant, "salt" if salt is not None else "none", salt or "")


def scoped_request(req: CompletionRequest, caller: Caller, secret: str | None) -> CompletionRequest:
    """The request as workers see it: its ``cache_salt`` replaced by its scope's digest (or
    removed, in the default scope). Everything after admission (the prefix index, the worker
    body, a migration's resume) reads the scope from here."""
    scope = cache_scope(caller.tenant, req.cache_salt, secret)
    if not scope and CACHE_SALT_FIELD not in req.raw:  # the default scope, as the client sent it
        return req
    raw = dict(req.raw)
    raw.pop(CACHE_SALT_FIELD, None)
    if scope:
        raw[CACHE_SALT_FIELD] = scope
    return replace(req, cache_salt=scope or None, raw=raw)


def worker_session_id(session_scope: str, session_id: str, secret: str | None) -> str:
    """The session id a specgate worker sees: never the client's, and never the same for two
    keys that chose the same id."""
    return "s-" + _digest(secret, "session", session_scope, session_id)
