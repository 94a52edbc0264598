"""Envoy bootstrap configs for specgate, as code: Envoy in front of `specgate epp` (the endpoint
picker, over ext_proc) or in front of several `specgate serve` replicas (ring hash on the session;
or round robin, which needs the replicas to share session state: ``state.backend: redis``).

The gateway never imports this module; the tests and operators do:

    python -m gateway.epp.envoy_config epp --listen 127.0.0.1:8080 --epp 127.0.0.1:9002 --admin 127.0.0.1:9901
    python -m gateway.epp.envoy_config ring-hash --listen 127.0.0.1:8080 --replica 127.0.0.1:8001 \\
        --replica 127.0.0.1:8002
    python -m gateway.epp.envoy_config round-robin --listen 127.0.0.1:8080 --replica 127.0.0.1:8001 \\
        --replica 127.0.0.1:8002

print the YAML that `envoy -c FILE` runs (`make install-envoy` installs the binary).
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from collections.abc import Sequence
from typing import Any, Literal

import yaml

BodyMode = Literal["BUFFERED", "FULL_DUPLEX_STREAMED"]
Config = dict[str, Any]

# The Inference Extension's endpoint picker protocol: the EPP names the chosen endpoint
# ("ip:port") in this request header and under this key of this dynamic-metadata namespace.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_METADATA_NAMESPACE = "envoy.lb"
SESSION_HEADER = "x-session-id"  # what `specgate serve` keys sessions on
EPP_CLUSTER = "specgate-epp"
# The picker's dynamic metadata namespace and keys (gateway/epp/exchange.py) -> response header.
PICKER_METADATA_NAMESPACE = "specgate"
PICKER_RESPONSE_HEADERS = {SESSION_HEADER: "session", "x-specgate-mode": "mode", "x-specgate-worker": "worker",
                           "x-specgate-route": "route"}
ENDPOINTS_CLUSTER = "specgate-endpoints"
REPLICAS_CLUSTER = "specgate-replicas"
ROUND_ROBIN_CLUSTER = "specgate-round-robin"
# Only reconnects: a reset after the response began cannot be retried (the client has bytes),
# and retrying a 5xx would run a generation twice.
RETRY_ON = "connect-failure,reset"
NUM_RETRIES = 2
RING_RESELECTIONS = 64

_TYPE_PREFIX = "type.googleapis.com/"


def _typed(type_name: str, **fields: Any) -> Config:
    return {"@type": _TYPE_PREFIX + type_name, **fields}


def _socket_address(host: str, port: int) -> Config:
    return {"socket_address": {"address": host, "port_value": port}}


def _discovery_type(host: str) -> str:
    # STATIC takes IP literals only; a name (a Kubernetes service) needs DNS resolution.
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return "STRICT_DNS"
    return "STATIC"


def _admin(host: str, port: int) -> Config:
    # /ready on the admin port says LIVE once every static cluster has initialized (first health
    # checks included): what the tests and a readiness probe wait for.
    return {"address": _socket_address(host, port)}


def _eject_on_refused_connection() -> Config:
    """Outlier detection that ejects a host on its first refused or reset connection (for 5 s).
    Its 5xx answers do not count: they are its own verdicts on requests (overload, a bad
    request), so they never eject it."""
    return {
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": 1,
        "enforcing_consecutive_local_origin_failure": 100,
        "enforcing_consecutive_5xx": 0,
        "enforcing_consecutive_gateway_failure": 0,
        "enforcing_success_rate": 0,
        "enforcing_local_origin_success_rate": 0,
        "interval": "1s",
        "base_ejection_time": "5s",
    }


def _route(cluster: str, retry_policy: Config, hash_policy: list[Config] | None = None) -> Config:
    route: Config = {
        "cluster": cluster,
        # Completions stream for as long as the model generates: no overall deadline. Envoy's
        # stream idle timeout (5 min without a byte) still ends a stuck stream.
        "timeout": "0s",
        "retry_policy": retry_policy,
    }
    if hash_policy:
        route["hash_policy"] = hash_policy
    return {"match": {"prefix": "/"}, "route": route}


def _listener(host: str, port: int, routes: list[Config], http_filters: list[Config]) -> Config:
    manager = _typed(
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix="specgate",
        codec_type="AUTO",  # HTTP/1.1 and h2c clients alike
        route_config={"name": "specgate", "virtual_hosts": [{"name": "specgate", "domains": ["*"], "routes": routes}]},
        http_filters=[*http_filters, {
            "name": "envoy.filters.http.router",
            "typed_config": _typed("envoy.extensions.filters.http.router.v3.Router"),
        }],
    )
    return {
        "name": "specgate",
        "address": _socket_address(host, port),
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                        "typed_config": manager}]}],
    }


def _endpoints_cluster(name: str, endpoints: Sequence[tuple[str, int]], **fields: Any) -> Config:
    kinds = {_discovery_type(host) for host, _ in endpoints}
    return {
        "name": name,
        "type": "STRICT_DNS" if "STRICT_DNS" in kinds else "STATIC",
        "connect_timeout": "2s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _socket_address(host, port)}} for host, port in endpoints]}]},
        **fields,
    }


def _ext_proc_filter(body_mode: BodyMode, message_timeout_s: float, max_message_timeout_s: float) -> Config:
    """The ext_proc filter asking the picker cluster: bodies per ``body_mode``, each answer awaited
    ``message_timeout_s`` (the picker may extend one up to ``max_message_timeout_s``)."""
    processing_mode: Config = {
        "request_header_mode": "SEND",
        "request_body_mode": body_mode,
        "response_header_mode": "SEND",
        # Each response chunk as it comes, unbuffered: the picker reads the step reports
        # (acceptance) off a stream without delaying it to its end.
        "response_body_mode": "STREAMED",
    }
    if body_mode == "FULL_DUPLEX_STREAMED":
        # Envoy requires it in this mode: trailers (or end_of_stream) mark the body's end.
        processing_mode["request_trailer_mode"] = "SEND"
    ext_proc = _typed(
        "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        grpc_service={"envoy_grpc": {"cluster_name": EPP_CLUSTER}},
        processing_mode=processing_mode,
        # No picker, no routing: a request Envoy cannot place must fail, not go nowhere.
        failure_mode_allow=False,
        message_timeout=_duration(message_timeout_s),
        max_message_timeout=_duration(max_message_timeout_s),
        # The picker skips the response phases of requests that teach it nothing (a plain
        # decision, a server of one fixed mode, GET /v1/models).
        allow_mode_override=True,
        # The pick's response headers (session, mode, worker) come as dynamic metadata in the
        # picker's namespace, which the route copies into the response.
        metadata_options={"receiving_namespaces": {"untyped": [PICKER_METADATA_NAMESPACE]}},
    )
    return ext_proc


def epp_bootstrap(listen_port: int, admin_port: int, epps: Sequence[tuple[str, int]],
                  body_mode: BodyMode = "BUFFERED", *, listen_host: str = "127.0.0.1",
                  admin_host: str = "127.0.0.1", message_timeout_s: float = 5.0,
                  max_message_timeout_s: float = 120.0, health_interval_s: float = 0.5) -> Config:
    """Envoy asking the endpoint pickers at ``epps`` (ext_proc over gRPC; replicas that share
    session state through Redis) where each request goes, then proxying it there: the picker
    sets ``x-gateway-destination-endpoint: ip:port`` and the ORIGINAL_DST cluster connects to
    that address. A picker that fails its gRPC readiness check (``readiness``: no model server
    ready, or gone) leaves the picker cluster.

    ``body_mode``: BUFFERED sends the whole request body in one message (the picker needs the
    body: model, prompt, session); FULL_DUPLEX_STREAMED streams it, as the Inference Extension's
    reference picker expects. ``message_timeout_s``: how long Envoy waits for each answer;
    the picker may extend one (``override_message_timeout``, up to ``max_message_timeout_s``)
    while it holds a request in its admission queue.
    """
    ext_proc = _ext_proc_filter(body_mode, message_timeout_s, max_message_timeout_s)
    endpoints = {
        "name": ENDPOINTS_CLUSTER,
        # The destination is whatever the picker named: no endpoint list here.
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "2s",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
    }
    if not epps:
        raise ValueError("epp_bootstrap needs at least one endpoint picker")
    interval = _duration(health_interval_s)
    epp = _endpoints_cluster(
        EPP_CLUSTER, epps,
        # gRPC needs HTTP/2 to the picker.
        typed_extension_protocol_options={"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _typed(
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            explicit_http_config={"http2_protocol_options": {}})},
        health_checks=[{
            "timeout": "2s", "interval": interval, "no_traffic_interval": interval,
            "unhealthy_threshold": 2, "healthy_threshold": 1,
            # specgate epp serves gRPC health: "readiness" while a model server is ready.
            "grpc_health_check": {"service_name": "readiness"},
        }],
        # With two pickers, one failing is half the cluster: Envoy's default panic threshold
        # (50%) would then send to the failed one too. A failed picker never gets requests.
        common_lb_config={"healthy_panic_threshold": {"value": 0}},
        # A picker that refuses a connection is ejected at once, before its health checks fail:
        # Envoy does not retry an ext_proc stream, so each request sent to a dead picker fails.
        outlier_detection=_eject_on_refused_connection(),
    )
    # Retries go to the same endpoint (the header still names it): they cover a connection the
    # endpoint dropped or refused for a moment, not a dead endpoint; the picker is not asked again.
    retry_policy = {"retry_on": RETRY_ON, "num_retries": NUM_RETRIES}
    route = _route(ENDPOINTS_CLUSTER, retry_policy)
    # Every OpenAI request's X-Session-ID, X-Specgate-Mode and X-Specgate-Worker, from the pick's
    # metadata; a request without a decision (GET /v1/models, a refusal) has none, and no header.
    route["response_headers_to_add"] = [
        {"header": {"key": header, "value": f"%DYNAMIC_METADATA({PICKER_METADATA_NAMESPACE}:{key})%"},
         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD", "keep_empty_value": False}
        for header, key in PICKER_RESPONSE_HEADERS.items()]
    return {
        "admin": _admin(admin_host, admin_port),
        "static_resources": {
            "listeners": [_listener(listen_host, listen_port, [route],
                                    [{"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc}])],
            "clusters": [endpoints, epp],
        },
    }


def ring_hash_bootstrap(listen_port: int, admin_port: int, replicas: Sequence[tuple[str, int]], *,
                        listen_host: str = "127.0.0.1", admin_host: str = "127.0.0.1",
                        health_interval_s: float = 0.5) -> Config:
    """Envoy spreading sessions over ``replicas`` (each a `specgate serve`) by a consistent hash
    of ``X-Session-ID``, so a session's requests reach the replica that holds its state.

    A replica that fails two health checks (``/ready``, every ``health_interval_s``) or two
    connections leaves the ring, and only its sessions move; a request it refused or dropped
    before answering is retried on another replica.
    """
    if len(replicas) < 1:
        raise ValueError("ring_hash_bootstrap needs at least one replica")
    interval = _duration(health_interval_s)
    replicas_cluster = _endpoints_cluster(
        REPLICAS_CLUSTER, replicas,
        lb_policy="RING_HASH",
        health_checks=[{
            # Generous against a busy host; a dead one refuses the connection at once.
            "timeout": "2s",
            "interval": interval,
            # Else Envoy checks a cluster that has had no traffic yet only once a minute.
            "no_traffic_interval": interval,
            "unhealthy_threshold": 2,
            "healthy_threshold": 1,
            # /ready is 503 while a replica drains (SIGTERM) or has no ready worker: it leaves too.
            "http_health_check": {"path": "/ready"},
        }],
        # One connection refused or reset ejects a replica at once, so that a retry, which the
        # ring would hash to it again, finds the next one.
        outlier_detection=_eject_on_refused_connection(),
    )
    retry_policy = {
        "retry_on": RETRY_ON,
        "num_retries": NUM_RETRIES,
        # A hash picks the same host again; this makes a retry walk on along the ring instead.
        "retry_host_predicate": [{
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": _typed("envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"),
        }],
        # Each reselection steps one entry along the ring, and a host holds runs of neighbouring
        # entries: with 5 steps, a session whose hash sat in a run of 6 of a dead replica's
        # entries (about 1 in 30 with two replicas) was sent back to it on every retry until
        # the health check removed it. 64 steps pass any run a real ring holds.
        "host_selection_retry_max_attempts": RING_RESELECTIONS,
    }
    hash_policy = [{"header": {"header_name": SESSION_HEADER}}]
    return {
        "admin": _admin(admin_host, admin_port),
        "static_resources": {
            "listeners": [_listener(listen_host, listen_port,
                                    [_route(REPLICAS_CLUSTER, retry_policy, hash_policy)], [])],
            "clusters": [replicas_cluster],
        },
    }


def round_robin_bootstrap(listen_port: int, admin_port: int, endpoints: Sequence[tuple[str, int]], *,
                          listen_host: str = "127.0.0.1", admin_host: str = "127.0.0.1",
                          health_path: str | None = "/ready", health_interval_s: float = 0.5) -> Config:
    """Envoy taking turns over ``endpoints`` (`specgate serve` replicas, or model servers), with
    no affinity: a session's requests land anywhere, so replicas behind it share session state
    through Redis (``state.backend: redis``). Also the baseline that bench.scaleout measures the
    endpoint picker's hop against.

    ``health_path``: checked every ``health_interval_s`` (a replica's ``/ready``; a specgate
    worker serves ``/health``); None: no health checks. A request an endpoint refused or dropped
    before answering is retried, on the next endpoint in turn.
    """
    if len(endpoints) < 1:
        raise ValueError("round_robin_bootstrap needs at least one endpoint")
    fields: Config = {"lb_policy": "ROUND_ROBIN"}
    if health_path is not None:
        interval = _duration(health_interval_s)
        fields["health_checks"] = [{"timeout": "2s", "interval": interval, "no_traffic_interval": interval,
                                    "unhealthy_threshold": 2, "healthy_threshold": 1,
                                    "http_health_check": {"path": health_path}}]
    cluster = _endpoints_cluster(ROUND_ROBIN_CLUSTER, endpoints, **fields)
    retry_policy = {"retry_on": RETRY_ON, "num_retries": NUM_RETRIES}
    return {
        "admin": _admin(admin_host, admin_port),
        "static_resources": {
            "listeners": [_listener(listen_host, listen_port, [_route(ROUND_ROBIN_CLUSTER, retry_policy)], [])],
            "clusters": [cluster],
        },
    }


def _duration(seconds: float) -> str:
    return f"{seconds:g}s"


def to_yaml(bootstrap: Config) -> str:
    return yaml.safe_dump(bootstrap, sort_keys=False)


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.epp.envoy_config",
                                     description="Print an Envoy bootstrap config (YAML) for specgate.")
    modes = parser.add_subparsers(dest="mode", required=True)
    epp = modes.add_parser("epp", help="Envoy asking `specgate epp` (ext_proc) where each request goes")
    epp.add_argument("--epp", type=_host_port, action="append", required=True,
                     help="an endpoint picker's gRPC HOST:PORT (repeat the flag for each replica)")
    epp.add_argument("--body-mode", choices=("BUFFERED", "FULL_DUPLEX_STREAMED"), default="BUFFERED")
    ring = modes.add_parser("ring-hash", help="Envoy hashing X-Session-ID over `specgate serve` replicas")
    ring.add_argument("--replica", type=_host_port, action="append", required=True,
                      help="a replica's HOST:PORT (repeat the flag for each)")
    robin = modes.add_parser("round-robin", help="Envoy taking turns over `specgate serve` replicas (no affinity)")
    robin.add_argument("--replica", type=_host_port, action="append", required=True,
                       help="a replica's HOST:PORT (repeat the flag for each)")
    robin.add_argument("--health-path", default="/ready", help="the HTTP health check's path")
    for sub in (epp, ring, robin):
        sub.add_argument("--listen", type=_host_port, default=("127.0.0.1", 8080), help="HOST:PORT clients use")
        sub.add_argument("--admin", type=_host_port, default=("127.0.0.1", 9901), help="Envoy's admin HOST:PORT")
    args = parser.parse_args(argv)
    (listen_host, listen_port), (admin_host, admin_port) = args.listen, args.admin
    if args.mode == "epp":
        bootstrap = epp_bootstrap(listen_port, admin_port, args.epp, body_mode=args.body_mode,
                                  listen_host=listen_host, admin_host=admin_host)
    elif args.mode == "round-robin":
        bootstrap = round_robin_bootstrap(listen_port, admin_port, args.replica, listen_host=listen_host,
                                          admin_host=admin_host, health_path=args.health_path)
    else:
        bootstrap = ring_hash_bootstrap(listen_port, admin_port, args.replica,
                                        listen_host=listen_host, admin_host=admin_host)
    sys.stdout.write(to_yaml(bootstrap))
    return 0


if __name__ == "__main__":
    sys.exit(main())
