"""The fault middleware of the emulated engine: applies the active fault of a
:class:`~gateway.emulator.faults.FaultInjector` and logs every generation request
(installed only with ``--fault`` / ``--fault-admin``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.emulator.faults import FaultInjector

log = logging.getLogger("gateway.emulator.faults")

GENERATION = frozenset({"/v1/completions", "/v1/chat/completions"})
_LEG_FAULTS = frozenset({"slow_kv", "kv_fail", "slow_prefill"})
_GARBAGE = b"<html>this is not a metrics page</html>\nvllm:num_requests_running{ 12 nope\n"


class FaultMiddleware:
    """Applies the injector's fault; logs every generation request."""

    def __init__(self, app: ASGIApp, *, injector: FaultInjector) -> None:
        self.app = app
        self.faults = injector

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path.startswith("/_faults"):
            await self.app(scope, receive, send)
            return
        faults = self.faults
        if faults.take("hang"):
            await _hang(receive)
            return
        if path == "/health" and faults.unhealthy_phase():
            await _status(send, 503, None)
            return
        if path == "/metrics" and faults.fault is not None:
            if faults.take("metrics500"):
                await _status(send, 500, _error(500, "metrics exporter failed"))
                return
            if faults.take("metrics_garbage"):
                await _status(send, 200, _GARBAGE, content_type=b"text/plain")
                return
        if scope["method"] != "POST" or path not in GENERATION:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        entry: dict[str, Any] = {
            "id": headers.get(b"x-request-id", b"").decode("latin-1") or None,
            "path": path,
            "status": None,
            "done": False,
            "fault": None,
            "t": round(time.time(), 3),
        }
        faults.log.append(entry)
        if faults.fault is not None:
            receive = await self._apply(scope, receive, send, entry)
            if entry["fault"] is not None and entry["status"] is not None:
                return  # answered (or aborted) by the fault
        cut = self._midstream(entry)
        abort = (lambda: _abort_now(self.faults, scope)) if cut is not None else None
        await self.app(scope, receive, _observed(send, entry, cut, abort))

    async def _apply(
        self, scope: Scope, receive: Receive, send: Send, entry: dict[str, Any]
    ) -> Receive:
        """Apply a fault that acts before the engine sees the request; the receive to use."""
        faults = self.faults
        name = faults.fault.name if faults.fault is not None else ""
        if name in _LEG_FAULTS:
            body = await _read(receive)
            receive = _replay(body, receive)
            leg = _leg(body)
            if (leg == "decode" and name in ("slow_kv", "kv_fail")) or (
                leg == "prefill" and name == "slow_prefill"
            ):
                fault = faults.fault
                if not faults.take(name) or fault is None:
                    return receive
                entry["fault"] = name
                if name == "kv_fail":
                    entry["status"] = 500
                    message = "KV transfer from the prefill engine failed"
                    await _status(send, 500, _error(500, message))
                else:
                    await asyncio.sleep(fault.arg or 0.0)
            return receive
        if name == "flap" and faults.unhealthy_phase():
            entry["fault"], entry["status"] = "flap", 503
            await _status(send, 503, _error(503, "the engine is unhealthy (flapping)"))
            return receive
        for fault_name, status, message in _STATUS_FAULTS:
            if faults.take(fault_name):
                entry["fault"], entry["status"] = fault_name, status
                await _status(send, status, _error(status, message))
                return receive
        if faults.take("crash"):
            log.error("fault crash: exiting")
            os._exit(1)
        if faults.take("reset"):
            entry["fault"], entry["status"] = "reset", 0
            await _abort(faults, scope, receive, send)
        return receive

    def _midstream(self, entry: dict[str, Any]) -> int | None:
        fault = self.faults.fault
        if fault is None or fault.name != "midstream" or not self.faults.take("midstream"):
            return None
        entry["fault"] = "midstream"
        return int(fault.arg or 0)


_STATUS_FAULTS = (
    ("http500", 500, "EngineCore encountered an issue (injected fault)"),
    ("http503", 503, "The engine is not available (injected fault)"),
    (
        "queue_full",
        503,
        "The engine's waiting queue is full (max_num_queued_requests reached); "
        "retry the request, possibly on another instance",
    ),
)
_TYPES = {500: "InternalServerError", 503: "ServiceUnavailableError"}


def _error(status: int, message: str) -> bytes:
    body = {"error": {"message": message, "type": _TYPES[status], "param": None, "code": status}}
    return json.dumps(body).encode()


async def _status(
    send: Send, status: int, body: bytes | None, *, content_type: bytes = b"application/json"
) -> None:
    content = body or b""
    headers = [(b"content-type", content_type), (b"content-length", str(len(content)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": content})


async def _hang(receive: Receive, limit: float = 600.0) -> None:
    """Never answer: wait until the client goes away (or ``limit`` seconds)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(limit):
            while (await receive())["type"] != "http.disconnect":
                pass


async def _abort(faults: FaultInjector, scope: Scope, receive: Receive, send: Send) -> None:
    """Abort the connection (RST); without listener control, send a head and break off."""
    if faults.listener is not None and faults.listener.abort(scope):
        await _hang(receive, limit=1.0)  # returns once the server saw the connection go
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    raise ConnectionAbortedError("injected fault: connection aborted")


async def _read(receive: Receive) -> bytes:
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body read already, then the client's own messages (its disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _leg(body: bytes) -> str | None:
    try:
        params = json.loads(body).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    if not isinstance(params, dict):
        return None
    if params.get("do_remote_prefill"):
        return "decode"
    return "prefill" if params.get("do_remote_decode") else None


def _abort_now(faults: FaultInjector, scope: Scope) -> bool:
    return faults.listener is not None and faults.listener.abort(scope)


def _observed(
    send: Send,
    entry: dict[str, Any],
    cut_after: int | None = None,
    abort: Callable[[], bool] | None = None,
) -> Send:
    """``send`` recording status and completion; after ``cut_after`` SSE events the
    connection is aborted (``abort``; else the app gets an error) and nothing more is sent."""
    events = 0
    cut = False

    async def wrapped(message: Message) -> None:
        nonlocal events, cut
        if cut:
            return
        kind = message["type"]
        if kind == "http.response.start":
            entry["status"] = message["status"]
        elif kind == "http.response.body":
            if cut_after is not None:
                events += message.get("body", b"").count(b"data: ")
                if events > cut_after:
                    cut = True
                    if abort is not None and abort():
                        return
                    raise ConnectionAbortedError("injected fault: died mid-stream")
            if not message.get("more_body", False):
                entry["done"] = True
        await send(message)

    return wrapped
