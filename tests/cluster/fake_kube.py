"""A fake Kubernetes API server for discovery tests, on 127.0.0.1, with switches for
failures (statuses for the next requests, expired watches).

:class:`FakeApiServer` lists and watches collections of objects the way the real API server
does (selectors, ``resourceVersion`` replay, 410 Gone after compaction); :class:`FakeKubeApi`
serves EndpointSlices (discovery.k8s.io/v1, by the ``kubernetes.io/service-name`` label
selector) on it, and ``fake_kube_pool.FakePoolApi`` InferencePools and Pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

DATA = Path(__file__).parent / "data"
SELECTOR = "kubernetes.io/service-name="
SLICES = "endpointslices"


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / name).read_text(encoding="utf-8"))
    return data


def status(code: int, message: str) -> dict[str, Any]:
    reasons = {403: "Forbidden", 404: "NotFound", 410: "Expired", 500: "InternalError"}
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reasons.get(code, "Unknown"),
        "code": code,
    }


def endpoint(
    address: str, *, ready: bool | None = True, terminating: bool = False
) -> dict[str, Any]:
    conditions: dict[str, bool] = {
        "serving": bool(ready) or terminating,
        "terminating": terminating,
    }
    if ready is not None:
        conditions["ready"] = ready
    return {
        "addresses": [address],
        "conditions": conditions,
        "targetRef": {"kind": "Pod", "name": f"pod-{address}"},
    }


def endpoint_slice(
    name: str,
    service: str,
    endpoints: list[dict[str, Any]],
    *,
    port: int = 8000,
    port_name: str = "http",
    namespace: str = "inference",
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "generateName": f"{service}-",
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
    }


@dataclass
class Seen:
    """One request the fake answered."""

    resource: str
    namespace: str
    query: dict[str, str]
    authorization: str | None

    @property
    def watch(self) -> bool:
        return self.query.get("watch") in {"1", "true"}


@dataclass(frozen=True)
class Resource:
    """A collection the fake serves: its route (with ``{ns}``) and its list's kind."""

    path: str
    list_kind: str = "List"
    api_version: str = "v1"


Event = dict[str, Any]


@dataclass
class FakeApiServer:
    """Collections of objects by resource, listed and watched as the real API server does.

    Lists and watches select objects by namespace and by equality ``fieldSelector``
    (``metadata.name=...``) and ``labelSelector`` (``k=v,...``); a watch replays the events
    newer than its ``resourceVersion`` (an ERROR 410 below the last compaction), then
    streams. ``failures[resource]`` holds statuses for that resource's next requests.
    Subclasses name their resources in ``RESOURCES``."""

    RESOURCES: ClassVar[dict[str, Resource]] = {}

    namespace: str = "inference"
    store: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    version: int = 1000
    failures: dict[str, list[int]] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    history: list[tuple[int, str, Event]] = field(default_factory=list)
    compacted: int = 0  # watches from a resourceVersion below this get 410
    _watchers: list[tuple[str, asyncio.Queue[Event | None]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for resource in self.RESOURCES:
            self.store.setdefault(resource, {})
            self.failures.setdefault(resource, [])

    def app(self) -> Starlette:
        routes = [Route(r.path, self._handler(name)) for name, r in self.RESOURCES.items()]
        return Starlette(routes=routes)

    # -- changes ----------------------------------------------------------------------
    def put_object(self, resource: str, obj: dict[str, Any]) -> None:
        obj = copy.deepcopy(obj)
        name = obj["metadata"]["name"]
        kind = "MODIFIED" if name in self.store[resource] else "ADDED"
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.store[resource][name] = obj
        self._emit(resource, {"type": kind, "object": obj})

    def delete_object(self, resource: str, name: str) -> None:
        obj = self.store[resource].pop(name)
        self.version += 1
        self._emit(resource, {"type": "DELETED", "object": obj})

    def expire_watches(self) -> None:
        """Compact history: open watches get an ERROR 410 event, as after etcd compaction."""
        self.compacted = self.version
        self.history.clear()
        for _, q in self._watchers:
            q.put_nowait({"type": "ERROR", "object": status(410, "too old resource version")})

    def close_watches(self) -> None:
        for _, q in self._watchers:
            q.put_nowait(None)

    def requests(self, resource: str, *, watch: bool) -> list[Seen]:
        return [s for s in self.seen if s.resource == resource and s.watch == watch]

    @property
    def lists(self) -> int:
        return sum(1 for s in self.seen if not s.watch)

    @property
    def watches(self) -> int:
        return sum(1 for s in self.seen if s.watch)

    @property
    def open_watches(self) -> int:
        return len(self._watchers)

    def _emit(self, resource: str, event: Event) -> None:
        self.history.append((self.version, resource, event))
        for res, q in self._watchers:
            if res == resource:
                q.put_nowait(event)

    # -- the API ------------------------------------------------------------------------
    def _matches(self, obj: dict[str, Any], namespace: str, query: dict[str, str]) -> bool:
        meta = obj.get("metadata", {})
        if meta.get("namespace", self.namespace) != namespace:
            return False
        fields = query.get("fieldSelector", "")
        if fields and fields != f"metadata.name={meta.get('name')}":
            return False
        labels = meta.get("labels") or {}
        pairs = [p.split("=", 1) for p in query.get("labelSelector", "").split(",") if p]
        return all(labels.get(k) == v for k, v in pairs)

    def _reject(self, seen: Seen) -> Response | None:
        """An error answer for this request (an injected failure), or None to serve it."""
        if self.failures[seen.resource]:
            code = self.failures[seen.resource].pop(0)
            return JSONResponse(status(code, "injected"), status_code=code)
        return None

    def _handler(self, resource: str) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            return self._serve(resource, request)

        return handle

    def _serve(self, resource: str, request: Request) -> Response:
        namespace = request.path_params["ns"]
        query = dict(request.query_params)
        seen = Seen(resource, namespace, query, request.headers.get("authorization"))
        self.seen.append(seen)
        rejected = self._reject(seen)
        if rejected is not None:
            return rejected
        if seen.watch:
            return self._watch(resource, namespace, query)
        objects = self.store[resource].values()
        kind = self.RESOURCES[resource]
        return JSONResponse(
            {
                "kind": kind.list_kind,
                "apiVersion": kind.api_version,
                "metadata": {"resourceVersion": str(self.version)},
                "items": [o for o in objects if self._matches(o, namespace, query)],
            }
        )

    def _watch(self, resource: str, namespace: str, query: dict[str, str]) -> Response:
        since = int(query.get("resourceVersion") or self.version)
        timeout = float(query.get("timeoutSeconds", "60"))
        queue: asyncio.Queue[Event | None] = asyncio.Queue()
        if since < self.compacted:
            queue.put_nowait({"type": "ERROR", "object": load("status_gone.json")})
        for version, res, event in self.history:
            if version > since and res == resource:
                queue.put_nowait(event)
        entry = (resource, queue)
        self._watchers.append(entry)

        async def events() -> AsyncIterator[bytes]:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            try:
                while True:
                    try:
                        event = await asyncio.wait_for(queue.get(), deadline - loop.time())
                    except TimeoutError:
                        return
                    if event is None:
                        return
                    obj = event["object"]
                    if event["type"] != "ERROR" and not self._matches(obj, namespace, query):
                        continue
                    yield (json.dumps(event) + "\n").encode()
                    if event["type"] == "ERROR":
                        return
            finally:
                self._watchers.remove(entry)

        return StreamingResponse(events(), media_type="application/json")


@dataclass
class FakeKubeApi(FakeApiServer):
    """EndpointSlices of any number of Services; change them with put/delete."""

    RESOURCES: ClassVar[dict[str, Resource]] = {
        SLICES: Resource(
            "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
            "EndpointSliceList",
            "discovery.k8s.io/v1",
        )
    }

    list_failures: list[int] = field(default_factory=list)  # statuses for the next lists
    watch_failures: list[int] = field(default_factory=list)  # ... and the next watches

    @property
    def slices(self) -> dict[str, dict[str, Any]]:
        return self.store[SLICES]

    def put(self, slice_: dict[str, Any]) -> None:
        self.put_object(SLICES, slice_)

    def delete(self, name: str) -> None:
        self.delete_object(SLICES, name)

    def _reject(self, seen: Seen) -> Response | None:
        selector = seen.query.get("labelSelector", "")
        if not selector.startswith(SELECTOR):
            return JSONResponse(status(400, f"unsupported selector {selector!r}"), 400)
        failures = self.watch_failures if seen.watch else self.list_failures
        if failures:
            code = failures.pop(0)
            body = load("status_forbidden.json") if code == 403 else status(code, "injected")
            return JSONResponse(body, status_code=code)
        return None


@contextlib.asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    """Run ``app`` with uvicorn on 127.0.0.1 in this event loop; yield its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2, access_log=False
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("server exited before it started")
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()


async def wait_until(predicate: Any, timeout: float = 10.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
