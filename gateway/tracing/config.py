"""The ``tracing:`` section of the settings (OpenTelemetry; off by default)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["TracingConfig"]

_DEFAULT_ENDPOINTS = {"grpc": "http://127.0.0.1:4317", "http": "http://127.0.0.1:4318/v1/traces"}


class TracingConfig(BaseModel):
    """OpenTelemetry spans for proxied requests, exported over OTLP.

    Off: kvgate imports no OpenTelemetry module and creates no span; it still forwards the
    client's ``traceparent``, ``tracestate`` and ``baggage`` to the engines unchanged."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=False, description="emit spans (needs the `tracing` extra)")
    endpoint: str | None = Field(
        default=None,
        description="OTLP collector; unset: http://127.0.0.1:4317 (grpc) or "
        "http://127.0.0.1:4318/v1/traces (http)",
    )
    protocol: Literal["grpc", "http"] = Field(
        default="grpc", description="OTLP over gRPC, or over HTTP with protobuf bodies"
    )
    service_name: str = Field(default="kvgate", min_length=1, description="resource service.name")
    sample_ratio: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="share of new traces sampled; a client's traceparent decides for its own",
    )
    max_queue_size: int = Field(
        default=2048, ge=1, description="spans waiting for export; more are dropped"
    )
    schedule_delay_s: float = Field(default=5.0, gt=0, description="export batch interval")

    @property
    def url(self) -> str:
        """The collector's address for this protocol."""
        return self.endpoint or _DEFAULT_ENDPOINTS[self.protocol]
