"""Emulator fixtures: an in-process app with its lifespan, and a real uvicorn server."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from gateway.cli.emulate import bind
from gateway.emulator import EmulatorSettings, create_emulator_app
from gateway.emulator.state import EmulatorState


@asynccontextmanager
async def running_app(
    settings: EmulatorSettings,
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """The app with its lifespan entered, and an httpx client talking to it in-process."""
    app = create_emulator_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://emulator") as client:
            yield app, client


def state_of(app: FastAPI) -> EmulatorState:
    state: EmulatorState = app.state.emulator
    return state


@contextmanager
def serve(settings: EmulatorSettings) -> Iterator[tuple[str, FastAPI]]:
    """A real uvicorn server on 127.0.0.1 (free port) in a thread; yields its base URL."""
    app = create_emulator_app(settings)
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the emulator did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def metrics_of(text: str) -> dict[str, float]:
    """Samples keyed by name plus sorted labels (model_name/engine dropped)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k not in {"model_name", "engine"}}
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(labels.items()))
            out[key] = s.value
    return out


# -- P/D helpers ---------------------------------------------------------------------

TO_PREFILL: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""The prefill leg's ``kv_transfer_params``, as vLLM's toy P/D proxy sends it."""


async def prefill_leg(client: httpx.AsyncClient, prompt: str) -> dict[str, Any]:
    """Send ``prompt`` as the prefill leg of a P/D pair; the JSON reply."""
    r = await client.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": 1, "kv_transfer_params": TO_PREFILL},
    )
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def wait_for(check: Callable[[], bool], timeout: float = 3.0) -> None:
    """Poll ``check`` until it holds (fails the test after ``timeout`` seconds)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)
