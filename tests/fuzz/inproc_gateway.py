"""The gateway app in process, in front of fake engines (tests/proxy/fake_engines.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fake_engines import FakeCluster, FakeEngine
from fastapi import FastAPI

from gateway.config import load_settings
from gateway.proxy.app import create_app

A, B = "http://a:1", "http://b:1"


@asynccontextmanager
async def running_app(
    *engines: FakeEngine, engine_keys: dict[str, str] | None = None, **settings: Any
) -> AsyncIterator[FastAPI]:
    keys = engine_keys or {}
    cfg = load_settings(
        engines=[{"url": e.url, "api_key": keys.get(e.url)} for e in engines],
        retries={"max_attempts": 3, "backoff_s": 0.0},
        log_requests=False,
        **settings,
    )
    app = create_app(cfg, transport=FakeCluster(*engines).transport())
    async with app.router.lifespan_context(app):
        yield app


def client_of(app: FastAPI, ip: str = "127.0.0.1") -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(ip, 5000))
    return httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=10)


@asynccontextmanager
async def gateway(*engines: FakeEngine, **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with running_app(*engines, **settings) as app, client_of(app) as client:
        yield client
