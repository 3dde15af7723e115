"""Engines discovered from Kubernetes EndpointSlices (``discovery.kind: kubernetes``).

Per Service, the EndpointSlices labelled ``kubernetes.io/service-name=<name>`` are listed,
then watched (or polled); each ready, non-terminating endpoint is an engine. They are
reconciled with the registry as the admin routes change it; engines discovery did not add
are never touched. API errors keep the last known set and retry with backoff; an expired
(410 Gone) or ended watch (every ``resync_s``) is followed by a relist. The pure parts:
:func:`slice_targets` (slices to engines) and :func:`plan` (the diff).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import ssl
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from gateway.cluster.kv_events import KVEventSubscriber
from gateway.cluster.monitor import EngineMonitor
from gateway.cluster.registry import EngineRegistry, EngineState
from gateway.config import DiscoveryConfig, KubeServiceConfig
from gateway.core.errors import ConfigError
from gateway.core.types import EngineRole
from gateway.policies.dispatcher import Dispatcher

log = logging.getLogger("kvgate.discovery")

Slice = Mapping[str, Any]
API_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"


@dataclass(frozen=True, slots=True)
class Target:
    url: str
    role: EngineRole = EngineRole.BOTH
    model: str | None = None
    api_key: str | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    add: tuple[Target, ...] = ()
    remove: tuple[str, ...] = ()


class ApiError(Exception):
    """The API server answered with an error status."""


def slice_port(slice_: Slice, source: KubeServiceConfig) -> int | None:
    """The engines' port in a slice: ``source.port``, the port named ``source.port_name``,
    or the slice's only port; None when there is no such single port."""
    if source.port is not None:
        return source.port
    named = [p for p in slice_.get("ports") or () if source.port_name in (None, _get(p, "name"))]
    ports = [n for n in (_get(p, "port") for p in named) if isinstance(n, int)]
    return ports[0] if len(ports) == 1 else None


def slice_targets(slices: Iterable[Slice], source: KubeServiceConfig) -> dict[str, Target]:
    """The engines of ``source``'s EndpointSlices by URL: its ready (a missing ``ready``
    means ready, as the API says), non-terminating endpoints at their first address."""
    api_key = source.api_key.get_secret_value() if source.api_key else None
    out: dict[str, Target] = {}
    for s in slices:
        port = slice_port(s, source) if isinstance(s, Mapping) else None
        if port is None:
            continue
        ipv6 = s.get("addressType") == "IPv6"
        for ep in s.get("endpoints") or ():
            cond, addresses = _get(ep, "conditions"), _get(ep, "addresses") or [None]
            if _get(cond, "ready") is False or _get(cond, "terminating") is True:
                continue
            if not isinstance(addresses[0], str) or not addresses[0]:
                continue
            host = f"[{addresses[0]}]" if ipv6 or ":" in addresses[0] else addresses[0]
            url = f"{source.scheme}://{host}:{port}"
            out.setdefault(url, Target(url, EngineRole(source.role), source.model, api_key))
    return out


def plan(
    desired: Mapping[str, Target], managed: Mapping[str, Target], registered: AbstractSet[str]
) -> Plan:
    """What to change so that the engines discovery registered (``managed``) become
    ``desired``. Engines registered by anyone else are never touched; a managed engine
    whose role, model or key changed is removed and added again."""
    remove = sorted(u for u, t in managed.items() if u in registered and desired.get(u) != t)
    keep = registered - set(remove)  # includes the engines discovery did not register
    add = [t for u, t in sorted(desired.items()) if u not in keep]
    return Plan(tuple(add), tuple(remove))


class Membership(Protocol):
    def registered(self) -> AbstractSet[str]: ...
    async def add(self, targets: Sequence[Target]) -> None: ...
    def remove(self, url: str) -> object: ...


@dataclass(slots=True)
class RegistryMembership:
    """Changes the registry exactly as ``POST`` and ``DELETE /admin/engines`` do."""

    registry: EngineRegistry
    monitor: EngineMonitor
    dispatcher: Dispatcher
    kv_events: KVEventSubscriber | None = None

    def registered(self) -> AbstractSet[str]:
        return {e.id for e in self.registry.all()}

    async def add(self, targets: Sequence[Target]) -> None:
        new = [t for t in targets if t.url not in self.registry]
        engines = [
            self.registry.add(t.url, role=t.role, model=t.model, api_key=t.api_key) for t in new
        ]
        await asyncio.gather(*(self.monitor.check(e) for e in engines))

    def remove(self, url: str) -> EngineState | None:
        """Retire ``url``: stop its KV events, make policies forget it; None if unknown."""
        engine = self.registry.remove(url)
        if engine is not None:
            engine.retired = True
            if self.kv_events is not None:
                self.kv_events.stop_engine(engine.id)
            self.dispatcher.engine_removed(engine.id)
        return engine


class KubeDiscovery:
    """Follows the configured Services' EndpointSlices and reconciles a :class:`Membership`."""

    def __init__(self, config: DiscoveryConfig, membership: Membership) -> None:
        self.config, self.membership = config, membership
        self.api_server = config.api_server or in_cluster_api_server(os.environ)
        # default: the pod's own namespace, from its service account
        account = Path(config.token_file).parent
        self.namespace = config.namespace or _read(account / "namespace") or "default"
        self.managed: dict[str, Target] = {}
        self.errors = 0
        self.synced = asyncio.Event()  # every Service listed once
        self._slices: list[dict[str, Slice]] = [{} for _ in config.services]
        self._listed: set[int] = set()
        self._warned: set[str] = set()
        self._lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        verify: ssl.SSLContext | bool = True
        if self.api_server.startswith("https://") and Path(config.ca_file).is_file():
            verify = ssl.create_default_context(cafile=config.ca_file)
        self._client = httpx.AsyncClient(
            base_url=self.api_server, verify=verify, timeout=config.timeout_s, trust_env=False
        )

    async def start(self, wait_s: float = 0.0) -> None:
        """Start following; wait up to ``wait_s`` for every Service's first list."""
        self._tasks = [asyncio.create_task(self._follow(i)) for i in range(len(self._slices))]
        if wait_s > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self.synced.wait()

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._client.aclose()

    def _headers(self) -> dict[str, str]:
        token = _read(Path(self.config.token_file))  # re-read: the kubelet rotates it in place
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def _follow(self, index: int) -> None:
        source = self.config.services[index]
        path = API_PATH.format(namespace=source.namespace or self.namespace)
        selector = {"labelSelector": f"kubernetes.io/service-name={source.name}"}
        delay = self.config.backoff_s
        while True:
            try:
                version = await self._list(index, path, selector)
                delay = self.config.backoff_s
                if self.config.watch:
                    await self._watch(index, path, selector, version)
                else:
                    await asyncio.sleep(self.config.interval_s)
                continue
            except Exception as exc:  # never let discovery take the gateway down
                reason = str(exc) or type(exc).__name__
            self.errors += 1
            known = len(slice_targets(self._slices[index].values(), source))
            log.warning(
                "discovery of Service %s failed: %s; keeping its %d engines; retry in %.1f s",
                *(source.name, reason, known, delay),
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.config.backoff_max_s)

    async def _list(self, index: int, path: str, selector: dict[str, str]) -> str:
        resp = await self._client.get(path, params=selector, headers=self._headers())
        if resp.status_code != 200:
            raise ApiError(f"API server answered {resp.status_code}: {_message(resp.text)}")
        body = resp.json()
        items = body.get("items") or []
        self._slices[index] = {_name(s, i): s for i, s in enumerate(items) if isinstance(s, dict)}
        self._listed.add(index)
        source = self.config.services[index]
        for name, s in self._slices[index].items():
            if s.get("endpoints") and name not in self._warned and slice_port(s, source) is None:
                self._warned.add(name)
                log.warning("EndpointSlice %s: no single port matches (set port_name)", name)
        await self._reconcile()
        if len(self._listed) == len(self._slices):
            self.synced.set()
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, index: int, path: str, selector: dict[str, str], version: str) -> None:
        """Apply watch events until the watch ends (then the caller relists)."""
        cfg = self.config
        params = {
            **selector,
            "watch": "1",
            "allowWatchBookmarks": "true",
            "resourceVersion": version,
        }
        params["timeoutSeconds"] = str(max(1, int(cfg.resync_s)))
        timeout = httpx.Timeout(cfg.timeout_s, read=cfg.resync_s + cfg.timeout_s)
        headers = self._headers()
        stream = self._client.stream("GET", path, params=params, headers=headers, timeout=timeout)
        async with stream as resp:
            if resp.status_code == 410:  # resourceVersion too old
                return
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise ApiError(f"API server answered {resp.status_code}: {_message(text)}")
            async for line in resp.aiter_lines():
                event = json.loads(line) if line.strip() else {}
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        log.info("discovery watch expired (410 Gone); relisting")
                        return
                    raise ApiError(f"watch error {obj.get('code')}: {obj.get('message')}")
                if kind in ("ADDED", "MODIFIED"):
                    self._slices[index][_name(obj, -1)] = obj
                elif kind == "DELETED":
                    self._slices[index].pop(_name(obj, -1), None)
                else:  # BOOKMARK (a newer resourceVersion only) or a blank line
                    continue
                await self._reconcile()

    async def _reconcile(self) -> None:
        async with self._lock:
            desired: dict[str, Target] = {}
            for source, slices in zip(self.config.services, self._slices, strict=True):
                for url, target in slice_targets(slices.values(), source).items():
                    desired.setdefault(url, target)
            registered = self.membership.registered()
            change = plan(desired, self.managed, registered)
            others = registered - self.managed.keys()
            self.managed = {u: t for u, t in desired.items() if u not in others}
            for url in change.remove:
                log.info("discovery: engine %s is gone; removing it", url)
                self.membership.remove(url)
            if change.add:
                log.info("discovery: adding engines %s", ", ".join(t.url for t in change.add))
                await self.membership.add(change.add)


def in_cluster_api_server(env: Mapping[str, str]) -> str:
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ConfigError("discovery: set api_server (KUBERNETES_SERVICE_HOST is not set)")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def _read(path: Path) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(encoding="utf-8").strip()
    return ""


def _get(obj: object, key: str) -> Any:
    return obj.get(key) if isinstance(obj, Mapping) else None


def _name(obj: object, fallback: int) -> str:
    name = _get(_get(obj, "metadata"), "name")
    return str(name) if name else f"#{fallback}"


def _message(text: str) -> str:
    with contextlib.suppress(ValueError, AttributeError):
        text = str(json.loads(text).get("message") or text)
    return text[:300]
