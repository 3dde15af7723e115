"""A fake Kubernetes API server for discovery tests: EndpointSlices list and watch on
127.0.0.1, with switches for failures (statuses for the next requests, expired watches).

It serves the discovery.k8s.io/v1 list shape, filters by the
``kubernetes.io/service-name`` label selector, and replays watch events newer than the
requested ``resourceVersion`` the way the real API server does.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

DATA = Path(__file__).parent / "data"
SELECTOR = "kubernetes.io/service-name="


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
    namespace: str
    query: dict[str, str]
    authorization: str | None

    @property
    def watch(self) -> bool:
        return self.query.get("watch") in {"1", "true"}


@dataclass
class FakeKubeApi:
    """EndpointSlices of any number of Services; change them with put/delete."""

    namespace: str = "inference"
    slices: dict[str, dict[str, Any]] = field(default_factory=dict)
    version: int = 1000
    list_failures: list[int] = field(default_factory=list)  # statuses for the next lists
    watch_failures: list[int] = field(default_factory=list)  # ... and the next watches
    seen: list[Seen] = field(default_factory=list)
    history: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    compacted: int = 0  # watches from a resourceVersion below this get 410
    _watchers: list[asyncio.Queue[dict[str, Any] | None]] = field(default_factory=list)

    def app(self) -> Starlette:
        path = "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
        return Starlette(routes=[Route(path, self._endpointslices)])

    # -- changes ----------------------------------------------------------------------
    def put(self, slice_: dict[str, Any]) -> None:
        slice_ = copy.deepcopy(slice_)
        name = slice_["metadata"]["name"]
        kind = "MODIFIED" if name in self.slices else "ADDED"
        self.version += 1
        slice_["metadata"]["resourceVersion"] = str(self.version)
        self.slices[name] = slice_
        self._emit({"type": kind, "object": slice_})

    def delete(self, name: str) -> None:
        slice_ = self.slices.pop(name)
        self.version += 1
        self._emit({"type": "DELETED", "object": slice_})

    def expire_watches(self) -> None:
        """Compact history: open watches get an ERROR 410 event, as after etcd compaction."""
        self.compacted = self.version
        self.history.clear()
        for q in self._watchers:
            q.put_nowait({"type": "ERROR", "object": status(410, "too old resource version")})

    def close_watches(self) -> None:
        for q in self._watchers:
            q.put_nowait(None)

    @property
    def lists(self) -> int:
        return sum(1 for s in self.seen if not s.watch)

    @property
    def open_watches(self) -> int:
        return len(self._watchers)

    @property
    def watches(self) -> int:
        return sum(1 for s in self.seen if s.watch)

    def _emit(self, event: dict[str, Any]) -> None:
        self.history.append((self.version, event))
        for q in self._watchers:
            q.put_nowait(event)

    # -- the API ------------------------------------------------------------------------
    def _matches(self, obj: dict[str, Any], namespace: str, service: str) -> bool:
        meta = obj.get("metadata", {})
        labels = meta.get("labels", {})
        return (
            meta.get("namespace", self.namespace) == namespace
            and labels.get("kubernetes.io/service-name") == service
        )

    async def _endpointslices(self, request: Request) -> Response:
        namespace = request.path_params["ns"]
        query = dict(request.query_params)
        seen = Seen(namespace, query, request.headers.get("authorization"))
        self.seen.append(seen)
        selector = query.get("labelSelector", "")
        if not selector.startswith(SELECTOR):
            return JSONResponse(status(400, f"unsupported selector {selector!r}"), 400)
        service = selector[len(SELECTOR) :]
        failures = self.watch_failures if seen.watch else self.list_failures
        if failures:
            code = failures.pop(0)
            body = load("status_forbidden.json") if code == 403 else status(code, "injected")
            return JSONResponse(body, status_code=code)
        if seen.watch:
            return self._watch(namespace, service, query)
        items = [s for s in self.slices.values() if self._matches(s, namespace, service)]
        return JSONResponse(
            {
                "kind": "EndpointSliceList",
                "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": str(self.version)},
                "items": items,
            }
        )

    def _watch(self, namespace: str, service: str, query: dict[str, str]) -> Response:
        since = int(query.get("resourceVersion") or self.version)
        timeout = float(query.get("timeoutSeconds", "60"))
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        if since < self.compacted:
            queue.put_nowait({"type": "ERROR", "object": load("status_gone.json")})
        for version, event in self.history:
            if version > since:
                queue.put_nowait(event)
        self._watchers.append(queue)

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
                    if event["type"] != "ERROR" and not self._matches(obj, namespace, service):
                        continue
                    yield (json.dumps(event) + "\n").encode()
                    if event["type"] == "ERROR":
                        return
            finally:
                self._watchers.remove(queue)

        return StreamingResponse(events(), media_type="application/json")


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
