"""Engines discovered from an ``InferencePool`` (``discovery.kind: inferencepool``).

As the Gateway API Inference Extension's reference endpoint picker does: the pool object
(``inference.networking.k8s.io/v1``) is listed and watched; its ``spec.selector.matchLabels``
select Pods in the pool's namespace, which are listed and watched in turn (the Pod watch is
restarted whenever the selector changes); every Ready Pod (condition ``Ready`` true, an IP, not
being deleted) is one engine per entry of ``spec.targetPorts``, at ``podIP:number``. A Pod
label (``role_label``, default ``llm-d.ai/role``: ``prefill`` / ``decode``) gives a P/D role.
A deleted pool, or one whose selector is empty, has no engines. API errors keep the last known
set; engines discovery did not add are never touched (:func:`gateway.cluster.discovery.plan`).
The pure part: :func:`pool_selector`, :func:`pool_ports` and :func:`pod_targets`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping, Sequence

from gateway.cluster.discovery import Membership, Target, apply_plan, managed_after
from gateway.cluster.kube_api import Collection, KubeApi, Obj, get
from gateway.config import DiscoveryConfig, InferencePoolConfig
from gateway.core.types import EngineRole

log = logging.getLogger("kvgate.discovery")

POOL_PATH = "/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools"
POD_PATH = "/api/v1/namespaces/{namespace}/pods"
ROLES = {"prefill": EngineRole.PREFILL, "decode": EngineRole.DECODE, "both": EngineRole.BOTH}


def pool_selector(pool: Obj | None) -> str | None:
    """The pool's ``matchLabels`` as a label selector (``k=v,...``, sorted); None when there
    is no pool or it selects nothing."""
    labels = get(get(get(pool, "spec"), "selector"), "matchLabels")
    if not isinstance(labels, Mapping) or not labels:
        return None
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def pool_ports(pool: Obj | None) -> tuple[int, ...]:
    """The pool's target port numbers, in order, duplicates dropped."""
    ports: list[int] = []
    for port in get(get(pool, "spec"), "targetPorts") or ():
        number = get(port, "number")
        if isinstance(number, int) and 1 <= number <= 65535 and number not in ports:
            ports.append(number)
    return tuple(ports)


def pod_ready(pod: Obj) -> bool:
    if get(get(pod, "metadata"), "deletionTimestamp"):
        return False
    conditions = get(get(pod, "status"), "conditions") or ()
    return any(get(c, "type") == "Ready" and get(c, "status") == "True" for c in conditions)


def pod_targets(
    pods: Iterable[Obj], selector: str | None, ports: Sequence[int], source: InferencePoolConfig
) -> dict[str, Target]:
    """The engines of the pool's Pods by URL: each Ready Pod matching ``selector`` at each
    port."""
    if selector is None or not ports:
        return {}
    want = dict(pair.split("=", 1) for pair in selector.split(","))
    api_key = source.api_key.get_secret_value() if source.api_key else None
    out: dict[str, Target] = {}
    for pod in pods:
        labels = get(get(pod, "metadata"), "labels")
        if not isinstance(labels, Mapping) or any(labels.get(k) != v for k, v in want.items()):
            continue
        ip = get(get(pod, "status"), "podIP")
        if not isinstance(ip, str) or not ip or not pod_ready(pod):
            continue
        role = ROLES.get(str(labels.get(source.role_label, ""))) if source.role_label else None
        host = f"[{ip}]" if ":" in ip else ip
        for port in ports:
            url = f"{source.scheme}://{host}:{port}"
            target = Target(url, role or EngineRole.BOTH, source.model, api_key)
            out.setdefault(url, target)
    return out


class InferencePoolDiscovery:
    """Follows one InferencePool and its Pods; reconciles a :class:`Membership`."""

    def __init__(self, config: DiscoveryConfig, membership: Membership) -> None:
        assert config.pool is not None, "discovery.kind inferencepool needs discovery.pool"
        self.config, self.source, self.membership = config, config.pool, membership
        self.api = KubeApi(config)
        self.namespace = self.source.namespace or self.api.namespace
        self.managed: dict[str, Target] = {}
        self.synced = asyncio.Event()  # the pool and (when it selects any) its Pods listed
        self.selector: str | None = None
        self.ports: tuple[int, ...] = ()
        self.pool = Collection(
            self.api,
            POOL_PATH.format(namespace=self.namespace),
            {"fieldSelector": f"metadata.name={self.source.name}"},
            self._pool_changed,
            f"InferencePool {self.namespace}/{self.source.name}",
        )
        self.pods: Collection | None = None
        self._pods_task: asyncio.Task[None] | None = None
        self._pool_task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    @property
    def errors(self) -> int:
        return self.pool.errors + (self.pods.errors if self.pods else 0)

    async def start(self, wait_s: float = 0.0) -> None:
        """Start following; wait up to ``wait_s`` for the pool's and its Pods' first lists."""
        self._pool_task = asyncio.create_task(self.pool.run(), name="kvgate-inferencepool")
        if wait_s > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self.synced.wait()

    async def stop(self) -> None:
        tasks = [t for t in (self._pool_task, self._pods_task) if t is not None]
        self._pool_task = self._pods_task = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.api.aclose()

    async def _pool_changed(self) -> None:
        pool = self.pool.objects.get(self.source.name)
        selector, self.ports = pool_selector(pool), pool_ports(pool)
        if pool is not None and selector is None:
            log.warning("InferencePool %s selects no Pods (empty matchLabels)", self.source.name)
        if selector != self.selector:
            self.selector = selector
            await self._follow_pods(selector)
        await self._reconcile()
        if selector is None:
            self.synced.set()

    async def _follow_pods(self, selector: str | None) -> None:
        task, self._pods_task, self.pods = self._pods_task, None, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if selector is None:
            return
        log.info("discovery: InferencePool %s selects Pods %s", self.source.name, selector)
        self.pods = Collection(
            self.api,
            POD_PATH.format(namespace=self.namespace),
            {"labelSelector": selector},
            self._pods_changed,
            f"Pods of InferencePool {self.source.name}",
        )
        self._pods_task = asyncio.create_task(self.pods.run(), name="kvgate-pool-pods")

    async def _pods_changed(self) -> None:
        await self._reconcile()
        self.synced.set()

    async def _reconcile(self) -> None:
        if self.pods is not None and not self.pods.listed.is_set():
            return  # a new selector: keep the engines until its Pods are listed
        async with self._lock:
            pods = self.pods.objects.values() if self.pods is not None else ()
            desired = pod_targets(pods, self.selector, self.ports, self.source)
            registered = self.membership.registered()
            self.managed, change = managed_after(desired, self.managed, registered)
            await apply_plan(self.membership, change, "left the pool")
