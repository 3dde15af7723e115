"""deploy/k8s: every manifest against the Kubernetes OpenAPI schemas (kubernetes-validate,
offline, strict: unknown fields are errors), the ServiceMonitor against a minimal
hand-written schema, and the cross-references between the manifests and the code: labels
and selectors, the mounted config, the CLI flags, the probed routes, the admin key's
variable and the RBAC that discovery needs."""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml

from gateway.cli import build_parser
from gateway.cli.serve import settings_from_args
from gateway.cluster.discovery import API_PATH
from gateway.config import Settings, load_settings
from gateway.proxy.app import create_app

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
EXAMPLES = K8S / "examples"
SERVICEMONITOR_SCHEMA = Path(__file__).parent / "schemas" / "servicemonitor.schema.json"
# the oldest Kubernetes the manifests claim to work with (deploy/k8s/README.md), while the
# installed kubernetes-validate still ships its schemas, and the newest it ships
VERSIONS = sorted(
    {"1.29.0", kubernetes_validate.utils.latest_version()}
    & set(kubernetes_validate.utils.all_versions())
)
GATEWAY_PODS = {"app.kubernetes.io/name": "kvgate", "app.kubernetes.io/component": "gateway"}


def manifest_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.yaml") if p.name != "kustomization.yaml")


@cache
def documents(path: Path) -> tuple[dict[str, Any], ...]:
    with path.open(encoding="utf-8") as fh:
        return tuple(d for d in yaml.safe_load_all(fh) if d is not None)


def objects(folder: Path) -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for path in manifest_files(folder):
        for doc in documents(path):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, f"{key} defined twice"
            out[key] = doc
    return out


BASE = objects(K8S)
EXAMPLE = objects(EXAMPLES)
ALL_FILES = manifest_files(K8S) + manifest_files(EXAMPLES)


def gateway_container() -> dict[str, Any]:
    containers = BASE["Deployment", "kvgate"]["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def validate_servicemonitor(doc: dict[str, Any]) -> None:
    schema = json.loads(SERVICEMONITOR_SCHEMA.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(doc)


def validate(doc: dict[str, Any], version: str) -> None:
    if doc["apiVersion"].startswith("monitoring.coreos.com/"):
        validate_servicemonitor(doc)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


# -- schemas ----------------------------------------------------------------------------------
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_is_valid(path: Path, version: str) -> None:
    docs = documents(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        validate(doc, version)


def test_the_validators_catch_mistakes() -> None:
    deployment = copy.deepcopy(BASE["Deployment", "kvgate"])
    deployment["spec"]["replica"] = 2  # a typo: strict validation refuses unknown fields
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment, VERSIONS[-1])
    deployment = copy.deepcopy(BASE["Deployment", "kvgate"])
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8000"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment, VERSIONS[-1])
    monitor = copy.deepcopy(BASE["ServiceMonitor", "kvgate"])
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor, VERSIONS[-1])
    monitor["spec"]["endpoints"][0] = {"path": "/metrics", "intervall": "15s"}
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor, VERSIONS[-1])


@pytest.mark.parametrize("folder", [K8S, EXAMPLES], ids=["base", "examples"])
def test_kustomization_lists_every_manifest(folder: Path) -> None:
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text(encoding="utf-8"))
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == [p.name for p in manifest_files(folder)]
    assert "namespace" not in kustomization


def test_manifests_are_namespace_agnostic() -> None:
    for path in ALL_FILES:
        for doc in documents(path):
            assert "namespace" not in doc["metadata"], f"{path}: {doc['metadata']['name']}"
            for subject in doc.get("subjects", []):
                assert "namespace" not in subject


# -- cross-references ---------------------------------------------------------------------------
def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_labels_and_selectors_agree() -> None:
    deployment = BASE["Deployment", "kvgate"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pod_labels == GATEWAY_PODS
    assert selects(deployment["spec"]["selector"]["matchLabels"], pod_labels)
    service = BASE["Service", "kvgate"]
    assert selects(service["spec"]["selector"], pod_labels)
    assert selects(
        BASE["PodDisruptionBudget", "kvgate"]["spec"]["selector"]["matchLabels"], pod_labels
    )
    pod_spec = deployment["spec"]["template"]["spec"]
    for constraint in pod_spec["topologySpreadConstraints"]:
        assert selects(constraint["labelSelector"]["matchLabels"], pod_labels)
    for term in pod_spec["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]:
        assert selects(term["podAffinityTerm"]["labelSelector"]["matchLabels"], pod_labels)
    monitor = BASE["ServiceMonitor", "kvgate"]
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= service_ports
    container_ports = {p["name"]: p["containerPort"] for p in gateway_container()["ports"]}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in container_ports
    assert service["spec"]["type"] == "ClusterIP"
    assert [p["port"] for p in service["spec"]["ports"]] == [8000]


def serve_args(tmp_path: Path | None = None) -> Any:
    command = gateway_container()["command"]
    assert command[:2] == ["kvgate", "serve"]
    args = build_parser().parse_args(command[1:])  # the real CLI: unknown flags exit
    assert args.command == "serve"
    if tmp_path is not None:
        args.config = str(tmp_path / "config.yaml")
    return args


def mounted_config(tmp_path: Path) -> Path:
    """The ConfigMap key the Deployment's --config names, written where the test can read it."""
    args = serve_args()
    container = gateway_container()
    pod = BASE["Deployment", "kvgate"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    config = Path(args.config)
    mounts = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == config.parent]
    assert len(mounts) == 1, "--config must be in a mounted folder"
    volume = volumes[mounts[0]["name"]]
    configmap = BASE["ConfigMap", volume["configMap"]["name"]]
    assert config.name in configmap["data"], f"ConfigMap has no key {config.name}"
    out = tmp_path / "config.yaml"
    out.write_text(configmap["data"][config.name], encoding="utf-8")
    return out


def test_the_mounted_config_parses_with_the_gateway_settings(tmp_path: Path) -> None:
    settings = load_settings(mounted_config(tmp_path))
    assert settings.discovery.kind == "kubernetes" and settings.discovery.watch
    assert settings.engines == []
    # it points at the example engines' Service and its port name
    engines_service = EXAMPLE["Service", "vllm"]
    (source,) = settings.discovery.services
    assert source.name == engines_service["metadata"]["name"]
    assert source.port_name in {p["name"] for p in engines_service["spec"]["ports"]}
    assert source.namespace is None and settings.discovery.namespace is None  # the pod's own
    args = serve_args()
    assert (args.host, args.port) == ("0.0.0.0", 8000) == (settings.host, settings.port)
    container_ports = [p["containerPort"] for p in gateway_container()["ports"]]
    assert container_ports == [settings.port]


def test_kvgate_serve_accepts_the_mounted_config(tmp_path: Path) -> None:
    mounted_config(tmp_path)
    settings = settings_from_args(serve_args(tmp_path))
    assert settings.discovery.kind == "kubernetes"


def one_engine(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})
    return httpx.Response(200, text="")


async def test_probes_and_scrapes_hit_routes_the_app_serves() -> None:
    container = gateway_container()
    named_ports = {p["name"] for p in container["ports"]}
    probes = [container[k]["httpGet"] for k in ("startupProbe", "readinessProbe", "livenessProbe")]
    assert [p["path"] for p in probes[1:]] == ["/ready", "/health"]
    assert all(p["port"] in named_ports for p in probes)
    scrapes = [e["path"] for e in BASE["ServiceMonitor", "kvgate"]["spec"]["endpoints"]]
    settings = load_settings(engines=[{"url": "http://engine:8000"}], log_requests=False)
    app = create_app(settings, transport=httpx.MockTransport(one_engine))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=("10.0.0.9", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as gw:
            for path in [p["path"] for p in probes] + scrapes:
                r = await gw.get(path)
                assert r.status_code == 200, f"GET {path}: {r.status_code}"
            assert "kvgate_" in (await gw.get(scrapes[0])).text
            assert (await gw.get("/no-such-route")).status_code == 404


def test_admin_key_comes_from_a_secret_under_the_settings_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {e["name"]: e for e in gateway_container()["env"]}
    name = f"{Settings.model_config['env_prefix']}ADMIN_KEY"
    assert "admin_key" in Settings.model_fields
    assert env[name]["valueFrom"]["secretKeyRef"]["key"]
    monkeypatch.setenv(name, "from-the-secret")
    admin_key = load_settings().admin_key
    assert admin_key is not None and admin_key.get_secret_value() == "from-the-secret"


def test_rbac_grants_what_discovery_calls_and_nothing_more() -> None:
    match = re.fullmatch(r"/apis/([^/]+)/v1/namespaces/\{namespace\}/(\w+)", API_PATH)
    assert match, API_PATH
    group, resource = match.groups()
    role = BASE["Role", "kvgate-discovery"]
    (rule,) = role["rules"]
    assert rule["apiGroups"] == [group] and rule["resources"] == [resource]
    assert {"list", "watch"} <= set(rule["verbs"]) <= {"get", "list", "watch"}
    binding = BASE["RoleBinding", "kvgate-discovery"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "kvgate-discovery",
    }
    pod = BASE["Deployment", "kvgate"]["spec"]["template"]["spec"]
    account = pod["serviceAccountName"]
    assert ("ServiceAccount", account) in BASE
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert pod.get("automountServiceAccountToken", True)  # discovery reads token + CA
    assert not any(kind == "ClusterRole" for kind, _ in BASE)


def test_the_gateway_runs_hardened_and_highly_available() -> None:
    deployment = BASE["Deployment", "kvgate"]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert BASE["PodDisruptionBudget", "kvgate"]["spec"]["minAvailable"] == 1
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = gateway_container()
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert {"cpu", "memory"} <= set(container["resources"]["limits"])
    # a writable /tmp on the read-only root, and the image kustomize replaces
    tmp = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert tmp and "emptyDir" in {v["name"]: v for v in pod["volumes"]}[tmp[0]["name"]]
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text(encoding="utf-8"))
    assert container["image"] in {i["name"] for i in kustomization["images"]}
    # drains in-flight requests: uvicorn's 30 s graceful shutdown fits in the grace period
    assert pod["terminationGracePeriodSeconds"] > 30


def test_the_example_engines_are_a_headless_vllm_service() -> None:
    service = EXAMPLE["Service", "vllm"]
    deployment = EXAMPLE["Deployment", "vllm"]
    assert service["spec"]["clusterIP"] == "None"
    assert not service["spec"].get("publishNotReadyAddresses", False)
    pod = deployment["spec"]["template"]
    assert selects(service["spec"]["selector"], pod["metadata"]["labels"])
    assert selects(deployment["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    (container,) = pod["spec"]["containers"]
    assert container["image"].startswith("vllm/vllm-openai:")
    assert "--enable-prefix-caching" in container["args"]
    port = container["args"][container["args"].index("--port") + 1]
    assert [p["containerPort"] for p in container["ports"]] == [int(port)] == [8000]
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= {
        p["name"] for p in container["ports"]
    }
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
