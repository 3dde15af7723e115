"""Kubernetes engine discovery: EndpointSlice parsing and diffing on recorded responses,
then the follower against a fake API server on 127.0.0.1 (scale up and down, endpoints
turning not ready, 410 Gone, 403 and 500 errors), driving a real registry."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_kube import FakeKubeApi, endpoint, endpoint_slice, load, serve, wait_until

from gateway.cluster.discovery import (
    KubeDiscovery,
    Plan,
    RegistryMembership,
    Target,
    plan,
    slice_port,
    slice_targets,
)
from gateway.cluster.kube_api import in_cluster_api_server
from gateway.cluster.monitor import EngineMonitor
from gateway.cluster.registry import EngineRegistry, Health
from gateway.config import DiscoveryConfig, KubeServiceConfig, load_settings
from gateway.core.errors import ConfigError
from gateway.core.types import EngineRole
from gateway.policies.dispatcher import Dispatcher
from gateway.policies.registry import create_policy
from gateway.proxy.app import create_app

VLLM = KubeServiceConfig(name="vllm")


def items(name: str) -> list[dict[str, Any]]:
    return load(name)["items"]


# -- parsing ------------------------------------------------------------------------------
def test_ready_endpoints_become_engines_and_others_do_not() -> None:
    targets = slice_targets(items("endpointslices_vllm.json"), VLLM)
    # 10.244.3.4 is not ready, 10.244.4.21 is terminating; 10.244.5.3 has no conditions
    # at all, which the API says means ready.
    assert list(targets) == [
        "http://10.244.1.17:8000",
        "http://10.244.2.9:8000",
        "http://10.244.5.3:8000",
    ]
    assert all(t.role is EngineRole.BOTH and t.model is None for t in targets.values())


def test_role_model_key_and_scheme_come_from_the_source() -> None:
    source = KubeServiceConfig(
        name="vllm", role="decode", model="llama-3-8b", api_key="s3cret", scheme="https"
    )
    targets = slice_targets(items("endpointslices_vllm.json"), source)
    first = targets["https://10.244.1.17:8000"]
    assert first == Target("https://10.244.1.17:8000", EngineRole.DECODE, "llama-3-8b", "s3cret")


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (KubeServiceConfig(name="vllm-decode"), None),  # two ports: ambiguous, skipped
        (KubeServiceConfig(name="vllm-decode", port_name="http"), 8000),
        (KubeServiceConfig(name="vllm-decode", port_name="metrics"), 9090),
        (KubeServiceConfig(name="vllm-decode", port_name="grpc"), None),
        (KubeServiceConfig(name="vllm-decode", port=8001), 8001),
    ],
)
def test_port_selection(source: KubeServiceConfig, expected: int | None) -> None:
    slices = items("endpointslices_multiport.json")
    assert slice_port(slices[0], source) == expected
    urls = list(slice_targets(slices, source))
    assert urls == (
        []
        if expected is None
        else [f"http://10.12.0.31:{expected}", f"http://10.12.0.32:{expected}"]
    )


def test_ipv6_addresses_are_bracketed() -> None:
    assert list(slice_targets(items("endpointslices_ipv6.json"), VLLM)) == [
        "http://[fd00:10:244:1::17]:8000"
    ]


def test_empty_and_malformed_slices_give_no_engines() -> None:
    assert slice_targets(items("endpointslices_empty.json"), VLLM) == {}
    junk: list[Any] = [
        {"ports": [{"name": "http", "port": 8000}], "endpoints": None},
        {"ports": [{"name": "http", "port": 8000}], "endpoints": [{"addresses": []}, "x", None]},
        {"ports": [{"port": "8000"}], "endpoints": [{"addresses": ["10.0.0.1"]}]},
        {"ports": None, "endpoints": [{"addresses": ["10.0.0.1"]}]},
        "not a slice",
    ]
    assert slice_targets(junk, VLLM) == {}


def test_an_address_in_two_slices_is_one_engine() -> None:
    a = endpoint_slice("vllm-a", "vllm", [endpoint("10.0.0.1")])
    b = endpoint_slice("vllm-b", "vllm", [endpoint("10.0.0.1"), endpoint("10.0.0.2")])
    assert list(slice_targets([a, b], VLLM)) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


# -- diffing ------------------------------------------------------------------------------
def t(url: str, role: EngineRole = EngineRole.BOTH) -> Target:
    return Target(url, role)


def test_plan_adds_new_and_removes_vanished() -> None:
    desired = {u: t(u) for u in ["http://b:1", "http://c:1"]}
    managed = {u: t(u) for u in ["http://a:1", "http://b:1"]}
    assert plan(desired, managed, {"http://a:1", "http://b:1"}) == Plan(
        add=(t("http://c:1"),), remove=("http://a:1",)
    )


def test_plan_never_touches_engines_registered_by_others() -> None:
    static = "http://static:1"
    desired = {u: t(u) for u in [static, "http://b:1"]}
    assert plan(desired, {}, {static}) == Plan(add=(t("http://b:1"),))
    assert plan({}, {}, {static}) == Plan()


def test_plan_replaces_a_managed_engine_whose_role_changed_and_readds_deleted_ones() -> None:
    url = "http://a:1"
    change = plan({url: t(url, EngineRole.PREFILL)}, {url: t(url)}, {url})
    assert change == Plan(add=(t(url, EngineRole.PREFILL),), remove=(url,))
    # removed through DELETE /admin/engines while still ready: discovery adds it back
    assert plan({url: t(url)}, {url: t(url)}, set()) == Plan(add=(t(url),))
    assert plan({url: t(url)}, {url: t(url)}, {url}) == Plan()


# -- configuration ------------------------------------------------------------------------
def test_discovery_config_validation() -> None:
    with pytest.raises(ConfigError, match="services"):
        load_settings(discovery={"kind": "kubernetes"})
    with pytest.raises(ConfigError, match="only used with kind"):
        load_settings(discovery={"services": [{"name": "vllm"}]})
    with pytest.raises(ConfigError, match="port_name or port"):
        load_settings(
            discovery={
                "kind": "kubernetes",
                "services": [{"name": "v", "port": 1, "port_name": "h"}],
            }
        )
    with pytest.raises(ConfigError, match="DNS label"):
        load_settings(discovery={"kind": "kubernetes", "services": [{"name": "vllm/../x"}]})
    with pytest.raises(ConfigError, match="listed twice"):
        load_settings(discovery={"kind": "kubernetes", "services": [{"name": "v"}, {"name": "v"}]})
    with pytest.raises(ConfigError, match="Extra inputs"):
        load_settings(discovery={"kind": "kubernetes", "services": [{"name": "v", "svc": 1}]})
    assert load_settings().discovery.kind == "static"


def test_discovery_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_DISCOVERY__KIND", "kubernetes")
    monkeypatch.setenv(
        "KVGATE_DISCOVERY__SERVICES",
        '[{"name": "vllm-prefill", "role": "prefill"}, {"name": "vllm-decode", "role": "decode"}]',
    )
    monkeypatch.setenv("KVGATE_DISCOVERY__INTERVAL_S", "2.5")
    d = load_settings().discovery
    assert d.kind == "kubernetes" and d.interval_s == 2.5
    assert [(s.name, s.role) for s in d.services] == [
        ("vllm-prefill", "prefill"),
        ("vllm-decode", "decode"),
    ]


def test_api_server_defaults_to_the_in_cluster_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert in_cluster_api_server(env) == "https://10.96.0.1:443"
    assert in_cluster_api_server({"KUBERNETES_SERVICE_HOST": "fd00::1"}) == "https://[fd00::1]:443"
    with pytest.raises(ConfigError, match="api_server"):
        in_cluster_api_server({})
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    cfg = DiscoveryConfig(kind="kubernetes", services=[VLLM])
    with pytest.raises(ConfigError, match="api_server"):
        KubeDiscovery(cfg, _NullMembership())


class _NullMembership:
    def registered(self) -> set[str]:
        return set()

    async def add(self, targets: Any) -> None:
        pass

    def remove(self, url: str) -> None:
        pass


# -- against a fake API server ------------------------------------------------------------
STATIC = "http://127.0.0.1:9"


def healthy_engines(request: httpx.Request) -> httpx.Response:
    """Every engine answers like vLLM (no network: addresses are only names here)."""
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})
    if request.url.path == "/metrics":
        return httpx.Response(200, text="# no series\n")
    return httpx.Response(200)


class Rig:
    """A registry with one static engine, driven by a KubeDiscovery against the fake API."""

    def __init__(self, api: FakeKubeApi, url: str, tmp: Path, **options: Any) -> None:
        token = tmp / "serviceaccount" / "token"
        token.parent.mkdir(exist_ok=True)
        token.write_text("test-token\n")
        (token.parent / "namespace").write_text("inference\n")
        self.api = api
        self.registry = EngineRegistry()
        self.registry.add(STATIC)
        self.client = httpx.AsyncClient(transport=httpx.MockTransport(healthy_engines))
        self.monitor = EngineMonitor(self.registry, self.client)
        self.dispatcher = Dispatcher(create_policy("round_robin"))
        services = options.pop("services", [{"name": "vllm"}])
        config = DiscoveryConfig(
            kind="kubernetes",
            services=services,
            api_server=url,
            token_file=str(token),
            backoff_s=0.05,
            backoff_max_s=0.2,
            interval_s=0.05,
            timeout_s=2.0,
            **options,
        )
        members = RegistryMembership(self.registry, self.monitor, self.dispatcher)
        self.discovery = KubeDiscovery(config, members)

    def urls(self) -> set[str]:
        return {e.id for e in self.registry.all()}

    async def follows(self, *ports: int, what: str = "registry") -> None:
        want = {STATIC} | {f"http://127.0.0.{p % 200 + 10}:8000" for p in ports}
        await wait_until(lambda: self.urls() == want, what=f"{what}: {sorted(want)}")

    async def aclose(self) -> None:
        await self.discovery.stop()
        await self.client.aclose()


def pod(n: int, **kw: Any) -> dict[str, Any]:
    """Pod number ``n`` at 127.0.0.<n+10> (loopback: nothing is ever sent there)."""
    return endpoint(f"127.0.0.{n % 200 + 10}", **kw)


@pytest.fixture
async def api() -> AsyncIterator[tuple[FakeKubeApi, str]]:
    fake = FakeKubeApi()
    try:
        async with serve(fake.app()) as url:
            yield fake, url
    finally:
        fake.close_watches()


@pytest.fixture(params=[False, True], ids=["poll", "watch"])
async def rig(
    request: pytest.FixtureRequest, api: tuple[FakeKubeApi, str], tmp_path: Path
) -> AsyncIterator[Rig]:
    fake, url = api
    r = Rig(fake, url, tmp_path, watch=request.param, resync_s=30.0)
    try:
        yield r
    finally:
        fake.close_watches()
        await r.aclose()


async def test_registry_follows_scale_up_not_ready_and_scale_down(rig: Rig) -> None:
    api = rig.api
    api.put(endpoint_slice("vllm-abc", "vllm", [pod(1), pod(2)]))
    api.put(endpoint_slice("other-xyz", "other", [pod(50)]))  # another Service: ignored
    await rig.discovery.start(wait_s=5)
    assert rig.discovery.synced.is_set()
    await rig.follows(1, 2, what="initial list")
    engine = rig.registry.get("http://127.0.0.11:8000")
    assert engine is not None and engine.health is Health.HEALTHY and engine.models == ("m",)

    api.put(endpoint_slice("vllm-abc", "vllm", [pod(1), pod(2), pod(3, ready=False)]))
    api.put(endpoint_slice("vllm-def", "vllm", [pod(4)]))
    await rig.follows(1, 2, 4, what="scale up (3 not ready yet)")

    api.put(endpoint_slice("vllm-abc", "vllm", [pod(1), pod(2, ready=False), pod(3)]))
    await rig.follows(1, 3, 4, what="2 turned not ready, 3 ready")

    api.put(endpoint_slice("vllm-abc", "vllm", [pod(1, ready=False, terminating=True), pod(3)]))
    await rig.follows(3, 4, what="1 terminating")

    api.delete("vllm-def")
    api.put(endpoint_slice("vllm-abc", "vllm", []))
    await rig.follows(what="scaled to zero")
    assert rig.registry.get(STATIC) is not None  # the static engine is never touched

    seen = api.seen[0]
    assert seen.authorization == "Bearer test-token"
    assert seen.namespace == "inference"  # the service account's namespace
    assert seen.query["labelSelector"] == "kubernetes.io/service-name=vllm"
    if rig.discovery.config.watch:
        assert api.watches >= 1 and api.lists <= 2  # changes came through the watch
        assert any(s.query.get("resourceVersion") for s in api.seen if s.watch)
    else:
        assert api.watches == 0


async def test_errors_keep_the_last_known_set_and_are_retried(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    api = rig.api
    api.put(endpoint_slice("vllm-abc", "vllm", [pod(1), pod(2)]))
    await rig.discovery.start(wait_s=5)
    await rig.follows(1, 2)

    # The API goes bad: a 403, then 500s; the engines stay until a list succeeds again.
    api.list_failures += [403, 500, 500]
    api.watch_failures += [500]
    lists = api.lists
    api.expire_watches()  # (watch mode) forces a relist that meets the failures
    with caplog.at_level(logging.WARNING, logger="kvgate.discovery"):
        await wait_until(lambda: rig.discovery.errors >= 3, what="3 failed requests")
        assert rig.urls() == {STATIC, "http://127.0.0.11:8000", "http://127.0.0.12:8000"}
        api.put(endpoint_slice("vllm-abc", "vllm", [pod(1)]))
        await rig.follows(1, what="recovery after errors")
    assert api.lists > lists + 3
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "cannot list resource" in messages  # the 403's message
    assert "keeping its 2 engines" in messages


async def test_api_server_down_at_start_then_up(tmp_path: Path) -> None:
    fake = FakeKubeApi()
    fake.put(endpoint_slice("vllm-abc", "vllm", [pod(1)]))
    async with serve(fake.app()) as url:
        pass  # the port is closed now
    r = Rig(fake, url, tmp_path, watch=True)
    try:
        await r.discovery.start(wait_s=0.3)  # gives up waiting; keeps trying
        assert not r.discovery.synced.is_set() and r.urls() == {STATIC}
        assert r.discovery.errors >= 1
    finally:
        await r.aclose()


async def test_watch_gone_relists_and_picks_up_missed_changes(
    api: tuple[FakeKubeApi, str], tmp_path: Path
) -> None:
    fake, url = api
    r = Rig(fake, url, tmp_path, watch=True, resync_s=30.0)
    try:
        fake.put(endpoint_slice("vllm-abc", "vllm", [pod(1)]))
        await r.discovery.start(wait_s=5)
        await r.follows(1)
        await wait_until(lambda: fake.open_watches == 1, what="a watch")
        # A change the watch never delivers (history compacted), then 410 Gone.
        fake.slices["vllm-abc"]["endpoints"] = [pod(1), pod(2)]
        fake.expire_watches()
        await r.follows(1, 2, what="relist after 410")
        assert fake.lists == 2
        # A watch request answered 410 outright is relisted too.
        await wait_until(lambda: fake.open_watches == 1, what="the second watch")
        fake.watch_failures.append(410)
        fake.close_watches()
        await wait_until(lambda: fake.lists >= 4, what="relist after a 410 answer")
        assert not fake.watch_failures
        fake.put(endpoint_slice("vllm-abc", "vllm", [pod(2)]))
        await r.follows(2, what="watch after relist")
        assert r.discovery.errors == 0
    finally:
        fake.close_watches()
        await r.aclose()


async def test_prefill_and_decode_services_get_their_roles(
    api: tuple[FakeKubeApi, str], tmp_path: Path
) -> None:
    fake, url = api
    services = [
        {"name": "vllm-prefill", "role": "prefill", "model": "llama"},
        {"name": "vllm-decode", "role": "decode", "model": "llama", "port_name": "http"},
    ]
    r = Rig(fake, url, tmp_path, watch=False, services=services)
    try:
        fake.put(endpoint_slice("vllm-prefill-1", "vllm-prefill", [pod(1)]))
        fake.put(endpoint_slice("vllm-decode-1", "vllm-decode", [pod(2), pod(3)]))
        await r.discovery.start(wait_s=5)
        await r.follows(1, 2, 3)
        roles = {e.id: e.role for e in r.registry.all()}
        assert roles["http://127.0.0.11:8000"] is EngineRole.PREFILL
        assert roles["http://127.0.0.12:8000"] is EngineRole.DECODE
        # the same pod moving from one Service to the other changes its role
        fake.put(endpoint_slice("vllm-prefill-1", "vllm-prefill", []))
        fake.put(endpoint_slice("vllm-decode-1", "vllm-decode", [pod(1), pod(2), pod(3)]))
        await wait_until(
            lambda: (
                (e := r.registry.get("http://127.0.0.11:8000")) is not None
                and e.role is EngineRole.DECODE
            ),
            what="role change",
        )
    finally:
        await r.aclose()


async def test_engines_added_by_hand_are_left_alone(
    api: tuple[FakeKubeApi, str], tmp_path: Path
) -> None:
    fake, url = api
    r = Rig(fake, url, tmp_path, watch=False)
    try:
        r.registry.add("http://127.0.0.11:8000")  # e.g. POST /admin/engines, same URL
        fake.put(endpoint_slice("vllm-abc", "vllm", [pod(1), pod(2)]))
        await r.discovery.start(wait_s=5)
        await r.follows(1, 2)
        fake.put(endpoint_slice("vllm-abc", "vllm", []))
        await r.follows(1, what="only the discovered engine removed")
    finally:
        await r.aclose()


# -- in the app's lifespan ------------------------------------------------------------------
def app_settings(api_url: str, tmp: Path, **discovery: Any) -> Any:
    token = tmp / "token"
    token.write_text("t")
    return load_settings(
        engines=[{"url": STATIC}],
        discovery={
            "kind": "kubernetes",
            "namespace": "inference",
            "services": [{"name": "vllm"}],
            "api_server": api_url,
            "token_file": str(token),
            "watch": False,
            "interval_s": 0.05,
            "backoff_s": 0.05,
            **discovery,
        },
        log_requests=False,
    )


async def admin_urls(client: httpx.AsyncClient) -> set[str]:
    r = await client.get("/admin/engines")
    assert r.status_code == 200
    return {e["url"] for e in r.json()["engines"]}


async def test_app_lifespan_runs_discovery_through_the_admin_path(
    api: tuple[FakeKubeApi, str], tmp_path: Path
) -> None:
    fake, url = api
    fake.put(endpoint_slice("vllm-abc", "vllm", [pod(1), pod(2)]))
    app = create_app(app_settings(url, tmp_path), transport=httpx.MockTransport(healthy_engines))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as gw:
            want = {STATIC, "http://127.0.0.11:8000", "http://127.0.0.12:8000"}
            assert await admin_urls(gw) == want  # registered before startup completed
            assert (await gw.get("/ready")).status_code == 200
            # an admin DELETE of a still-ready discovered engine: discovery puts it back
            r = await gw.delete("/admin/engines", params={"url": "http://127.0.0.12:8000"})
            assert r.status_code == 200
            for _ in range(200):
                if await admin_urls(gw) == want:
                    break
                await asyncio.sleep(0.02)
            assert await admin_urls(gw) == want
            fake.put(endpoint_slice("vllm-abc", "vllm", [pod(2)]))
            for _ in range(200):
                if await admin_urls(gw) == {STATIC, "http://127.0.0.12:8000"}:
                    break
                await asyncio.sleep(0.02)
            assert await admin_urls(gw) == {STATIC, "http://127.0.0.12:8000"}
            assert app.state.gateway.dispatcher.in_flight.get("http://127.0.0.11:8000") is None


async def test_app_starts_with_its_static_engines_when_the_api_is_down(tmp_path: Path) -> None:
    fake = FakeKubeApi()
    async with serve(fake.app()) as url:
        pass  # nothing listens there any more
    app = create_app(
        app_settings(url, tmp_path, timeout_s=0.3), transport=httpx.MockTransport(healthy_engines)
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as gw:
            assert await admin_urls(gw) == {STATIC}
            assert (await gw.get("/ready")).status_code == 200


async def test_an_ambiguous_port_is_reported_once(
    api: tuple[FakeKubeApi, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake, url = api
    two_ports = load("endpointslices_multiport.json")["items"][0]
    two_ports["endpoints"] = [pod(1)]
    fake.put(two_ports)
    r = Rig(fake, url, tmp_path, watch=False, services=[{"name": "vllm-decode"}])
    try:
        with caplog.at_level(logging.WARNING, logger="kvgate.discovery"):
            await r.discovery.start(wait_s=5)
            await wait_until(lambda: fake.lists >= 4, what="several polls")
        assert r.urls() == {STATIC}
        warnings = [m for m in caplog.messages if "no single port matches" in m]
        assert warnings == [
            "EndpointSlice vllm-decode-5tq8n: no single port matches (set port_name)"
        ]
    finally:
        await r.aclose()
