"""The gateway's app factory: OpenAI routes, health, metrics, and the admin API.

State lives in typed ``web.AppKey``s; the fleet and the config watcher (the file's changes and
SIGHUP: the policy, the routing and the API keys) run in cleanup contexts."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from gateway.auth import AUTH_KEY, AuthStore, authenticate
from gateway.config.config import GatewayConfig, parse_policy
from gateway.config.safe_yaml import YamlRefused, load_yaml
from gateway.config.watcher import ConfigWatcher
from gateway.fleet.fleet import Fleet
from gateway.observe.metrics import GatewayMetrics, LiveStateCollector
from gateway.observe.ops_metrics import OPS_KEY, OpsMetrics
from gateway.observe.tracing import TRACING_KEY, Tracing
from gateway.policy_store import PolicyStore
from gateway.relay.busy_poll import BUSY_POLL_KEY, BusyPoll
from gateway.relay.drain import DRAIN_KEY, Drain
from gateway.relay.openapi import openapi_document
from gateway.relay.relay import REQUEST_LOG_KEY, relay
from gateway.relay.tokenize import detokenize, tokenize
from gateway.scheduling.store import RoutingStore
from gateway.sessions.store import create_store
from gateway.sessions.table import SessionTable
from gateway.state import STATE_KEY, GatewayState
from policies import PolicyConfigError, acceptance_view, lookup_views, speculative_view, worker_acceptance
from policies.tree_choice import view as rank_view
from workers.api.errors import BadRequest, NotFound, Unavailable
from workers.api.limits import InputRefused, loads_json
from workers.api.logs import RequestLog
from workers.api.web_common import BODY_TIMEOUT_KEY, Handler, health, model_list, openai_errors, read_body

log = logging.getLogger(__name__)
MAX_POLICY_BYTES = 64 << 10  # a policy is a few numbers and shapes; YAML beyond this is not a policy
OPENAPI_KEY = web.AppKey("openapi", bytes)
WATCHER_KEY = web.AppKey("config_watcher", ConfigWatcher)

@web.middleware
async def count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    started = time.monotonic()
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    finally:
        metrics = request.app[STATE_KEY].metrics
        metrics.series(metrics.requests, route, str(status)).inc()
        if route.startswith("/v1/") and route != "/v1/models":
            metrics.series(metrics.e2e_latency, route).observe(time.monotonic() - started)


def create_app(config: GatewayConfig, metrics: GatewayMetrics | None = None,
               openai_routes: bool = True) -> web.Application:
    """The gateway; without ``openai_routes`` (the endpoint picker, gateway/epp/picker.py) Envoy sends
    the OpenAI requests to the model servers and this app serves the rest."""
    # authenticate runs inside openai_errors, so a refusal is an OpenAI error object.
    app = web.Application(middlewares=[count_requests, openai_errors, authenticate],
                          client_max_size=config.server.max_body_bytes)
    metrics = metrics or GatewayMetrics.create(config.model.name)
    ops = OpsMetrics.create(metrics.registry)
    sessions = SessionTable(config.sessions)

    def worker_down(worker_id: str) -> None:
        routing.forget(worker_id)  # a worker that went down lost its cache
        moved = sessions.move_off(worker_id)
        log.warning("%s is down; %d sessions will move on their next request", worker_id, moved)

    app[BODY_TIMEOUT_KEY] = config.server.body_timeout_s
    app[OPENAPI_KEY] = json.dumps(openapi_document(config.model.name)).encode()
    routing = RoutingStore(config.routing, config.policy)
    store = PolicyStore(config.policy, config.source, metrics, routing)
    app[TRACING_KEY] = Tracing.create(config.tracing)
    app[STATE_KEY] = GatewayState(config, metrics, sessions, store, Fleet(config, metrics, worker_down),
                                  create_store(config, ops))
    metrics.live.register(LiveStateCollector(metrics.model, lambda: store.active, sessions.policy_states))
    app[OPS_KEY] = ops
    auth = app[AUTH_KEY] = AuthStore(config.auth, config.source, config.server, ops)
    # One watcher of the config file for every part that re-reads it.
    app[WATCHER_KEY] = ConfigWatcher(config.source, (store.reload_file, auth.reload_file))
    app[DRAIN_KEY] = Drain(config.server.drain_timeout_s, ops)
    app[REQUEST_LOG_KEY] = RequestLog(logging.getLogger("gateway.relay.relay"))
    app.cleanup_ctx.append(_request_log)
    app.cleanup_ctx.append(_session_store)
    app.cleanup_ctx.append(_background)
    app.cleanup_ctx.append(_watch_config)  # after the fleet: it stops first
    if config.server.busy_poll_s > 0:  # server.busy_poll_s: awake around requests
        app[BUSY_POLL_KEY] = BusyPoll(config.server.busy_poll_s)
        app.cleanup_ctx.append(_busy_poll)
    if openai_routes:
        app.router.add_post("/v1/chat/completions", _chat_completions)
        app.router.add_post("/v1/completions", _completions)
        app.router.add_get("/v1/models", _models)
        app.router.add_post("/tokenize", tokenize)  # vLLM's, at the root
        app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/openapi.json", _openapi)
    app.router.add_get("/admin/policy", _get_policy)
    app.router.add_put("/admin/policy", _put_policy)
    app.router.add_get("/admin/routing", _get_routing)
    app.router.add_get("/admin/sessions/{session_id}", _get_session)
    app.router.add_get("/admin/workers", _get_workers)
    return app


async def _background(app: web.Application) -> AsyncIterator[None]:
    fleet = app[STATE_KEY].fleet
    await fleet.start()
    yield
    await fleet.stop()
    app[TRACING_KEY].shutdown()


async def _watch_config(app: web.Application) -> AsyncIterator[None]:
    async with app[WATCHER_KEY].running():
        yield


async def _busy_poll(app: web.Application) -> AsyncIterator[None]:
    async with app[BUSY_POLL_KEY].running():
        yield


async def _request_log(app: web.Application) -> AsyncIterator[None]:
    # Before _background in cleanup_ctx: started first, it ends last and writes the last lines.
    async with app[REQUEST_LOG_KEY].running():
        yield


async def _session_store(app: web.Application) -> AsyncIterator[None]:
    # Before _background: it ends after the fleet stops, and writes the last requests' session state.
    async with app[STATE_KEY].store.running():
        yield


# -- OpenAI routes ---------------------------------------------------------------------------------
async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await relay(request, "chat", request.app[STATE_KEY])


async def _completions(request: web.Request) -> web.StreamResponse:
    return await relay(request, "completion", request.app[STATE_KEY])


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    # The window every worker that reported one takes (the smallest): what any request may use.
    windows = [w for h in state.fleet.workers.values() if type(w := h.info.get("context_window")) is int]
    return model_list(state.config.model.name, min(windows) if windows else None)


async def _openapi(request: web.Request) -> web.Response:
    return web.Response(body=request.app[OPENAPI_KEY], content_type="application/json")


async def _ready(request: web.Request) -> web.Response:
    if request.app[DRAIN_KEY].draining:
        raise Unavailable("the server is shutting down", retry_after_s=5.0)
    fleet = request.app[STATE_KEY].fleet
    ready = fleet.ready_count()
    if ready == 0:
        raise Unavailable("no worker is ready yet", retry_after_s=1.0)
    # A failing state backend is degraded, not unready: requests are served from local state.
    return web.json_response({"status": "ready", "workers_ready": ready, "workers": len(fleet.workers),
                              **request.app[STATE_KEY].store.describe()})


async def _metrics(request: web.Request) -> web.Response:
    metrics = request.app[STATE_KEY].metrics
    for mode, count in request.app[STATE_KEY].sessions.counts_by_mode().items():
        metrics.sessions.labels(model=metrics.model, mode=mode).set(count)
    for handle in request.app[STATE_KEY].fleet.workers.values():
        metrics.worker_in_flight.labels(model=metrics.model, worker=handle.worker_id).set(handle.in_flight)
    return web.Response(body=metrics.exposition(), headers={"Content-Type": "text/plain; version=0.0.4"})


# -- admin -------------------------------------------------------------------------------------------
def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _policy_view(store: PolicyStore) -> dict[str, Any]:
    current = store.current
    return {"policy": current.policy.as_dict(), "loaded_at": _iso(current.loaded_at), "source": current.source,
            "file": str(store.path) if store.path else None, "last_error": store.last_error,
            "origins": store.origins}


async def _get_policy(request: web.Request) -> web.Response:
    return web.json_response(_policy_view(request.app[STATE_KEY].policy))


async def _put_policy(request: web.Request) -> web.Response:
    """Body: the policy mapping, as YAML or JSON, bare or under a ``policy:`` key."""
    store = request.app[STATE_KEY].policy
    data = await read_body(request, MAX_POLICY_BYTES)
    try:
        try:  # JSON first: PyYAML (YAML 1.1) misreads some JSON, e.g. keys over 1024 characters
            raw = loads_json(data)
        except InputRefused:
            raw = load_yaml(data.decode(), MAX_POLICY_BYTES)
    except UnicodeDecodeError:
        raise _refuse(store, "body is not valid UTF-8") from None
    except YamlRefused as exc:
        raise _refuse(store, f"body is not valid YAML or JSON: {exc}") from None
    if isinstance(raw, dict) and set(raw) == {"policy"}:
        raw = raw["policy"]
    if raw is None:  # an empty body (or "policy:" with nothing under it) is a mistake, not "all defaults"
        raise _refuse(store, "body is empty: send the policy mapping (PUT replaces the whole policy; "
                      "fields left out take their defaults)")
    try:
        candidate = parse_policy(raw)
    except PolicyConfigError as exc:
        store.reject(exc, "api")
        # Every problem in the message (the summary), the first one's field as the param.
        raise BadRequest(exc.summary(), param=f"policy.{exc.field}") from None
    if (clash := store.routing_clash(candidate)) is not None:  # the file's routing: section says that
        store.reject(clash, "api")
        raise BadRequest(str(clash), param=clash.field)
    store.apply(candidate, "api")
    return web.json_response(_policy_view(store))


async def _get_routing(request: web.Request) -> web.Response:
    """The live routing pipeline as config.yaml's ``routing:`` section writes it, and where it came
    from: the file's section, or the policy's ``route_*`` keys (docs/routing.md)."""
    store = request.app[STATE_KEY].policy
    return web.json_response({**store.routing.view(), "loaded_at": _iso(store.current.loaded_at),
                              "last_error": store.last_error})


def _refuse(store: PolicyStore, message: str) -> BadRequest:
    error = BadRequest(message)
    store.reject(error, "api")
    return error


async def _get_session(request: web.Request) -> web.Response:
    """A session by its id; ``?scope=`` picks one when several API keys used the same id."""
    session_id = request.match_info["session_id"]
    found = request.app[STATE_KEY].sessions.find(session_id)
    scope = request.query.get("scope")
    if scope is not None:
        found = [s for s in found if s.scope == scope]
    if not found:
        raise NotFound(f"no session '{session_id}' (never seen, expired or evicted)", param="session_id")
    if len(found) > 1:
        raise BadRequest(f"session '{session_id}' exists under several API keys; pick one with ?scope= "
                         f"({', '.join(sorted(s.scope for s in found))})", param="scope")
    session = found[0]
    state = session.policy_state
    app_state = request.app[STATE_KEY]
    policy = app_state.policy.active
    handle = app_state.fleet.workers.get(session.worker_id) if session.worker_id else None
    decision = session.last_decision
    return web.json_response({
        "session_id": session.session_id, "scope": session.scope, "worker": session.worker_id,
        "requests": session.requests,
        "mode": session.mode, "k": decision.k if decision else None, "reason": decision.reason if decision else None,
        "tree": str(decision.tree) if decision and decision.tree else None,
        # Where the session chooses its method (policy.methods): the one it last ran, the one the
        # last decision named, and each lookup method's evidence (the draft's is "acceptance").
        "method": state.method, "decision_method": decision.method if decision else None,
        "since_method": state.since_method,
        "methods": lookup_views(state, policy, handle.acceptance.lookups if handle else ()),
        # α, the floor's acceptance, and its evidence; "acceptance" has it all, vLLM's rate beside.
        "acceptance_estimate": state.acceptance_estimate, "evidence_drafted_tokens": state.proposals_seen,
        "acceptance": acceptance_view(state, policy, worker_acceptance(handle.acceptance, policy) if handle else None),
        # The counterpart of the usage's `speculative` block, summed over the session's requests:
        # every method's drafts that ran, per method; the worker's shadow replays apart, labelled.
        "speculative": speculative_view(state),
        "low_acceptance": state.low_acceptance, "plain_since_probe": state.plain_since_probe,
        # K auto: the choice hysteresis holds, and the rank acceptances trees are priced with.
        "auto_k": state.auto_k, "auto_tree": None if state.auto_tree is None else str(state.auto_tree),
        "since_tree": state.since_tree, "rank_acceptance": rank_view(state.ranks),
        "mode_changes": [{"at": _iso(c.at), "mode": c.mode, "k": c.k, "tree": c.tree, "reason": c.reason}
                         for c in session.history],
    })


async def _get_workers(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    index = state.routing.prefix_index()  # the prefix scorer's, if the pipeline has one
    blocks = index.sizes() if index is not None else {}
    return web.json_response({"workers": [
        {**h.view(), "prefix_index": None if index is None else {"blocks": blocks.get(h.worker_id, 0),
                                                                 "hold": index.hold(h.worker_id)}}
        for h in state.fleet.workers.values()]})
