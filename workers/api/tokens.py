"""Bearer tokens: reading them from a request and checking them in constant time. No torch.

Shared by the gateway's API keys and admin token (gateway/auth.py) and a TCP worker's
gateway token (workers/server/app.py). Secrets are compared with ``hmac.compare_digest`` against
every configured value, without stopping at the first match, so neither the position of a
match nor a common prefix shows in the timing.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable

from aiohttp import web

from workers.api.errors import ApiError

AUTHORIZATION = "Authorization"


class Unauthorized(ApiError):
    """No credentials, or credentials that match nothing (OpenAI: 401 ``invalid_api_key``)."""

    status, error_type, client_fault = 401, "invalid_request_error", True


class Forbidden(ApiError):
    """Credentials that are valid but do not grant this (an API key on /admin, a remote client)."""

    status, error_type, client_fault = 403, "invalid_request_error", True


def bearer(request: web.Request) -> str | None:
    """The token of ``Authorization: Bearer <token>``; None when absent or of another scheme."""
    return bearer_token(request.headers.get(AUTHORIZATION))


def bearer_token(header: str | None) -> str | None:
    """``bearer`` on the header's value (the endpoint picker reads headers from Envoy, not aiohttp)."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def matching(presented: str, secrets: Iterable[str]) -> str | None:
    """The secret equal to ``presented``, compared in constant time against every one."""
    # Bytes: compare_digest refuses non-ASCII str, and a client may send any header bytes.
    given = presented.encode("utf-8", "surrogateescape")
    found = None
    for secret in secrets:
        if hmac.compare_digest(given, secret.encode("utf-8", "surrogateescape")):
            found = secret
    return found


def fingerprint(secret: str) -> str:
    """A short, stable, non-reversible name for a secret (sessions, admin views): never the secret."""
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def is_loopback(host: str) -> bool:
    """A listening or peer address on this machine only. "" and 0.0.0.0 listen everywhere; a
    name other than ``localhost`` is not trusted to resolve to loopback."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1, as a dual-stack socket reports IPv4 peers
    return address.is_loopback


def peer_is_local(request: web.Request) -> bool:
    """The client connected from this machine: a loopback address, or a Unix socket (no address)."""
    remote = request.remote
    return remote is None or remote == "" or is_loopback(remote)
