"""Reading the Kubernetes API server for discovery: list, then watch (or poll) a collection.

:class:`KubeApi` is the client (the API server's URL, the service account's token re-read per
request, its CA). :class:`Collection` follows one collection of objects by name, the way the
API asks clients to: list, then watch from the list's ``resourceVersion``; an expired (410
Gone) or ended watch (every ``resync_s``) is followed by a relist; an error keeps the last known
objects and retries with backoff (``backoff_s`` doubling up to ``backoff_max_s``). Memory: the
objects of the followed collections, nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import ssl
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

from gateway.config import DiscoveryConfig
from gateway.core.errors import ConfigError

log = logging.getLogger("kvgate.discovery")

Obj = Mapping[str, Any]


class ApiError(Exception):
    """The API server answered with an error status."""


class KubeApi:
    """The API server, as configured by ``discovery`` (in-cluster defaults)."""

    def __init__(self, config: DiscoveryConfig) -> None:
        self.config = config
        self.url = config.api_server or in_cluster_api_server(os.environ)
        account = Path(config.token_file).parent  # default: the pod's own namespace
        self.namespace = config.namespace or read_text(account / "namespace") or "default"
        verify: ssl.SSLContext | bool = True
        if self.url.startswith("https://") and Path(config.ca_file).is_file():
            verify = ssl.create_default_context(cafile=config.ca_file)
        self.client = httpx.AsyncClient(
            base_url=self.url, verify=verify, timeout=config.timeout_s, trust_env=False
        )

    def headers(self) -> dict[str, str]:
        token = read_text(Path(self.config.token_file))  # the kubelet rotates it in place
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def aclose(self) -> None:
        await self.client.aclose()


class Collection:
    """The objects of one collection (``path`` with query ``params``), kept current.

    ``on_change`` runs after every list and every applied watch event; ``on_list`` (if given)
    runs first, after lists only. ``known`` says what a failure keeps (default: the count of
    objects), for the warning."""

    def __init__(
        self,
        api: KubeApi,
        path: str,
        params: Mapping[str, str],
        on_change: Callable[[], Awaitable[None]],
        what: str,
        *,
        on_list: Callable[[], None] | None = None,
        known: Callable[[], str] | None = None,
    ) -> None:
        self.api, self.path, self.params = api, path, dict(params)
        self.on_change, self.what = on_change, what
        self.on_list, self.known = on_list, known
        self.objects: dict[str, Obj] = {}
        self.listed = asyncio.Event()
        self.errors = 0

    async def run(self) -> None:
        cfg = self.api.config
        delay = cfg.backoff_s
        while True:
            try:
                version = await self._list()
                delay = cfg.backoff_s
                if cfg.watch:
                    await self._watch(version)
                else:
                    await asyncio.sleep(cfg.interval_s)
                continue
            except Exception as exc:  # never let discovery take the gateway down
                reason = str(exc) or type(exc).__name__
            self.errors += 1
            log.warning(
                "discovery of %s failed: %s; keeping its %s; retry in %.1f s",
                *(self.what, reason, self._known(), delay),
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, cfg.backoff_max_s)

    def _known(self) -> str:
        return self.known() if self.known is not None else f"{len(self.objects)} objects"

    async def _list(self) -> str:
        api = self.api
        resp = await api.client.get(self.path, params=self.params, headers=api.headers())
        if resp.status_code != 200:
            raise ApiError(f"API server answered {resp.status_code}: {message(resp.text)}")
        body = resp.json()
        items = body.get("items") or []
        self.objects = {name(o, i): o for i, o in enumerate(items) if isinstance(o, dict)}
        self.listed.set()
        if self.on_list is not None:
            self.on_list()
        await self.on_change()
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, version: str) -> None:
        """Apply watch events until the watch ends (then the caller relists)."""
        cfg, api = self.api.config, self.api
        params = {
            **self.params,
            "watch": "1",
            "allowWatchBookmarks": "true",
            "resourceVersion": version,
            "timeoutSeconds": str(max(1, int(cfg.resync_s))),
        }
        timeout = httpx.Timeout(cfg.timeout_s, read=cfg.resync_s + cfg.timeout_s)
        stream = api.client.stream(
            "GET", self.path, params=params, headers=api.headers(), timeout=timeout
        )
        async with stream as resp:
            if resp.status_code == 410:  # resourceVersion too old
                return
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise ApiError(f"API server answered {resp.status_code}: {message(text)}")
            async for line in resp.aiter_lines():
                event = json.loads(line) if line.strip() else {}
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        log.info("discovery watch of %s expired (410 Gone); relisting", self.what)
                        return
                    raise ApiError(f"watch error {obj.get('code')}: {obj.get('message')}")
                if kind in ("ADDED", "MODIFIED"):
                    self.objects[name(obj, -1)] = obj
                elif kind == "DELETED":
                    self.objects.pop(name(obj, -1), None)
                else:  # BOOKMARK (a newer resourceVersion only) or a blank line
                    continue
                await self.on_change()


def in_cluster_api_server(env: Mapping[str, str]) -> str:
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ConfigError("discovery: set api_server (KUBERNETES_SERVICE_HOST is not set)")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def read_text(path: Path) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(encoding="utf-8").strip()
    return ""


def get(obj: object, key: str) -> Any:
    return obj.get(key) if isinstance(obj, Mapping) else None


def name(obj: object, fallback: int) -> str:
    value = get(get(obj, "metadata"), "name")
    return str(value) if value else f"#{fallback}"


def message(text: str) -> str:
    with contextlib.suppress(ValueError, AttributeError):
        text = str(json.loads(text).get("message") or text)
    return text[:300]
