"""Settings and per-app state of the emulator (built by the app's lifespan)."""

from __future__ import annotations

import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Literal

from fastapi import Depends, Request
from prometheus_client import CollectorRegistry

from gateway.core.errors import ConfigError
from gateway.emulator.driver import EngineDriver, GenerationHandle
from gateway.emulator.kv_publisher import KVEventPublisher, KVEventsConfig
from gateway.emulator.kvpins import DEFAULT_LEASE
from gateway.emulator.kvtransfer import KvTransfer, TransferMetrics
from gateway.emulator.lora import LoraInfoCollector, LoraTable
from gateway.emulator.metrics import EmulatorMetrics
from gateway.emulator.pd import ROLES, Role
from gateway.emulator.response_store import DEFAULT_CAPACITY, ResponseStore
from gateway.emulator.tokenizer import FakeTokenizer, output_tokens
from gateway.perfmodel.model import PerfModel
from gateway.perfmodel.presets import load_preset


@dataclass(frozen=True, slots=True)
class EmulatorSettings:
    """What one emulated engine serves and how fast it runs.

    ``time_scale`` multiplies every engine step's duration (0.01 runs 100× faster
    than the modelled GPU); ``engine_index`` is the ``engine`` metrics label.
    P/D (vLLM's NixlConnector): ``role`` is which legs the engine plays,
    ``kv_bandwidth_gbps`` the KV link to other engines (GB/s, scaled like steps),
    ``kv_lease_s`` how long unread prefill KV stays pinned (wall seconds), and
    ``engine_id`` the NIXL engine id (default: derived from host, port and seed).
    ``host``/``port`` are the address prefill replies advertise; without a port
    (or with a wildcard host) the address the request came in on is used.
    ``fault``/``fault_admin`` install fault injection (:mod:`gateway.emulator.faults`).
    """

    model: str = "kvgate-emulated"
    preset: str = "llama3-8b-h100"
    time_scale: float = 1.0
    seed: int = 0
    engine_index: str = "0"
    max_model_len: int | None = None
    kv_capacity_blocks: int | None = None
    priority_groups: bool = False
    role: Role = "both"
    kv_bandwidth_gbps: float = 25.0
    kv_lease_s: float = DEFAULT_LEASE
    engine_id: str | None = None
    host: str = "127.0.0.1"
    port: int | None = None
    fault: str | None = None
    """``NAME[:ARG]`` of :mod:`gateway.emulator.faults`, active from the start."""
    fault_admin: bool = False
    """Serve ``/_faults`` (fault injection at run time) even without ``fault``."""
    kv_events: KVEventsConfig | None = None
    """Publish vLLM's KV cache events (:mod:`gateway.emulator.kv_publisher`); None: off."""
    runner: Runner = "generate"
    """vLLM's ``--runner``: ``generate`` serves the generation routes, ``pooling`` the
    pooling ones (:mod:`gateway.emulator.pooling`), never both."""
    convert: PoolingTask = "embed"
    """The pooling task (vLLM's ``--convert``): ``embed`` or ``classify`` (a one-label
    cross-encoder: ``/classify``, ``/score``, ``/rerank``)."""
    transcription: bool = False
    """A speech-to-text model (Whisper-like): also serve ``/v1/audio/*``."""
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_modules: tuple[tuple[str, str], ...] = ()
    """Adapters served from the start: (name, path)."""
    allow_runtime_lora: bool = False
    """Serve ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (also when
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set)."""
    responses_store_size: int = DEFAULT_CAPACITY
    """Stored responses kept (oldest dropped past it)."""

    def kv_engine_id(self) -> str:
        """The engine id prefill replies name: ``engine_id``, else a uuid derived from
        host, port and seed (random when the port is not known)."""
        if self.engine_id:
            return self.engine_id
        if self.port is None:
            return str(uuid.uuid4())
        host = socket.gethostname() if self.host in _WILDCARDS else self.host
        return str(
            uuid.uuid5(uuid.NAMESPACE_URL, f"kvgate-emulate://{host}:{self.port}/{self.seed}")
        )

    def perf_model(self) -> PerfModel:
        """The preset with overrides applied; raises ConfigError on bad values."""
        if not self.time_scale > 0:
            raise ConfigError(f"time scale must be positive, got {self.time_scale}")
        if not self.model:
            raise ConfigError("the model name must not be empty")
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        for name in ("kv_bandwidth_gbps", "kv_lease_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.runner not in ("generate", "pooling"):
            raise ConfigError(f"runner must be generate or pooling, got {self.runner!r}")
        if self.convert not in ("embed", "classify"):
            raise ConfigError(f"convert must be embed or classify, got {self.convert!r}")
        if self.transcription and self.runner != "generate":
            raise ConfigError("a transcription model runs with the generate runner")
        if self.responses_store_size < 1:
            raise ConfigError("responses_store_size must be positive")
        if (self.lora_modules or self.allow_runtime_lora) and not self.enable_lora:
            raise ConfigError("LoRA adapters need enable_lora (--enable-lora)")
        changes: dict[str, int] = {}
        if self.enable_lora:
            if self.max_loras < 1 or self.max_lora_rank < 1:
                raise ConfigError("max_loras and max_lora_rank must be positive")
            changes["max_loras"] = self.max_loras
        for name in ("max_model_len", "kv_capacity_blocks"):
            value = getattr(self, name)
            if value is not None:
                if value <= 0:
                    raise ConfigError(f"{name} must be positive, got {value}")
                changes[name] = value
        return load_preset(self.preset).with_overrides(**changes)


_WILDCARDS = frozenset({"", "0.0.0.0", "::"})
Runner = Literal["generate", "pooling"]
PoolingTask = Literal["embed", "classify"]


@dataclass(slots=True)
class EmulatorState:
    """Everything the routes use: settings, engine driver, tokenizer, metrics registry."""

    settings: EmulatorSettings
    perf: PerfModel
    driver: EngineDriver
    registry: CollectorRegistry
    kv: KvTransfer
    engine_id: str
    lora: LoraTable
    responses: ResponseStore
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    kv_events: KVEventPublisher | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def check_model(self, name: str | None) -> str:
        """The LoRA adapter ``name`` selects ("" for the base model or none given);
        404 for any other name, as vLLM answers."""
        return self.lora.resolve(name)

    def served_name(self, lora: str) -> str:
        """The ``model`` a response names: the adapter, else the served model."""
        return lora or self.settings.model

    def text(self, handle: GenerationHandle, start: int, count: int) -> str:
        """Text of output tokens ``start .. start+count`` of ``handle``."""
        ids = output_tokens(handle.digest, start, count, self.driver.seed)
        return self.tokenizer.decode(ids)

    def kv_address(self, request: Request) -> tuple[str, int]:
        """(host, port) a decode engine reaches this engine at."""
        host, port = self.settings.host, self.settings.port
        if host in _WILDCARDS:
            host = request.url.hostname or "localhost"
        if port is None:
            server = request.scope.get("server")
            port = server[1] if server and server[1] else request.url.port
            if port is None:
                port = 443 if request.url.scheme == "https" else 80
        return host, port


def build_state(settings: EmulatorSettings, perf: PerfModel) -> EmulatorState:
    """A fresh engine driver with its metrics on a new registry (not started)."""
    registry = CollectorRegistry()
    events = settings.kv_events
    publisher = KVEventPublisher(events, perf.block_size) if events is not None else None
    driver = EngineDriver(
        perf,
        engine_id=settings.engine_index,
        time_scale=settings.time_scale,
        seed=settings.seed,
        priority_groups=settings.priority_groups,
        kv_lease=settings.kv_lease_s,
        kv_events=publisher,
    )
    tokens = perf.kv_capacity_blocks * perf.block_size
    cache_info = {
        "block_size": str(perf.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": "True",
        "gpu_memory_utilization": "0.9",
        "kv_cache_max_concurrency": str(tokens / perf.max_model_len),
        "kv_cache_memory_bytes": str(tokens * perf.kv_bytes_per_token),
        "kv_cache_size_tokens": str(tokens),
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(perf.kv_capacity_blocks),
        "num_gpu_blocks_override": "None",
        "prefix_caching_hash_algo": events.hash_algo if events is not None else "xxhash",
        "sliding_window": "None",
    }
    engine_id = settings.kv_engine_id()
    kv_metrics = TransferMetrics(
        registry, driver.pins, model_name=settings.model, engine=settings.engine_index
    )
    kv = KvTransfer(
        driver, kv_metrics, engine_id=engine_id, bandwidth_gbps=settings.kv_bandwidth_gbps
    )
    if settings.enable_lora:
        registry.register(LoraInfoCollector(driver.core))
    driver.observer = EmulatorMetrics(
        registry,
        driver.core,
        model_name=settings.model,
        engine=settings.engine_index,
        cache_info=cache_info,
        deferred=lambda: kv.in_flight,
    )
    lora = LoraTable(settings.model, settings.enable_lora, dict(settings.lora_modules))
    responses = ResponseStore(settings.responses_store_size)
    return EmulatorState(
        settings, perf, driver, registry, kv, engine_id, lora, responses, kv_events=publisher
    )


def get_state(request: Request) -> EmulatorState:
    """FastAPI dependency: the state the lifespan stored on the app."""
    state: EmulatorState = request.app.state.emulator
    return state


StateDep = Annotated[EmulatorState, Depends(get_state)]
