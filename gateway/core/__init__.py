"""The pure scheduling core: value types, block hashing, clocks and errors."""

from gateway.core.blocks import (
    TRACE_BLOCK_TOKENS,
    hashes_from_text,
    hashes_from_tokens,
    hashes_from_trace,
)
from gateway.core.clock import Clock, ManualClock, MonotonicClock
from gateway.core.errors import ConfigError, KvgateError, NoEngineError, WorkloadError
from gateway.core.types import (
    DEFAULT_SLO,
    ClusterView,
    Decision,
    EngineId,
    EngineRole,
    EngineView,
    Migration,
    RequestInfo,
    SloClass,
)

__all__ = [
    "DEFAULT_SLO",
    "TRACE_BLOCK_TOKENS",
    "Clock",
    "ClusterView",
    "ConfigError",
    "Decision",
    "EngineId",
    "EngineRole",
    "EngineView",
    "KvgateError",
    "ManualClock",
    "Migration",
    "MonotonicClock",
    "NoEngineError",
    "RequestInfo",
    "SloClass",
    "WorkloadError",
    "hashes_from_text",
    "hashes_from_tokens",
    "hashes_from_trace",
]
