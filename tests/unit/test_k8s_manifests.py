"""deploy/k8s/ checked without a cluster: every object against its schema, the EPP's config through
the real parser, and the references between objects (route -> pool -> EPP Service -> EPP pods;
pool -> model-server pods; EPP config -> model-server DNS names; ServiceMonitors -> Services).

Built-in kinds are validated by kubernetes-validate (strict: an unknown field fails) against
KUBERNETES_VERSION; InferencePool, HTTPRoute and ServiceMonitor against the JSON Schemas in
tests/schemas/, converted from their upstream CRDs (tests/schemas/README.md). Every check is
shown to fail on a mutated copy (test_each_check_catches_its_mutation). No cluster, no processes,
no network.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from gateway.cli import check_problems
from gateway.config.auth import ADMIN_TOKEN_ENV, API_KEYS_ENV, WORKER_TOKEN_ENV, parse_auth
from gateway.config.config import ConfigError, parse_config
from tests.schemas.crd_to_jsonschema import convert
from workers.__main__ import TOKEN_ENV, parse_args

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"
DOC = REPO / "docs" / "scale-out.md"
KUBERNETES_VERSION = "1.33.0"
NAMESPACE = "specgate"
SECRET = "specgate-auth"
# By kind: each schema pins its apiVersion, so a manifest of another version fails against it.
CUSTOM_SCHEMAS = {
    "InferencePool": ("inference.networking.k8s.io/v1", "inferencepool.json"),
    "HTTPRoute": ("gateway.networking.k8s.io/v1", "httproute.json"),
    "ServiceMonitor": ("monitoring.coreos.com/v1", "servicemonitor.json"),
}
EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"

Manifest = dict[str, Any]


# -- loading -------------------------------------------------------------------------------------------
def kustomization() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return loaded


@functools.cache
def _manifests() -> str:
    docs = [doc for name in kustomization()["resources"]
            for doc in yaml.safe_load_all((K8S / name).read_text()) if doc is not None]
    return json.dumps(docs)  # a frozen copy: each caller gets its own to mutate


def manifests() -> list[Manifest]:
    loaded: list[Manifest] = json.loads(_manifests())
    return loaded


def find(docs: list[Manifest], kind: str, name: str) -> Manifest:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(workload: Manifest) -> dict[str, Any]:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    assert isinstance(only, dict)
    return only


def epp_config_text(docs: list[Manifest]) -> str:
    text: str = find(docs, "ConfigMap", "specgate-epp-config")["data"]["config.yaml"]
    return text


def label(doc: Manifest) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


# -- the checks: each returns its problems, so that a test can show it finding one ----------------------
@functools.cache
def custom_schema(filename: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / filename).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def schema_problems(doc: Manifest) -> list[str]:
    if doc["kind"] in CUSTOM_SCHEMAS:
        _, filename = CUSTOM_SCHEMAS[doc["kind"]]
        return [f"{label(doc)}: {'.'.join(map(str, e.absolute_path))}: {e.message}"
                for e in custom_schema(filename).iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{label(doc)}: {'.'.join(map(str, exc.absolute_path))}: {exc.message}"]
    return []


def config_problems(docs: list[Manifest]) -> list[str]:
    """The EPP's config.yaml: accepted by the gateway's own parser, and set up as an EPP needs."""
    try:
        config = parse_config(yaml.safe_load(epp_config_text(docs)), Path("/etc/specgate"))
    except ConfigError as exc:
        return [str(problem) for problem in exc.problems]
    wanted = {"state.backend": (config.state.backend, "redis"), "epp.host": (config.epp.host, "0.0.0.0"),
              "server.host": (config.server.host, "0.0.0.0"), "workers.count": (config.workers.count, 0),
              "auth.admin_token": (config.auth.admin_token, None)}  # the Secret's, through the environment
    return [f"{key}: {got!r}, not {want!r}" for key, (got, want) in wanted.items() if got != want]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def named_port(ports: list[dict[str, Any]], port: int | str) -> int | None:
    """A container's port number for a Service targetPort or probe port (a number or a name)."""
    numbers = {p["containerPort"] for p in ports}
    if isinstance(port, int):
        return port if port in numbers else None
    return next((p["containerPort"] for p in ports if p.get("name") == port), None)


def cross_problems(docs: list[Manifest]) -> list[str]:
    problems: list[str] = []

    def expect(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    raw = yaml.safe_load(epp_config_text(docs))
    route, pool = find(docs, "HTTPRoute", "specgate"), find(docs, "InferencePool", "specgate-pool")
    epp, epp_service = find(docs, "Deployment", "specgate-epp"), find(docs, "Service", "specgate-epp")
    workers, worker_service = find(docs, "StatefulSet", "specgate-worker"), find(docs, "Service", "specgate-worker")
    redis, redis_service = find(docs, "Deployment", "specgate-redis"), find(docs, "Service", "specgate-redis")

    # HTTPRoute -> InferencePool
    backends = [ref for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]
    expect(all((ref.get("group"), ref.get("kind"), ref["name"])
               == ("inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"]) for ref in backends),
           f"HTTPRoute backendRefs {backends} do not all name InferencePool {pool['metadata']['name']}")
    expect([p["name"] for p in route["spec"]["parentRefs"]] == ["inference-gateway"],
           f"HTTPRoute parentRefs {route['spec']['parentRefs']}, not the Gateway inference-gateway")

    # InferencePool -> model-server pods
    worker_pod, worker_box = workers["spec"]["template"], container(workers)
    selector = pool["spec"]["selector"]["matchLabels"]
    expect(matches(selector, worker_pod["metadata"]["labels"]),
           f"InferencePool selector {selector} does not match the model-server pods")
    for other in (redis, epp):
        expect(not matches(selector, other["spec"]["template"]["metadata"]["labels"]),
               f"InferencePool selector {selector} also matches {label(other)}'s pods")
    worker_ports = [p["containerPort"] for p in worker_box["ports"]]
    target_ports = [p["number"] for p in pool["spec"]["targetPorts"]]
    expect(target_ports == worker_ports, f"InferencePool targetPorts {target_ports}, model servers {worker_ports}")

    # InferencePool -> EPP Service -> EPP pods
    picker = pool["spec"]["endpointPickerRef"]
    expect(picker.get("kind", "Service") == "Service" and picker["name"] == epp_service["metadata"]["name"],
           f"endpointPickerRef {picker} does not name the Service {epp_service['metadata']['name']}")
    exposed = {p["port"]: p for p in epp_service["spec"]["ports"]}
    grpc = exposed.get(picker["port"]["number"])
    expect(grpc is not None, f"endpointPickerRef port {picker['port']['number']} is not one the EPP Service exposes")
    epp_box = container(epp)
    expect(matches(epp_service["spec"]["selector"], epp["spec"]["template"]["metadata"]["labels"]),
           "the EPP Service's selector does not match the EPP pods")
    epp_port = raw.get("epp", {}).get("port", 9002)
    if grpc is not None:
        expect(named_port(epp_box["ports"], grpc["targetPort"]) == epp_port,
               f"the EPP Service's port {grpc['port']} targets {grpc['targetPort']!r}, not the container's epp.port "
               f"{epp_port}")
    http_port = raw.get("server", {}).get("port", 8000)
    expect(named_port(epp_box["ports"], "http") == http_port, f"the EPP container's port http is not {http_port}")
    for probe, health_service in (("livenessProbe", ""), ("readinessProbe", EXT_PROC)):
        expect(epp_box[probe].get("grpc") == {"port": epp_port, "service": health_service},
               f"EPP {probe} {epp_box[probe]} is not gRPC health of {health_service!r} on {epp_port}")

    # EPP command -> its config
    mounts = {m["name"]: m["mountPath"] for m in epp_box["volumeMounts"]}
    volumes = {v["name"]: v for v in epp["spec"]["template"]["spec"]["volumes"]}
    config_dir = next((mounts[n] for n, v in volumes.items() if v.get("configMap", {}).get("name")
                       == "specgate-epp-config"), None)
    expect(epp_box["command"] == ["specgate", "epp", "--config", f"{config_dir}/config.yaml"],
           f"EPP command {epp_box['command']} does not read the ConfigMap's config.yaml (mounted at {config_dir})")

    # EPP config -> model-server DNS names
    sts_name, service_name = workers["metadata"]["name"], worker_service["metadata"]["name"]
    namespace = workers["metadata"]["namespace"]
    expect(workers["spec"]["serviceName"] == service_name and worker_service["spec"].get("clusterIP") == "None",
           f"the StatefulSet's serviceName is not the headless Service {service_name}")
    (worker_port,) = worker_ports
    pods = [f"{sts_name}-{i}" for i in range(workers["spec"]["replicas"])]
    want = [{"url": f"http://{pod}.{service_name}.{namespace}.svc.cluster.local:{worker_port}",
             "protocol": "specgate", "name": pod} for pod in pods]
    remote = raw.get("workers", {}).get("remote", [])
    expect(remote == want, f"workers.remote {remote}, not the StatefulSet's pods {want}")
    expect(worker_service["spec"]["ports"][0]["port"] == worker_port and
           named_port(worker_box["ports"], worker_service["spec"]["ports"][0]["targetPort"]) == worker_port,
           "the headless Service's port is not the model servers'")

    # model-server command, probes and GPU
    command = worker_box["command"]
    expect(command[:2] == ["specgate", "worker"], f"model-server command {command[:2]}")
    args = parse_args(command[2:], "specgate worker")  # the worker's own parser
    expect(args.port == worker_port and args.host == "0.0.0.0",
           f"the worker listens on {args.host}:{args.port}, not 0.0.0.0:{worker_port}")
    expect(args.served_model_name == raw.get("model", {}).get("name"),
           f"the worker serves {args.served_model_name!r}, clients ask the EPP for "
           f"{raw.get('model', {}).get('name')!r}")
    expect(args.worker_id == "$(POD_NAME)", "the worker id is not the pod's name")
    probe = worker_box["readinessProbe"].get("httpGet", {})
    expect(probe.get("path") == "/health" and named_port(worker_box["ports"], probe.get("port", 0)) == worker_port,
           f"model-server readiness probe {probe} is not GET /health on {worker_port}")
    gpus = worker_box["resources"]["limits"].get("nvidia.com/gpu")
    expect(gpus == 1, f"model servers ask for nvidia.com/gpu {gpus}")

    # EPP config -> Redis
    url = re.fullmatch(r"redis://([^:/]+):(\d+)/\d+", raw.get("state", {}).get("redis_url", ""))
    redis_ports = {p["port"]: p["targetPort"] for p in redis_service["spec"]["ports"]}
    expect(url is not None and url[1] == redis_service["metadata"]["name"] and int(url[2]) in redis_ports
           and named_port(container(redis)["ports"], redis_ports[int(url[2])]) == 6379,
           f"state.redis_url {raw.get('state')} does not reach the Redis Service")
    expect(matches(redis_service["spec"]["selector"], redis["spec"]["template"]["metadata"]["labels"]),
           "the Redis Service's selector does not match the Redis pod")

    # ServiceMonitors -> Services
    for name, service in (("specgate-epp", epp_service), ("specgate-worker", worker_service)):
        monitor = find(docs, "ServiceMonitor", name)
        expect(matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"]),
               f"ServiceMonitor {name}'s selector does not match the Service {service['metadata']['name']}")
        port_names = {p["name"] for p in service["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            expect(endpoint["port"] in port_names and endpoint.get("path", "/metrics") == "/metrics",
                   f"ServiceMonitor {name} scrapes {endpoint['port']!r}, which {sorted(port_names)} lacks")

    # Secrets: the variables the code reads, from the one Secret the docs say how to create
    epp_env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in epp_box["env"]}
    worker_env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in worker_box["env"]}
    for env, names in ((epp_env, (ADMIN_TOKEN_ENV, API_KEYS_ENV, WORKER_TOKEN_ENV)), (worker_env, (TOKEN_ENV,))):
        for name in names:
            expect(bool(env.get(name)) and env[name]["name"] == SECRET, f"{name} does not come from Secret {SECRET}")
    worker_monitor = find(docs, "ServiceMonitor", "specgate-worker")["spec"]["endpoints"][0]
    expect(worker_monitor.get("authorization", {}).get("credentials") == worker_env.get(TOKEN_ENV),
           "the workers' ServiceMonitor does not send the workers' token")
    return problems


def secret_keys(docs: list[Manifest]) -> set[str]:
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("secretKeyRef") or (node.get("credentials") if node.get("type") == "Bearer" else None)
            if isinstance(ref, dict):
                found.add(f"{ref['name']}/{ref['key']}")
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(docs)
    return found


# -- the deployment as it is -------------------------------------------------------------------------
def test_kustomization_lists_every_manifest_in_one_namespace() -> None:
    kust = kustomization()
    files = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kust["resources"]) == files
    assert kust["namespace"] == NAMESPACE
    docs = manifests()
    for doc in docs:
        assert doc["metadata"].get("namespace", NAMESPACE) == NAMESPACE or doc["kind"] == "Namespace", label(doc)
    assert {d["kind"] for d in docs} == {"Namespace", "Deployment", "StatefulSet", "Service", "ConfigMap",
                                         "InferencePool", "HTTPRoute", "ServiceMonitor"}
    images = {c["image"].split(":")[0] for d in docs if d["kind"] in ("Deployment", "StatefulSet")
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert {i["name"] for i in kust["images"]} <= images


@pytest.mark.parametrize("doc", manifests(), ids=label)
def test_each_manifest_is_valid(doc: Manifest) -> None:
    assert schema_problems(doc) == []


def test_schemas_name_their_upstream_crd() -> None:
    readme = (SCHEMAS / "README.md").read_text()
    for kind, (api_version, filename) in CUSTOM_SCHEMAS.items():
        comment = json.loads((SCHEMAS / filename).read_text())["$comment"]
        assert comment.startswith(f"{kind} {api_version}, converted from the CRD in github.com/"), filename
        assert re.search(r"@v\d+\.\d+\.\d+ \([0-9a-f]{40}\)", comment), filename
        assert filename in readme


def test_the_conversion_closes_objects_unless_the_crd_keeps_unknown_fields() -> None:
    crd_schema = {"type": "object", "description": "dropped", "x-kubernetes-validations": [{"rule": "true"}],
                  "properties": {
                      "closed": {"type": "object", "properties": {"a": {"type": "string", "nullable": True}}},
                      "open": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                               "properties": {"b": {"type": "integer"}}},
                      "map": {"type": "object", "additionalProperties": {"type": "string"}},
                      "port": {"x-kubernetes-int-or-string": True},
                      "mode": {"type": "string", "enum": ["x"], "default": "x"}}}
    assert convert(crd_schema) == {"type": "object", "additionalProperties": False, "properties": {
        "closed": {"type": "object", "additionalProperties": False, "properties": {"a": {"type": ["string", "null"]}}},
        "open": {"type": "object", "properties": {"b": {"type": "integer"}}},
        "map": {"type": "object", "additionalProperties": {"type": "string"}},
        "port": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "mode": {"type": "string", "enum": ["x"], "default": "x"}}}


def test_epp_config_passes_the_gateway_parser() -> None:
    docs = manifests()
    assert config_problems(docs) == []
    raw = yaml.safe_load(epp_config_text(docs))
    config = parse_config(raw, Path("/etc/specgate"))
    assert config.state.redis_url == "redis://specgate-redis:6379/0" and config.epp.port == 9002
    assert [w.protocol for w in config.workers.remote] == ["specgate", "specgate"]
    secrets = {ADMIN_TOKEN_ENV: "admin-token-0123456789", API_KEYS_ENV: "sk-one-0123456789,sk-two-0123456789",
               WORKER_TOKEN_ENV: "worker-token-0123456789"}
    auth = parse_auth(raw["auth"], secrets)  # what the pod's environment brings
    assert auth.admin_token == "admin-token-0123456789" and len(auth.api_keys) == 2
    assert auth.worker_token == "worker-token-0123456789"


def test_specgate_check_finds_nothing_but_the_unused_model_directories(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `specgate check` also wants model.target and model.draft on disk (gateway/cli.py
    # model_problems), which an EPP with workers.count: 0 never reads and does not mount.
    for name in (ADMIN_TOKEN_ENV, API_KEYS_ENV, WORKER_TOKEN_ENV):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "config.yaml"
    path.write_text(epp_config_text(manifests()))
    problems = check_problems(path, "config", environ={})
    assert all(p.startswith(("model.target: no model at", "model.draft: no model at")) for p in problems), problems


def test_the_manifests_reference_each_other() -> None:
    assert cross_problems(manifests()) == []


def test_the_docs_create_every_secret_key_the_manifests_read() -> None:
    keys = secret_keys(manifests())
    assert keys == {f"{SECRET}/admin-token", f"{SECRET}/api-keys", f"{SECRET}/worker-token"}
    text = DOC.read_text()
    assert "## On Kubernetes" in text and "kubectl apply -k deploy/k8s" in text
    assert f"create secret generic {SECRET}" in text
    for key in keys:
        assert f"--from-literal={key.split('/')[1]}=" in text, key


# -- every check can fail --------------------------------------------------------------------------------
def _walk(doc: Manifest, path: tuple[str | int, ...]) -> Any:
    node: Any = doc
    for part in path:
        node = node[part]
    return node


def _set(kind: str, name: str, path: tuple[str | int, ...], value: Any) -> Callable[[list[Manifest]], None]:
    def mutate(docs: list[Manifest]) -> None:
        _walk(find(docs, kind, name), path[:-1])[path[-1]] = value

    return mutate


def _rename(kind: str, name: str, path: tuple[str | int, ...], new: str) -> Callable[[list[Manifest]], None]:
    """A misspelled field: the last key of path renamed, its value kept."""

    def mutate(docs: list[Manifest]) -> None:
        parent = _walk(find(docs, kind, name), path[:-1])
        parent[new] = parent.pop(path[-1])

    return mutate


def _config(edit: Callable[[dict[str, Any]], None]) -> Callable[[list[Manifest]], None]:
    """An edit of the EPP's config.yaml inside its ConfigMap."""

    def mutate(docs: list[Manifest]) -> None:
        config_map = find(docs, "ConfigMap", "specgate-epp-config")
        raw = yaml.safe_load(config_map["data"]["config.yaml"])
        edit(raw)
        config_map["data"]["config.yaml"] = yaml.safe_dump(raw)

    return mutate


def _remote_url(raw: dict[str, Any], url: str) -> None:
    raw["workers"]["remote"][0]["url"] = url


BOX: tuple[str | int, ...] = ("spec", "template", "spec", "containers", 0)  # a workload's one container
COMPONENT = ("spec", "selector", "matchLabels", "app.kubernetes.io/component")
Mutation = Callable[[list[Manifest]], None]
MUTATIONS: list[tuple[str, str, Mutation, str]] = [
    # (id, the check, the mutation, a part of the problem the check must report)
    ("deployment-misspelled-field", "schema", _rename("Deployment", "specgate-epp", ("spec", "replicas"), "replica"),
     "'replica' was unexpected"),
    ("statefulset-port-as-string", "schema",
     _set("StatefulSet", "specgate-worker", (*BOX, "ports", 0, "containerPort"), "8001"), "is not of type 'integer'"),
    ("service-misspelled-field", "schema",
     _rename("Service", "specgate-epp", ("spec", "ports", 0, "targetPort"), "target_port"),
     "'target_port' was unexpected"),
    ("configmap-data-not-string", "schema", _set("ConfigMap", "specgate-epp-config", ("data", "extra"), 1),
     "is not of type 'string'"),
    ("namespace-misspelled-field", "schema", _rename("Namespace", "specgate", ("metadata", "labels"), "label"),
     "'label' was unexpected"),
    ("pool-misspelled-field", "schema",
     _rename("InferencePool", "specgate-pool", ("spec", "targetPorts"), "targetPort"), "'targetPort' was unexpected"),
    ("pool-bad-failure-mode", "schema",
     _set("InferencePool", "specgate-pool", ("spec", "endpointPickerRef", "failureMode"), "FailSoft"),
     "is not one of"),
    ("pool-old-api-version", "schema",
     _set("InferencePool", "specgate-pool", ("apiVersion",), "inference.networking.x-k8s.io/v1alpha2"),
     "'inference.networking.k8s.io/v1' was expected"),
    ("route-misspelled-field", "schema",
     _rename("HTTPRoute", "specgate", ("spec", "rules", 0, "backendRefs"), "backendRef"),
     "'backendRef' was unexpected"),
    ("route-bad-timeout", "schema", _set("HTTPRoute", "specgate", ("spec", "rules", 0, "timeouts", "request"),
                                         "forever"), "does not match"),
    ("monitor-misspelled-field", "schema",
     _rename("ServiceMonitor", "specgate-epp", ("spec", "endpoints", 0, "port"), "ports"), "'ports' was unexpected"),
    ("config-unknown-key", "config", _config(lambda raw: raw["epp"].update(prot=9002)), "epp.prot: unknown field"),
    ("config-bad-port", "config", _config(lambda raw: raw["epp"].update(port=70000)), "epp.port"),
    ("config-memory-state", "config", _config(lambda raw: raw["state"].update(backend="memory")), "state.backend"),
    ("config-loopback-epp", "config", _config(lambda raw: raw["epp"].update(host="127.0.0.1")), "epp.host"),
    ("route-names-another-pool", "cross",
     _set("HTTPRoute", "specgate", ("spec", "rules", 0, "backendRefs", 0, "name"), "other"),
     "do not all name InferencePool"),
    ("route-wrong-gateway", "cross", _set("HTTPRoute", "specgate", ("spec", "parentRefs", 0, "name"), "gw"),
     "parentRefs"),
    ("pool-selects-nothing", "cross", _set("InferencePool", "specgate-pool", COMPONENT, "worker"),
     "does not match the model-server pods"),
    ("pool-selects-the-epp-too", "cross",
     _set("InferencePool", "specgate-pool", ("spec", "selector", "matchLabels"),
          {"app.kubernetes.io/name": "specgate"}),
     "also matches Deployment/specgate-epp"),
    ("pool-wrong-target-port", "cross", _set("InferencePool", "specgate-pool", ("spec", "targetPorts", 0, "number"),
                                             8000), "InferencePool targetPorts [8000]"),
    ("picker-wrong-port", "cross",
     _set("InferencePool", "specgate-pool", ("spec", "endpointPickerRef", "port", "number"), 9003),
     "is not one the EPP Service exposes"),
    ("picker-wrong-service", "cross",
     _set("InferencePool", "specgate-pool", ("spec", "endpointPickerRef", "name"), "epp"),
     "does not name the Service"),
    ("epp-service-wrong-target", "cross", _set("Service", "specgate-epp", ("spec", "ports", 0, "targetPort"), "http"),
     "not the container's epp.port"),
    ("epp-readiness-wrong-service", "cross",
     _set("Deployment", "specgate-epp", (*BOX, "readinessProbe", "grpc", "service"), ""), "readinessProbe"),
    ("epp-config-elsewhere", "cross",
     _set("Deployment", "specgate-epp", (*BOX, "volumeMounts", 0, "mountPath"), "/config"),
     "does not read the ConfigMap"),
    ("remote-wrong-host", "cross", _config(lambda raw: _remote_url(
        raw, "http://specgate-worker-0.specgate.specgate.svc.cluster.local:8001")), "workers.remote"),
    ("remote-wrong-port", "cross", _config(lambda raw: _remote_url(
        raw, "http://specgate-worker-0.specgate-worker.specgate.svc.cluster.local:8002")), "workers.remote"),
    ("more-replicas-than-remotes", "cross", _set("StatefulSet", "specgate-worker", ("spec", "replicas"), 3),
     "workers.remote"),
    ("worker-listens-elsewhere", "cross", _set("StatefulSet", "specgate-worker", (*BOX, "command", 9), "8002"),
     "not 0.0.0.0:8001"),
    ("worker-serves-another-model", "cross", _set("StatefulSet", "specgate-worker", (*BOX, "command", 13), "llama"),
     "the worker serves 'llama'"),
    ("worker-without-gpu", "cross",
     _set("StatefulSet", "specgate-worker", (*BOX, "resources", "limits", "nvidia.com/gpu"), 0), "nvidia.com/gpu 0"),
    ("worker-probe-wrong-path", "cross",
     _set("StatefulSet", "specgate-worker", (*BOX, "readinessProbe", "httpGet", "path"), "/ready"), "readiness probe"),
    ("redis-url-wrong-host", "cross", _config(lambda raw: raw["state"].update(redis_url="redis://redis:6379/0")),
     "does not reach the Redis Service"),
    ("monitor-selects-nothing", "cross", _set("ServiceMonitor", "specgate-epp", COMPONENT, "gateway"),
     "selector does not match the Service specgate-epp"),
    ("monitor-unknown-port", "cross",
     _set("ServiceMonitor", "specgate-worker", ("spec", "endpoints", 0, "port"), "metrics"), "scrapes 'metrics'"),
    ("epp-secret-elsewhere", "cross",
     _set("Deployment", "specgate-epp", (*BOX, "env", 0, "valueFrom", "secretKeyRef", "name"), "other"),
     f"{ADMIN_TOKEN_ENV} does not come from Secret"),
]
CHECKS: dict[str, Callable[[list[Manifest]], list[str]]] = {
    "schema": lambda docs: [p for doc in docs for p in schema_problems(doc)],
    "config": config_problems,
    "cross": cross_problems,
}


@pytest.mark.parametrize(("check", "mutate", "problem"), [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS])
def test_each_check_catches_its_mutation(check: str, mutate: Mutation, problem: str) -> None:
    docs = manifests()
    assert CHECKS[check](docs) == []
    mutate(docs)
    found = CHECKS[check](docs)
    assert any(problem in p for p in found), found
