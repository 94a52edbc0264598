"""Who may use the gateway: API keys for the OpenAI routes, an admin token (or loopback) for
``/admin/*``, and optionally either for the probes. Keys rotate without a restart.

The live keys come from the ``auth:`` section of config.yaml (or ``SPECGATE_API_KEYS``), and
are re-read like the policy, by the one config watcher (gateway/config/watcher.py): when the
file changes, on SIGHUP, and never half-applied (a section that fails to validate leaves the
running keys in place). Secrets are compared in
constant time (workers/api/tokens.py) and never logged or shown: logs and views name a key by
its fingerprint.

Each request's scope, the fingerprint of the key that made it, keys its session, so one key
can neither read nor ride another key's session; its tenant (the key, or the tenant its entry
names) keys its caches (gateway/tenancy.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

from aiohttp import web

from gateway.config.auth import AuthConfig, tenant_of
from gateway.config.config import ConfigError, ServerConfig, load_auth_file
from gateway.config.watcher import ReloadSource
from gateway.observe.ops_metrics import OpsMetrics
from gateway.tenancy import OPEN, Caller
from workers.api.tokens import (
    AUTHORIZATION,
    Forbidden,
    Unauthorized,
    bearer,
    bearer_token,
    fingerprint,
    is_loopback,
    matching,
    peer_is_local,
)
from workers.api.web_common import Handler

log = logging.getLogger(__name__)
PROBES = frozenset({"/metrics", "/health", "/ready"})
# The request's caller: its session scope ("" when the API is open, else "key-" + the
# fingerprint of its API key) and its tenant.
CALLER_KEY = web.RequestKey("specgate_caller", Caller)


def caller_of(request: web.Request) -> Caller:
    caller: Caller = request.get(CALLER_KEY, OPEN)
    return caller


def check_exposure(auth: AuthConfig, server: ServerConfig, host: str) -> None:
    """Refuses to serve a non-loopback address with no API keys, unless the config says so."""
    if not auth.api_keys and not server.allow_unauthenticated and not is_loopback(host):
        raise ConfigError("auth.api_keys", [], f"is empty while server.host is {host!r}, which is not a loopback "
                          "address: set auth.api_keys (or SPECGATE_API_KEYS), or server.allow_unauthenticated: true "
                          "to serve anyone who can reach the port")


class AuthStore:
    def __init__(self, initial: AuthConfig, path: Path | None, server: ServerConfig, metrics: OpsMetrics) -> None:
        self.current = initial
        self.path = path
        self.server = server
        self.metrics = metrics
        self.last_error: str | None = None

    def describe(self) -> str:
        keys = ", ".join(fingerprint(k) + (f" ({t})" if (t := tenant_of(k)) else "")
                         for k in self.current.api_keys) or "none"
        return f"{len(self.current.api_keys)} API keys (fingerprints: {keys}), admin token " + (
            "set" if self.current.admin_token else "unset (loopback clients only)")

    def reload_file(self, source: ReloadSource) -> bool:
        if self.path is None:
            return False
        try:
            candidate = load_auth_file(self.path)
            check_exposure(candidate, self.server, self.server.host)
        except ConfigError as exc:  # its messages name the fields, never a secret
            self.last_error = exc.summary()
            self.metrics.auth_reloads.labels(source=source, result="failed").inc()
            log.error("auth reload from %s rejected, keeping the running keys: %s", source, self.last_error)
            return False
        changed = candidate != self.current
        self.current = candidate
        self.last_error = None
        self.metrics.auth_reloads.labels(source=source, result="ok").inc()
        if changed:
            log.info("auth reloaded from %s: %s", source, self.describe())
        return True

    # -- checks ---------------------------------------------------------------------------------------
    def api_caller(self, request: web.Request) -> Caller:
        """The caller of an OpenAI route; raises 401 without a valid key."""
        return self.caller_for(request.headers.get(AUTHORIZATION))

    def caller_for(self, authorization: str | None) -> Caller:
        """``api_caller`` on an ``Authorization`` header's value (the endpoint picker's requests)."""
        keys = self.current.api_keys
        if not keys:
            return OPEN
        presented = bearer_token(authorization)
        if presented is None:
            raise Unauthorized("You didn't provide an API key: send it as 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
        key = matching(presented, keys)
        if key is None:
            raise Unauthorized("Incorrect API key provided", code="invalid_api_key")
        scope = "key-" + fingerprint(key)
        tenant = tenant_of(key)
        return Caller(scope, scope if tenant is None else "tenant-" + tenant)

    def check_admin(self, request: web.Request) -> None:
        token = self.current.admin_token
        if token is None:
            if not peer_is_local(request):
                raise Forbidden("the admin API answers loopback clients only while no auth.admin_token is set",
                                code="admin_loopback_only")
            return
        presented = bearer(request)
        if presented is None:
            raise Unauthorized("the admin API needs the admin token: 'Authorization: Bearer <token>'",
                               code="invalid_api_key")
        if matching(presented, (token,)) is None:
            raise Forbidden("this credential does not grant the admin API", code="admin_token_required")

    def check_probe(self, request: web.Request) -> None:
        if not self.current.protect_probes:
            return
        presented = bearer(request)
        secrets = self.current.api_keys + ((self.current.admin_token,) if self.current.admin_token else ())
        if not secrets:
            return  # nothing to protect with: the API itself is open
        if presented is None or matching(presented, secrets) is None:
            raise Unauthorized("this endpoint needs an API key or the admin token (auth.protect_probes)",
                               code="invalid_api_key")


AUTH_KEY = web.AppKey("auth", AuthStore)


@web.middleware
async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Runs inside ``openai_errors``, so a refusal is an OpenAI error object (401/403)."""
    store = request.app[AUTH_KEY]
    path = request.path
    if path.startswith("/v1/") or path == "/v1":
        request[CALLER_KEY] = store.api_caller(request)
    elif path.startswith("/admin/") or path == "/admin":
        store.check_admin(request)
    elif path in PROBES:
        store.check_probe(request)
    return await handler(request)
