"""LoRA adapters and cache salts of the emulator, as vLLM 0.32 serves them.

Flags (vLLM's): ``--enable-lora --max-loras N --max-lora-rank R --lora-modules
name=path ...``. ``POST /v1/load_lora_adapter {lora_name, lora_path[, load_inplace]}``
and ``POST /v1/unload_lora_adapter {lora_name}`` exist only with runtime updating
allowed: vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` env var (``1``/``true``), or the
emulator's ``--allow-runtime-lora`` flag (without either the routes answer 404, as on
vLLM). Success is 200 with vLLM's plain-text line. ``/v1/models`` lists each adapter
after the base model (``id`` the adapter name, ``root`` its path, ``parent`` the base
model). A request whose ``model`` names an adapter runs with it; the adapter's blocks
live in their own prefix-cache partition (:func:`gateway.core.blocks.partition_seed`)
and KV events key them by ``("lora", name, path)`` as vLLM does. The table holds at
most :data:`MAX_ADAPTERS` adapters (a load past it answers 400).

``cache_salt`` (completions, chat, responses, messages, pooling bodies) is checked as
vLLM 0.32 checks it: a non-empty string of at most 128 characters without ``@``, ``/``,
``\\`` or NUL (Anthropic's model additionally caps it at 1024, which the 128 implies).

``vllm:lora_requests_info`` (only with ``--enable-lora``, as vLLM): one gauge series
labelled ``max_lora``, ``waiting_lora_adapters``, ``running_lora_adapters``
(comma-joined adapter names), value the scrape's wall time (vLLM sets it to the time
of its last stats update). vLLM keeps every label set it ever set; the emulator
exports only the current one (bounded).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import PlainTextResponse
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.core.errors import ConfigError
from gateway.core.vllm_hash import LoraKey
from gateway.emulator.protocol import ApiError
from gateway.perfmodel.engine import EngineCore

MAX_ADAPTERS = 1024
"""Adapters one emulated engine knows at most (static plus loaded at run time)."""
MAX_SALT_CHARS = 128
_SALT_FORBIDDEN = frozenset("@/\\\x00")
RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
_INVALID = "InvalidUserInput"
"""vLLM's error type for a bad load/unload request."""


def check_cache_salt(value: Any) -> str | None:
    """``cache_salt`` as vLLM validates it; a 400 :class:`ApiError` when bad."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ApiError(
            "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)",
            param="cache_salt",
        )
    if len(value) > MAX_SALT_CHARS or any(c in _SALT_FORBIDDEN for c in value):
        raise ApiError(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL. (parameter=cache_salt)",
            param="cache_salt",
        )
    return value


def runtime_updates_allowed(flag: bool) -> bool:
    """``--allow-runtime-lora`` or vLLM's env var set to a true value."""
    return flag or os.environ.get(RUNTIME_ENV, "").strip().lower() in {"1", "true"}


def parse_lora_modules(specs: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``name=path`` items (or vLLM's JSON ``{"name":..,"path":..}``); ConfigError when bad."""
    out: dict[str, str] = {}
    for raw in specs:
        spec = raw.strip()
        if spec.startswith("{"):
            try:
                data = json.loads(spec)
                name, path = str(data["name"]), str(data["path"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"--lora-modules: bad JSON item {spec!r}: {exc}") from None
        else:
            name, sep, path = spec.partition("=")
            if not sep:
                raise ConfigError(f"--lora-modules: expected name=path, got {spec!r}")
        if not name or not path:
            raise ConfigError(f"--lora-modules: empty name or path in {spec!r}")
        out[name] = path
    if len(out) > MAX_ADAPTERS:
        raise ConfigError(f"--lora-modules: at most {MAX_ADAPTERS} adapters")
    return tuple(out.items())


@dataclass(slots=True)
class LoraTable:
    """The adapters an engine serves: name -> path, in load order."""

    base_model: str
    enabled: bool = False
    adapters: dict[str, str] = field(default_factory=dict)
    ids: dict[str, int] = field(default_factory=dict)
    """Adapter name -> vLLM's ``lora_int_id`` (1, 2, ... in load order; kept on an
    in-place reload), published as ``lora_id`` in KV events."""
    _last_id: int = 0

    def __post_init__(self) -> None:
        for name in self.adapters:
            self._last_id += 1
            self.ids[name] = self._last_id

    def resolve(self, model: str | None) -> str:
        """The adapter ``model`` names ("" for the base model); 404 when unknown."""
        if model is None or model in ("", self.base_model):
            return ""
        if model in self.adapters:
            return model
        raise ApiError(
            f"The model `{model}` does not exist. Valid aliases: {self.base_model}.",
            status=404,
            param="model",
        )

    def key(self, name: str) -> LoraKey | None:
        """What vLLM hashes of adapter ``name`` (None for the base model)."""
        if not name:
            return None
        path = self.adapters.get(name)
        if path is None:  # unloaded since the request was checked
            self.resolve(name)
        return LoraKey(name, path or "")

    def load(self, name: Any, path: Any, *, inplace: bool = False) -> str:
        if not name or not path or not isinstance(name, str) or not isinstance(path, str):
            raise ApiError(
                "Both 'lora_name' and 'lora_path' must be provided.", error_type=_INVALID
            )
        if name == self.base_model:
            raise ApiError(
                f"The lora adapter '{name}' conflicts with a served base model.",
                error_type=_INVALID,
            )
        if name in self.adapters and not inplace:
            raise ApiError(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                error_type=_INVALID,
            )
        if name not in self.adapters and len(self.adapters) >= MAX_ADAPTERS:
            raise ApiError(
                f"The emulator holds at most {MAX_ADAPTERS} LoRA adapters.", error_type=_INVALID
            )
        if name not in self.ids:
            self._last_id += 1
            self.ids[name] = self._last_id
        self.adapters[name] = path
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: Any) -> str:
        if not name or not isinstance(name, str):
            raise ApiError(
                "'lora_name' needs to be provided to unload a LoRA adapter.", error_type=_INVALID
            )
        if name not in self.adapters:
            raise ApiError(f"The lora adapter '{name}' cannot be found.", status=404)
        del self.adapters[name]
        del self.ids[name]
        return f"Success: LoRA adapter '{name}' removed successfully."


class LoraInfoCollector(Collector):
    """``vllm:lora_requests_info`` from the engine's running and waiting requests."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def collect(self) -> Iterable[Metric]:
        info = self.core.lora_info
        running, waiting = sorted(info.running), sorted(info.waiting)
        g = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        g.add_metric([str(info.max_loras), ",".join(waiting), ",".join(running)], time.time())
        yield g


router = APIRouter()


async def _json(request: Request) -> dict[str, Any]:
    try:
        data = json.loads(await request.body())
    except ValueError as exc:
        raise ApiError(f"Invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError("The request body must be a JSON object.")
    return data


@router.post("/v1/load_lora_adapter")
async def load_adapter(request: Request) -> PlainTextResponse:
    table: LoraTable = request.app.state.emulator.lora
    data = await _json(request)
    text = table.load(
        data.get("lora_name"), data.get("lora_path"), inplace=bool(data.get("load_inplace"))
    )
    return PlainTextResponse(text)


@router.post("/v1/unload_lora_adapter")
async def unload_adapter(request: Request) -> PlainTextResponse:
    table: LoraTable = request.app.state.emulator.lora
    return PlainTextResponse(table.unload((await _json(request)).get("lora_name")))


def attach(app: FastAPI, *, allow_runtime: bool) -> None:
    """Serve the load/unload routes when runtime updating is allowed (vLLM's rule)."""
    if runtime_updates_allowed(allow_runtime):
        app.include_router(router)
