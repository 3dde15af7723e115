"""End to end: a running gateway with ``discovery.kind: kubernetes`` against the fake API
server, in front of real emulated engines (processes) that it finds through EndpointSlices."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_kube import FakeKubeApi, endpoint, endpoint_slice, serve

from gateway.config import load_settings
from gateway.proxy.app import create_app
from tests.e2e.procs import MODEL, Proc, start_emulator

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Proc]]:
    logdir = tmp_path_factory.mktemp("discovery-e2e")
    procs: list[Proc] = []
    try:
        for i in range(2):
            procs.append(start_emulator(logdir, i))
        yield procs
    finally:
        for p in procs:
            p.stop()


def engine_slice(proc: Proc, *, ready: bool = True) -> dict[str, Any]:
    """One slice per emulator: they share 127.0.0.1 and differ by port."""
    port = int(proc.url.rsplit(":", 1)[1])
    return endpoint_slice(f"vllm-{port}", "vllm", [endpoint("127.0.0.1", ready=ready)], port=port)


async def listed(client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    r = await client.get("/admin/engines")
    assert r.status_code == 200, r.text
    return {e["url"]: e for e in r.json()["engines"]}


async def test_gateway_serves_the_engines_it_discovers(engines: list[Proc], tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("e2e-token")
    api = FakeKubeApi()
    api.put(engine_slice(engines[0]))
    async with serve(api.app()) as api_url:
        settings = load_settings(
            discovery={
                "kind": "kubernetes",
                "namespace": "inference",
                "services": [{"name": "vllm", "port_name": "http"}],
                "api_server": api_url,
                "token_file": str(token),
                "backoff_s": 0.05,
            },
            health={"interval_s": 0.2},
            log_requests=False,
        )
        try:
            async with (
                serve(create_app(settings)) as gw_url,
                httpx.AsyncClient(base_url=gw_url, timeout=30) as gw,
            ):
                # discovered during startup, probed healthy, models read from the engine
                first = await listed(gw)
                assert list(first) == [engines[0].url]
                assert first[engines[0].url]["health"] == "healthy"
                assert first[engines[0].url]["models"] == [MODEL]
                assert (await gw.get("/ready")).status_code == 200

                # scale up: the second engine appears and takes traffic
                api.put(engine_slice(engines[1]))
                await wait_for_engines(gw, {e.url for e in engines})
                used = set()
                for i in range(6):
                    r = await gw.post(
                        "/v1/completions",
                        json={"model": MODEL, "prompt": f"request {i} " * 3, "max_tokens": 2},
                    )
                    assert r.status_code == 200, r.text
                    used.add(r.headers["x-kvgate-engine"])
                assert used <= {e.url for e in engines}

                # the first engine turns not ready: out of the gateway
                api.put(engine_slice(engines[0], ready=False))
                await wait_for_engines(gw, {engines[1].url})
                r = await gw.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
                )
                assert r.headers["x-kvgate-engine"] == engines[1].url
        finally:
            api.close_watches()
    assert all(s.authorization == "Bearer e2e-token" for s in api.seen)


async def wait_for_engines(gw: httpx.AsyncClient, urls: set[str], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        state = await listed(gw)
        if set(state) == urls and all(e["routable"] for e in state.values()):
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"gateway lists {sorted(state)}, expected {sorted(urls)}")
        await asyncio.sleep(0.02)
