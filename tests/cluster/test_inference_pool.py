"""InferencePool discovery: the pool's selector and target ports turn Ready Pods into engines
(pure parsing first), then the follower against a fake API server on 127.0.0.1 (Pods scaling
and turning not ready, the pool's selector and ports changing, the pool deleted, errors and
410 Gone), driving a real registry, in poll and watch mode."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fake_kube import serve, wait_until
from fake_kube_pool import PODS, POOLS, FakePoolApi, inference_pool, pod
from test_discovery import STATIC, healthy_engines

from gateway.cluster.discovery import RegistryMembership, Target, create_discovery
from gateway.cluster.inference_pool import (
    InferencePoolDiscovery,
    pod_targets,
    pool_ports,
    pool_selector,
)
from gateway.cluster.monitor import EngineMonitor
from gateway.cluster.registry import EngineRegistry
from gateway.config import DiscoveryConfig, InferencePoolConfig, load_settings
from gateway.core.errors import ConfigError
from gateway.core.types import EngineRole
from gateway.policies.dispatcher import Dispatcher
from gateway.policies.registry import create_policy
from gateway.proxy.app import create_app

APP = {"app": "vllm"}
POOL = InferencePoolConfig(name="vllm-pool")


# -- parsing ------------------------------------------------------------------------------
def test_selector_and_ports_of_a_pool() -> None:
    p = inference_pool("p", {"b": "2", "a": "1"}, [8000, 8001, 8000])
    assert pool_selector(p) == "a=1,b=2"
    assert pool_ports(p) == (8000, 8001)
    assert pool_selector(inference_pool("p", {}, [8000])) is None
    assert pool_selector(None) is None and pool_ports(None) == ()
    assert pool_ports({"spec": {"targetPorts": [{"number": "80"}, {"number": 0}, {}]}}) == ()


def test_ready_pods_become_one_engine_per_target_port() -> None:
    pods = [
        pod("a", "10.0.0.1", APP),
        pod("b", "10.0.0.2", APP, ready=False),
        pod("c", "10.0.0.3", APP, deleting=True),
        pod("d", None, APP),  # not scheduled yet: no IP
        pod("e", "10.0.0.5", {"app": "other"}),
        pod("f", "fd00::6", {**APP, "extra": "x"}),
    ]
    got = pod_targets(pods, "app=vllm", (8000,), POOL)
    assert list(got) == ["http://10.0.0.1:8000", "http://[fd00::6]:8000"]
    two = pod_targets(pods[:1], "app=vllm", (8000, 8200), POOL)
    assert list(two) == ["http://10.0.0.1:8000", "http://10.0.0.1:8200"]
    assert pod_targets(pods, None, (8000,), POOL) == {}
    assert pod_targets(pods, "app=vllm", (), POOL) == {}


def test_role_label_model_key_and_scheme() -> None:
    source = InferencePoolConfig(name="p", model="llama", api_key="k", scheme="https")
    pods = [
        pod("p", "10.0.0.1", {**APP, "llm-d.ai/role": "prefill"}),
        pod("d", "10.0.0.2", {**APP, "llm-d.ai/role": "decode"}),
        pod("x", "10.0.0.3", {**APP, "llm-d.ai/role": "unknown"}),
    ]
    got = pod_targets(pods, "app=vllm", (8000,), source)
    assert got["https://10.0.0.1:8000"] == Target(
        "https://10.0.0.1:8000", EngineRole.PREFILL, "llama", "k"
    )
    assert got["https://10.0.0.2:8000"].role is EngineRole.DECODE
    assert got["https://10.0.0.3:8000"].role is EngineRole.BOTH
    no_label = InferencePoolConfig(name="p", role_label=None)
    assert {t.role for t in pod_targets(pods, "app=vllm", (1,), no_label).values()} == {
        EngineRole.BOTH
    }


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="pool is set exactly"):
        load_settings(discovery={"kind": "inferencepool"})
    with pytest.raises(ConfigError, match="pool is set exactly"):
        load_settings(
            discovery={"kind": "kubernetes", "services": [{"name": "v"}], "pool": {"name": "p"}}
        )
    with pytest.raises(ConfigError, match="only used with kind"):
        load_settings(
            discovery={"kind": "inferencepool", "pool": {"name": "p"}, "services": [{"name": "v"}]}
        )
    with pytest.raises(ConfigError, match="DNS label"):
        load_settings(discovery={"kind": "inferencepool", "pool": {"name": "Pool_1"}})
    d = load_settings(discovery={"kind": "inferencepool", "pool": {"name": "p"}}).discovery
    assert d.pool is not None and d.pool.name == "p" and d.pool.role_label == "llm-d.ai/role"


# -- against a fake API server ------------------------------------------------------------
class Rig:
    def __init__(self, api: FakePoolApi, url: str, tmp: Path, watch: bool) -> None:
        token = tmp / "serviceaccount" / "token"
        token.parent.mkdir(exist_ok=True)
        token.write_text("pool-token\n")
        (token.parent / "namespace").write_text("inference\n")
        self.api = api
        self.registry = EngineRegistry()
        self.registry.add(STATIC)
        self.client = httpx.AsyncClient(transport=httpx.MockTransport(healthy_engines))
        monitor = EngineMonitor(self.registry, self.client)
        members = RegistryMembership(
            self.registry, monitor, Dispatcher(create_policy("round_robin"))
        )
        config = DiscoveryConfig(
            kind="inferencepool",
            pool=POOL,
            api_server=url,
            token_file=str(token),
            watch=watch,
            resync_s=30.0,
            backoff_s=0.05,
            backoff_max_s=0.2,
            interval_s=0.05,
            timeout_s=2.0,
        )
        found = create_discovery(config, members)
        assert isinstance(found, InferencePoolDiscovery)
        self.discovery = found

    def urls(self) -> set[str]:
        return {e.id for e in self.registry.all()}

    async def follows(self, *engines: str, what: str = "registry") -> None:
        want = {STATIC} | {f"http://{e}" for e in engines}
        await wait_until(lambda: self.urls() == want, what=f"{what}: {sorted(want)}")

    async def aclose(self) -> None:
        self.api.close_watches()
        await self.discovery.stop()
        await self.client.aclose()


@pytest.fixture(params=[False, True], ids=["poll", "watch"])
async def rig(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Rig]:
    fake = FakePoolApi()
    async with serve(fake.app()) as url:
        r = Rig(fake, url, tmp_path, watch=request.param)
        try:
            yield r
        finally:
            await r.aclose()


def ip(n: int) -> str:
    return f"127.0.0.{n + 10}"  # loopback: nothing is ever sent there


async def test_pods_of_the_pool_follow_scale_and_readiness(rig: Rig) -> None:
    api = rig.api
    api.put(POOLS, inference_pool("vllm-pool", APP, [8000]))
    api.put(POOLS, inference_pool("other-pool", {"app": "other"}, [9000]))
    api.put(PODS, pod("v1", ip(1), APP))
    api.put(PODS, pod("v2", ip(2), APP, ready=False))
    api.put(PODS, pod("o1", ip(9), {"app": "other"}))
    await rig.discovery.start(wait_s=5)
    assert rig.discovery.synced.is_set()
    await rig.follows(f"{ip(1)}:8000", what="initial list")

    api.put(PODS, pod("v2", ip(2), APP))
    api.put(PODS, pod("v3", ip(3), APP))
    await rig.follows(f"{ip(1)}:8000", f"{ip(2)}:8000", f"{ip(3)}:8000", what="scale up")
    api.put(PODS, pod("v1", ip(1), APP, deleting=True))
    api.delete(PODS, "v3")
    await rig.follows(f"{ip(2)}:8000", what="one deleting, one gone")
    assert rig.registry.get(STATIC) is not None

    pools = api.requests(POOLS, watch=False)
    pods = api.requests(PODS, watch=False)
    assert pools[0].query["fieldSelector"] == "metadata.name=vllm-pool"
    assert pods[0].query["labelSelector"] == "app=vllm"
    assert pools[0].authorization == "Bearer pool-token"
    if rig.discovery.config.watch:
        assert len(pods) == 1 and api.requests(PODS, watch=True)  # changes came by watch


async def test_pool_changes_move_the_engines(rig: Rig) -> None:
    api = rig.api
    api.put(POOLS, inference_pool("vllm-pool", APP, [8000]))
    api.put(PODS, pod("v1", ip(1), APP))
    api.put(PODS, pod("n1", ip(5), {"app": "vllm-next"}))
    await rig.discovery.start(wait_s=5)
    await rig.follows(f"{ip(1)}:8000")

    api.put(POOLS, inference_pool("vllm-pool", APP, [8100]))  # the target port changes
    await rig.follows(f"{ip(1)}:8100", what="new target port")
    api.put(POOLS, inference_pool("vllm-pool", {"app": "vllm-next"}, [8100]))  # new selector
    await rig.follows(f"{ip(5)}:8100", what="new selector")
    assert any(s.query.get("labelSelector") == "app=vllm-next" for s in api.seen)
    api.delete(POOLS, "vllm-pool")
    await rig.follows(what="pool deleted")


async def test_errors_keep_the_engines_then_recover(rig: Rig) -> None:
    api = rig.api
    api.put(POOLS, inference_pool("vllm-pool", APP, [8000]))
    api.put(PODS, pod("v1", ip(1), APP))
    api.put(PODS, pod("v2", ip(2), APP))
    await rig.discovery.start(wait_s=5)
    await rig.follows(f"{ip(1)}:8000", f"{ip(2)}:8000")
    api.failures[PODS] += [500, 403, 500]
    api.expire_watches()  # (watch mode) forces a relist that meets the failures
    await wait_until(lambda: rig.discovery.errors >= 3, what="three failed requests")
    assert rig.urls() == {STATIC, f"http://{ip(1)}:8000", f"http://{ip(2)}:8000"}
    api.delete(PODS, "v2")
    await rig.follows(f"{ip(1)}:8000", what="recovery")


async def test_start_waits_for_the_pods_not_only_the_pool(tmp_path: Path) -> None:
    fake = FakePoolApi()
    fake.put(POOLS, inference_pool("vllm-pool", APP, [8000]))
    fake.put(PODS, pod("v1", ip(1), APP))
    async with serve(fake.app()) as url:
        r = Rig(fake, url, tmp_path, watch=True)
        try:
            await r.discovery.start(wait_s=5)
            # ready means engines known: registered before start returns
            assert r.urls() == {STATIC, f"http://{ip(1)}:8000"}
        finally:
            await r.aclose()


# -- in the app's lifespan (the routing service builds it) ---------------------------------
async def test_the_gateway_serves_the_pools_pods(tmp_path: Path) -> None:
    fake = FakePoolApi()
    fake.put(POOLS, inference_pool("vllm-pool", APP, [8000]))
    fake.put(PODS, pod("v1", ip(1), APP))
    fake.put(PODS, pod("v2", ip(2), APP))
    token = tmp_path / "token"
    token.write_text("t")
    async with serve(fake.app()) as url:
        settings = load_settings(
            engines=[{"url": STATIC}],
            discovery={
                "kind": "inferencepool",
                "namespace": "inference",
                "pool": {"name": "vllm-pool"},
                "api_server": url,
                "token_file": str(token),
                "watch": False,
                "interval_s": 0.05,
            },
            log_requests=False,
        )
        app = create_app(settings, transport=httpx.MockTransport(healthy_engines))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as gw:
                r = await gw.get("/admin/engines")
                urls = {e["url"] for e in r.json()["engines"]}
                # registered before start-up completed
                assert urls == {STATIC, f"http://{ip(1)}:8000", f"http://{ip(2)}:8000"}
                fake.put(PODS, pod("v2", ip(2), APP, ready=False))

                async def engines() -> set[str]:
                    r = await gw.get("/admin/engines")
                    return {e["url"] for e in r.json()["engines"]}

                want = {STATIC, f"http://{ip(1)}:8000"}
                for _ in range(200):
                    if await engines() == want:
                        break
                    await asyncio.sleep(0.02)
                assert await engines() == want
