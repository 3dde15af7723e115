"""Fault injection for the emulated engine (``kvgate emulate --fault NAME[:ARG]``).

Installed only with ``--fault`` or ``--fault-admin``: without them the app has
no fault middleware and no ``/_faults`` routes (zero cost, and nobody can break
a demo engine over HTTP). With them, one fault at a time is active; it can be
changed at run time:

* ``POST /_faults {"fault": "http500", "times": 3}`` — set (``times``: only the
  next N matching requests; unset: until cleared); ``{"fault": null}`` clears.
* ``GET /_faults`` — the active fault and counters; ``GET /_faults/log`` — one
  entry per generation request (``X-Request-Id``, path, status, whether the
  answer was sent completely, the fault applied); ``DELETE /_faults/log``.

Generation requests are ``POST /v1/completions`` and ``/v1/chat/completions``.
See :data:`FAULTS` for the list.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.background import BackgroundTask
from starlette.types import Scope

from gateway.core.errors import ConfigError

log = logging.getLogger(__name__)

FAULTS: dict[str, tuple[str, float | None]] = {
    "refuse": ("close the listener and every open connection for ARG seconds", 5.0),
    "crash": ("the process exits (status 1) when a generation request arrives", None),
    "reset": ("abort the connection of each generation request before any byte", None),
    "midstream": ("streamed answers: abort the connection after ARG SSE events", 2.0),
    "hang": ("accept requests and never answer (every route but /_faults)", None),
    "http500": ("generation requests answer 500 InternalServerError", None),
    "http503": ("generation requests answer 503 ServiceUnavailableError", None),
    "queue_full": ("generation requests answer vLLM's 503 of a full waiting queue", None),
    "slow_kv": ("decode legs (do_remote_prefill) wait ARG more seconds for their KV", 5.0),
    "kv_fail": ("decode legs fail their KV pull: 500 before any byte", None),
    "slow_prefill": ("prefill legs (do_remote_decode) answer ARG seconds late", 5.0),
    "metrics500": ("GET /metrics answers 500", None),
    "metrics_garbage": ("GET /metrics answers text that is not Prometheus", None),
    "flap": ("healthy, then unhealthy (/health and generation 503), ARG seconds each", 2.0),
}
"""name → (what it does, default ARG or None when it takes none)."""


@dataclass(frozen=True, slots=True)
class Fault:
    name: str
    arg: float | None = None
    times: int | None = None

    def spec(self) -> str:
        return self.name if self.arg is None else f"{self.name}:{self.arg:g}"


def parse_fault(spec: str, times: int | None = None) -> Fault:
    """``NAME[:ARG]`` → :class:`Fault`; ConfigError naming the problem."""
    name, _, raw = spec.strip().partition(":")
    if name not in FAULTS:
        raise ConfigError(f"unknown fault {name!r} (known: {', '.join(FAULTS)})")
    default = FAULTS[name][1]
    if raw and default is None:
        raise ConfigError(f"fault {name} takes no argument, got {raw!r}")
    try:
        arg = float(raw) if raw else default
    except ValueError:
        raise ConfigError(f"fault {name}: {raw!r} is not a number") from None
    if arg is not None and not arg >= 0:
        raise ConfigError(f"fault {name}: the argument must be >= 0, got {raw}")
    if times is not None and times < 1:
        raise ConfigError(f"times must be >= 1, got {times}")
    return Fault(name, arg, times)


class Listener(Protocol):
    """What the server process offers the faults (see :mod:`gateway.emulator.listener`)."""

    async def refuse(self, seconds: float) -> None: ...
    def abort(self, scope: Scope) -> bool: ...


class FaultInjector:
    """The active fault, its counters and the request log."""

    def __init__(self, fault: Fault | None = None, *, log_size: int = 100_000) -> None:
        self.fault: Fault | None = None
        self.remaining: int | None = None
        self.applied = 0
        self.listener: Listener | None = None
        self.log: deque[dict[str, Any]] = deque(maxlen=log_size)
        self._since = time.monotonic()
        self._tasks: set[asyncio.Task[None]] = set()
        self.pending_refuse: float | None = None
        """``--fault refuse:S``: refuse for S seconds once the server listens."""
        if fault is not None and fault.name == "refuse":
            self.pending_refuse = fault.arg or 0.0
        else:
            self.set(fault)

    def attach(self, listener: Listener) -> None:
        """The server is listening: faults may now close its listener and connections."""
        self.listener = listener
        if self.pending_refuse is not None:
            self.start_refusing(self.pending_refuse)
            self.pending_refuse = None

    def set(self, fault: Fault | None) -> None:
        self.fault = fault
        self.remaining = fault.times if fault is not None else None
        self._since = time.monotonic()
        if fault is not None:
            log.warning("fault injection: %s", fault.spec())

    def take(self, name: str) -> bool:
        """Whether the active fault is ``name`` and applies now (spends one of ``times``)."""
        fault = self.fault
        if fault is None or fault.name != name:
            return False
        if self.remaining is not None:
            self.remaining -= 1
            if self.remaining <= 0:
                self.fault, self.remaining = None, None
        self.applied += 1
        return True

    def unhealthy_phase(self) -> bool:
        fault = self.fault
        if fault is None or fault.name != "flap" or not fault.arg:
            return False
        return int((time.monotonic() - self._since) / fault.arg) % 2 == 1

    def start_refusing(self, seconds: float) -> None:
        if self.listener is None:
            log.warning("fault refuse: no listener control (in-process app); ignored")
            return
        task = asyncio.ensure_future(self.listener.refuse(seconds))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def status(self) -> dict[str, Any]:
        fault = self.fault
        return {
            "fault": fault.spec() if fault is not None else None,
            "remaining": self.remaining,
            "applied": self.applied,
            "requests": len(self.log),
            "completed": sum(1 for e in self.log if e["done"]),
        }


router = APIRouter()


def _injector(request: Request) -> FaultInjector:
    faults: FaultInjector = request.app.state.faults
    return faults


@router.get("/_faults")
async def get_faults(request: Request) -> JSONResponse:
    return JSONResponse(_injector(request).status())


@router.post("/_faults")
async def set_fault(request: Request) -> JSONResponse:
    faults = _injector(request)
    try:
        body = json.loads(await request.body() or b"{}")
        spec, times = body.get("fault"), body.get("times")
        if spec is not None and not isinstance(spec, str):
            raise ConfigError("fault must be a string like 'http500' or 'midstream:3', or null")
        if times is not None and (isinstance(times, bool) or not isinstance(times, int)):
            raise ConfigError("times must be an integer")
        fault = parse_fault(spec, times) if spec else None
    except (ValueError, AttributeError, ConfigError) as exc:
        return JSONResponse({"error": str(exc)}, status_code=400)
    if fault is not None and fault.name == "refuse":  # after this answer has gone out
        faults.set(None)
        task = BackgroundTask(_refuse_later, faults, fault.arg or 0.0)
        return JSONResponse({**faults.status(), "fault": fault.spec()}, background=task)
    faults.set(fault)
    return JSONResponse(faults.status())


async def _refuse_later(faults: FaultInjector, seconds: float) -> None:
    faults.start_refusing(seconds)


@router.get("/_faults/log")
async def fault_log(request: Request) -> JSONResponse:
    return JSONResponse(list(_injector(request).log))


@router.delete("/_faults/log")
async def clear_log(request: Request) -> JSONResponse:
    faults = _injector(request)
    faults.log.clear()
    faults.applied = 0
    return JSONResponse(faults.status())
