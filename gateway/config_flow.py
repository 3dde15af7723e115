"""The ``flow_control:`` section of the settings: admission, priority and fairness.

On by default; it holds requests only while every engine is saturated
(:mod:`gateway.flow.saturation`), so an unloaded fleet sees no change. Built into the pure
:class:`~gateway.flow.FlowSettings` and :class:`~gateway.flow.SaturationSettings`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.flow import FlowSettings, SaturationSettings

__all__ = ["FlowControlConfig"]


class FlowControlConfig(BaseModel):
    """Flow control in front of every policy (docs/gateway.md, "Flow control")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=True, description="hold requests while the engines saturate")
    priority_header: str | None = Field(
        default="x-kvgate-priority",
        description="header whose integer overrides the body's priority; null: body only",
    )
    tenant_header: str | None = Field(
        default=None,
        description="header naming the tenant; unset: a hash of the client's API key",
    )
    tenant_weights: dict[str, float] = Field(
        default_factory=dict, description="fair-share weight per tenant name (default 1)"
    )
    max_queued: int = Field(default=2_000, ge=1, description="requests held in all")
    max_queued_per_priority: int = Field(default=1_000, ge=1, description="held per priority")
    queue_timeout_s: float = Field(default=30.0, gt=0, description="longest wait, then 503")
    timeout_by_priority: dict[int, float] = Field(
        default_factory=dict, description="longest wait per priority, seconds"
    )
    retry_after_s: int = Field(default=1, ge=1, description="least Retry-After of a refusal")
    max_waiting: int = Field(
        default=8, ge=0, description="an engine with this many waiting is saturated (0: off)"
    )
    max_kv_usage: float = Field(
        default=0.95, ge=0, le=1, description="an engine this full of KV is saturated (0: off)"
    )
    max_ttft_s: float = Field(
        default=2.0,
        ge=0,
        description="saturated when the prefill queued ahead exceeds min(SLO TTFT, this) (0: off)",
    )
    protect_ttft_s: float = Field(
        default=0.05,
        ge=0,
        description="while several priorities arrived within protect_window_s, a request is "
        "held once the prefill queued ahead exceeds this (0: off)",
    )
    protect_window_s: float = Field(
        default=30.0, ge=0, description="how long a priority's last arrival counts towards a mix"
    )
    engine_priority: Literal["passthrough", "set", "strip"] = Field(
        default="passthrough",
        description="the body's priority to vLLM: as the client sent it, set to the effective "
        "priority (needs vLLM --scheduling-policy priority), or removed",
    )
    metrics_max_tenants: int = Field(
        default=50, ge=1, description="tenants labelled in metrics; the rest count as 'other'"
    )

    def flow_settings(self) -> FlowSettings:
        return FlowSettings(
            enabled=self.enabled,
            max_queued=self.max_queued,
            max_queued_per_priority=self.max_queued_per_priority,
            queue_timeout_s=self.queue_timeout_s,
            timeout_by_priority=dict(self.timeout_by_priority),
            tenant_weights=dict(self.tenant_weights),
            retry_after_s=self.retry_after_s,
        )

    def saturation_settings(self) -> SaturationSettings:
        return SaturationSettings(
            max_waiting=self.max_waiting,
            max_kv_usage=self.max_kv_usage,
            max_ttft_s=self.max_ttft_s,
            protect_ttft_s=self.protect_ttft_s,
            protect_window_s=self.protect_window_s,
        )
