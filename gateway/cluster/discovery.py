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
import logging
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.cluster.kube_api import Collection, KubeApi, get
from gateway.cluster.kv_events import KVEventSubscriber
from gateway.cluster.monitor import EngineMonitor
from gateway.cluster.registry import EngineRegistry, EngineState
from gateway.config import DiscoveryConfig, KubeServiceConfig
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


def slice_port(slice_: Slice, source: KubeServiceConfig) -> int | None:
    """The engines' port in a slice: ``source.port``, the port named ``source.port_name``,
    or the slice's only port; None when there is no such single port."""
    if source.port is not None:
        return source.port
    named = [p for p in slice_.get("ports") or () if source.port_name in (None, get(p, "name"))]
    ports = [n for n in (get(p, "port") for p in named) if isinstance(n, int)]
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
            cond, addresses = get(ep, "conditions"), get(ep, "addresses") or [None]
            if get(cond, "ready") is False or get(cond, "terminating") is True:
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


def managed_after(
    desired: Mapping[str, Target], managed: Mapping[str, Target], registered: AbstractSet[str]
) -> tuple[dict[str, Target], Plan]:
    """The engines discovery manages once ``desired`` is applied (less those someone else
    registered), and the :func:`plan` that applies it."""
    others = registered - managed.keys()
    return {u: t for u, t in desired.items() if u not in others}, plan(desired, managed, registered)


async def apply_plan(membership: Membership, change: Plan, gone: str) -> None:
    """Remove then add what ``change`` says, logging each removal as ``gone``."""
    for url in change.remove:
        log.info("discovery: engine %s %s; removing it", url, gone)
        membership.remove(url)
    if change.add:
        log.info("discovery: adding engines %s", ", ".join(t.url for t in change.add))
        await membership.add(change.add)


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
        self.api = KubeApi(config)  # the namespace defaults to the pod's own
        self.managed: dict[str, Target] = {}
        self.synced = asyncio.Event()  # every Service listed once
        self._warned: set[str] = set()
        self._lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._slices = [self._follow(source) for source in config.services]

    @property
    def errors(self) -> int:
        return sum(slices.errors for slices in self._slices)

    async def start(self, wait_s: float = 0.0) -> None:
        """Start following; wait up to ``wait_s`` for every Service's first list."""
        self._tasks = [asyncio.create_task(slices.run()) for slices in self._slices]
        if wait_s > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self.synced.wait()

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.api.aclose()

    def _follow(self, source: KubeServiceConfig) -> Collection:
        """The EndpointSlices of Service ``source``, as a collection to follow."""
        slices = Collection(
            self.api,
            API_PATH.format(namespace=source.namespace or self.api.namespace),
            {"labelSelector": f"kubernetes.io/service-name={source.name}"},
            self._changed,
            f"Service {source.name}",
            on_list=lambda: self._warn_ambiguous_ports(slices, source),
            known=lambda: f"{len(slice_targets(slices.objects.values(), source))} engines",
        )
        return slices

    def _warn_ambiguous_ports(self, slices: Collection, source: KubeServiceConfig) -> None:
        for name, s in slices.objects.items():
            if s.get("endpoints") and name not in self._warned and slice_port(s, source) is None:
                self._warned.add(name)
                log.warning("EndpointSlice %s: no single port matches (set port_name)", name)

    async def _changed(self) -> None:
        await self._reconcile()
        if all(slices.listed.is_set() for slices in self._slices):
            self.synced.set()

    async def _reconcile(self) -> None:
        async with self._lock:
            desired: dict[str, Target] = {}
            for source, slices in zip(self.config.services, self._slices, strict=True):
                for url, target in slice_targets(slices.objects.values(), source).items():
                    desired.setdefault(url, target)
            registered = self.membership.registered()
            self.managed, change = managed_after(desired, self.managed, registered)
            await apply_plan(self.membership, change, "is gone")


class Discovery(Protocol):
    async def start(self, wait_s: float = 0.0) -> None: ...
    async def stop(self) -> None: ...


def create_discovery(config: DiscoveryConfig, membership: Membership) -> Discovery | None:
    """The follower ``config.kind`` names (None for static engines only)."""
    if config.kind == "kubernetes":
        return KubeDiscovery(config, membership)
    if config.kind == "inferencepool":
        from gateway.cluster.inference_pool import InferencePoolDiscovery

        return InferencePoolDiscovery(config, membership)
    return None
