"""deploy/k8s/inference-gateway: kvgate as an InferencePool's endpoint picker. Core objects
against Kubernetes' schemas (kubernetes-validate, strict), the InferencePool and HTTPRoute
against minimal schemas written from the published CRDs (tests/deploy/schemas), and the
cross-references: the pool's picker is the EPP Service's gRPC port, its selector and target
port are the example engines', the route's backend is the pool, the mounted config is an
InferencePool discovery of that pool, and the RBAC grants exactly what discovery reads."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from test_k8s_manifests import EXAMPLE, VERSIONS, documents, manifest_files, selects

from gateway.cli import build_parser
from gateway.cli.epp import options_from_args
from gateway.cluster.inference_pool import POD_PATH, POOL_PATH
from gateway.config import load_settings
from gateway.epp.health import LIVENESS, READINESS

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "deploy" / "k8s" / "inference-gateway"
SCHEMAS = Path(__file__).parent / "schemas"
CRD_SCHEMAS = {
    "inference.networking.k8s.io/v1": SCHEMAS / "inferencepool.v1.schema.json",
    "gateway.networking.k8s.io/v1": SCHEMAS / "httproute.v1.schema.json",
}
FILES = manifest_files(FOLDER)
OBJECTS = {(d["kind"], d["metadata"]["name"]): d for p in FILES for d in documents(p)}


def crd_validator(api_version: str) -> jsonschema.Draft202012Validator:
    schema = json.loads(CRD_SCHEMAS[api_version].read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def validate(doc: dict[str, Any], version: str = VERSIONS[-1]) -> None:
    if doc["apiVersion"] in CRD_SCHEMAS:
        crd_validator(doc["apiVersion"]).validate(doc)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


def container() -> dict[str, Any]:
    (c,) = OBJECTS["Deployment", "kvgate-epp"]["spec"]["template"]["spec"]["containers"]
    return c


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


# -- schemas ----------------------------------------------------------------------------------
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_manifest_is_valid(path: Path, version: str) -> None:
    docs = documents(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        assert "namespace" not in doc["metadata"]
        validate(doc, version)


def test_the_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((FOLDER / "kustomization.yaml").read_text(encoding="utf-8"))
    assert sorted(kustomization["resources"]) == [p.name for p in FILES]
    assert container()["image"] in {i["name"] for i in kustomization["images"]}


def pool_with(**changes: Any) -> dict[str, Any]:
    pool = copy.deepcopy(OBJECTS["InferencePool", "vllm-pool"])
    pool["spec"].update(changes)
    return pool


@pytest.mark.parametrize(
    "bad",
    [
        pool_with(targetPorts=[]),
        pool_with(targetPorts=[{"number": 8000 + i} for i in range(9)]),  # at most 8
        pool_with(targetPorts=[{"number": 70000}]),
        pool_with(targetPorts=[{"port": 8000}]),
        pool_with(selector={"app": "vllm"}),  # the alpha shape: a bare map
        pool_with(selector={"matchLabels": {"app": "-bad-"}}),
        pool_with(endpointPickerRef={"name": "kvgate-epp", "portNumber": 9002}),  # alpha field
        pool_with(endpointPickerRef={"name": "kvgate-epp"}),  # a Service needs a port
        pool_with(endpointPickerRef={"name": "e", "port": {"number": 9002}, "failureMode": "Open"}),
        pool_with(targetPortNumber=8000),
    ],
)
def test_the_pool_schema_refuses_mistakes(bad: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_the_route_schema_refuses_mistakes() -> None:
    route = copy.deepcopy(OBJECTS["HTTPRoute", "vllm"])
    validate(route)
    route["spec"]["rules"][0]["backendRefs"] = [{"name": "vllm"}]  # a Service with no port
    with pytest.raises(jsonschema.ValidationError):
        validate(route)
    route = copy.deepcopy(OBJECTS["HTTPRoute", "vllm"])
    route["spec"]["rules"][0]["timeouts"]["request"] = "10 minutes"
    with pytest.raises(jsonschema.ValidationError):
        validate(route)


# -- cross-references ---------------------------------------------------------------------------
def test_the_pool_picker_is_the_epp_service_grpc_port() -> None:
    ref = OBJECTS["InferencePool", "vllm-pool"]["spec"]["endpointPickerRef"]
    service = OBJECTS["Service", ref["name"]]
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    (grpc,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert grpc["appProtocol"] == "kubernetes.io/h2c"  # Envoy speaks HTTP/2 to it
    pod = OBJECTS["Deployment", "kvgate-epp"]["spec"]["template"]
    assert selects(service["spec"]["selector"], pod["metadata"]["labels"])
    deployment = OBJECTS["Deployment", "kvgate-epp"]
    assert selects(deployment["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert ports[grpc["targetPort"]] == int(flag(container()["command"], "--port")) == 9002
    metrics = [p for p in service["spec"]["ports"] if p["name"] == "metrics"]
    assert ports[metrics[0]["targetPort"]] == int(flag(container()["command"], "--metrics-port"))
    assert ref["failureMode"] in {"FailOpen", "FailClose"}


def test_the_pool_selects_the_example_engines_at_their_port() -> None:
    spec = OBJECTS["InferencePool", "vllm-pool"]["spec"]
    engine_pod = EXAMPLE["Deployment", "vllm"]["spec"]["template"]
    assert selects(spec["selector"]["matchLabels"], engine_pod["metadata"]["labels"])
    (engine,) = engine_pod["spec"]["containers"]
    assert [p["number"] for p in spec["targetPorts"]] == [
        p["containerPort"] for p in engine["ports"]
    ]


def test_the_route_sends_to_the_pool_through_the_gateway() -> None:
    (rule,) = OBJECTS["HTTPRoute", "vllm"]["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert backend["group"] == "inference.networking.k8s.io"
    assert backend["kind"] == "InferencePool"
    assert ("InferencePool", backend["name"]) in OBJECTS


def test_kvgate_epp_accepts_the_command() -> None:
    command = container()["command"]
    assert command[:2] == ["kvgate", "epp"]
    args = build_parser().parse_args(command[1:])  # the real CLI: unknown flags exit
    options = options_from_args(args)
    assert (options.host, options.port, options.metrics_port) == ("0.0.0.0", 9002, 9090)
    assert options.fallbacks == 0  # one ip:port: what Envoy's ORIGINAL_DST cluster parses


def test_probes_are_grpc_health_on_the_ext_proc_port() -> None:
    c = container()
    grpc_port = int(flag(c["command"], "--port"))
    services = {}
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = c[kind]
        assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}
        assert probe["grpc"]["port"] == grpc_port
        services[kind] = probe["grpc"]["service"]
    assert services["readinessProbe"] == READINESS  # the names kvgate epp serves
    assert services["livenessProbe"] == services["startupProbe"] == LIVENESS


def test_the_mounted_config_discovers_the_pool(tmp_path: Path) -> None:
    command = container()["command"]
    assert command[:2] == ["kvgate", "epp"]
    config = Path(flag(command, "--config"))
    (mount,) = [m for m in container()["volumeMounts"] if Path(m["mountPath"]) == config.parent]
    volumes = OBJECTS["Deployment", "kvgate-epp"]["spec"]["template"]["spec"]["volumes"]
    (volume,) = [v for v in volumes if v["name"] == mount["name"]]
    text = OBJECTS["ConfigMap", volume["configMap"]["name"]]["data"][config.name]
    (tmp_path / "config.yaml").write_text(text, encoding="utf-8")
    settings = load_settings(tmp_path / "config.yaml")
    d = settings.discovery
    assert d.kind == "inferencepool" and d.watch and d.pool is not None
    assert ("InferencePool", d.pool.name) in OBJECTS
    assert d.pool.namespace is None and d.namespace is None  # the pod's own namespace
    assert settings.engines == []


def test_rbac_grants_what_pool_discovery_reads_and_nothing_more() -> None:
    wanted = set()
    for path in (POOL_PATH, POD_PATH):
        m = re.fullmatch(r"/apis?/(?:([^/]+)/)?v1/namespaces/\{namespace\}/(\w+)", path)
        assert m, path
        wanted.add((m.group(1) or "", m.group(2)))
    rules = OBJECTS["Role", "kvgate-epp"]["rules"]
    granted = {(g, r) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
    assert granted == wanted
    for rule in rules:
        assert {"list", "watch"} <= set(rule["verbs"]) <= {"get", "list", "watch"}
    binding = OBJECTS["RoleBinding", "kvgate-epp"]
    pod = OBJECTS["Deployment", "kvgate-epp"]["spec"]["template"]["spec"]
    assert binding["roleRef"]["name"] == "kvgate-epp" and binding["roleRef"]["kind"] == "Role"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"]}]
    assert ("ServiceAccount", pod["serviceAccountName"]) in OBJECTS
    assert not any(kind.startswith("Cluster") for kind, _ in OBJECTS)
