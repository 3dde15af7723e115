"""Core value types shared by every layer: requests, engine views, decisions.

All types are frozen, slotted dataclasses. They carry no behaviour beyond small
derived properties, so that the simulator and the live gateway can build them
cheaply and policies can treat them as plain data.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

EngineId = str
"""An engine's identity: its base URL in the gateway, ``sim-<i>`` in the simulator."""


class EngineRole(StrEnum):
    """What an engine serves: a whole request, or one phase of a disaggregated one."""

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class SloClass:
    """A named service level: TTFT and TPOT targets in seconds."""

    name: str
    ttft_s: float
    tpot_s: float

    def met(self, ttft: float, tpot: float | None) -> bool:
        """True when a request with these latencies meets both targets.

        ``tpot`` is ``None`` for single-token outputs, which meet any TPOT target.
        """
        return ttft <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


DEFAULT_SLO = SloClass("standard", ttft_s=5.0, tpot_s=0.1)


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """Everything a policy may know about one request.

    ``block_hashes`` are chained hashes of the prompt's full blocks of
    ``block_size`` tokens (see :mod:`gateway.core.blocks`): equal hashes at
    position ``k`` mean the first ``(k + 1) * block_size`` tokens are identical.
    ``output_tokens`` is the actual output length; it is ``None`` until the
    request finished (the simulator and gateway fill it in for ``on_finished``).
    """

    id: str
    block_hashes: tuple[int, ...]
    prompt_tokens: int
    arrival: float
    block_size: int = 16
    predicted_output_tokens: int | None = None
    output_tokens: int | None = None
    slo: SloClass = DEFAULT_SLO
    model: str = ""
    max_tokens: int | None = None
    lora: str = ""
    """The LoRA adapter the request runs with (its model name), "" for a base model."""
    session: str = ""
    """The client's session (agent or conversation) id, "" when it sent none."""
    tenant: str = ""
    """Who sent it (flow control's fairness unit: a hashed API key or a configured header)."""
    priority: int = 0
    """vLLM's ``priority`` (lower is served first), as flow control read it."""

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


@dataclass(frozen=True, slots=True)
class EngineView:
    """A snapshot of one engine as the router sees it.

    In the simulator the numbers are exact; in the gateway they mix scraped
    engine metrics with the router's own accounting.
    """

    id: EngineId
    role: EngineRole = EngineRole.BOTH
    healthy: bool = True
    num_waiting: int = 0
    num_running: int = 0
    pending_prefill_tokens: int = 0
    kv_usage: float = 0.0
    kv_capacity_blocks: int = 0
    in_flight: int = 0
    router_queued: int = 0
    router_queued_tokens: int = 0
    lora_resident: frozenset[str] = frozenset()
    """LoRA adapters in the engine's batch now (running or waiting: ``vllm:lora_requests_info``)."""
    max_lora: int = 0
    """Adapters the engine batches at once (``--max-loras``); 0 when unknown or no LoRA."""

    @property
    def serves_prefill(self) -> bool:
        return self.role is not EngineRole.DECODE

    @property
    def serves_decode(self) -> bool:
        return self.role is not EngineRole.PREFILL


@dataclass(frozen=True, slots=True)
class ClusterView:
    """The engines a policy may choose from, in a stable order."""

    engines: tuple[EngineView, ...]
    _index: Mapping[EngineId, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self._index:
            object.__setattr__(self, "_index", {e.id: i for i, e in enumerate(self.engines)})

    def __len__(self) -> int:
        return len(self.engines)

    def __iter__(self) -> Iterator[EngineView]:
        return iter(self.engines)

    def get(self, engine_id: EngineId) -> EngineView | None:
        i = self._index.get(engine_id)
        return None if i is None else self.engines[i]

    def position(self, engine_id: EngineId) -> int | None:
        return self._index.get(engine_id)

    @property
    def ids(self) -> tuple[EngineId, ...]:
        return tuple(e.id for e in self.engines)

    @property
    def disaggregated(self) -> bool:
        """True when healthy prefill-only and decode-only engines are both present."""
        roles = {e.role for e in self.engines if e.healthy}
        return EngineRole.PREFILL in roles and EngineRole.DECODE in roles

    def pool(self, role: EngineRole) -> ClusterView:
        """The engines that can serve ``role`` (``BOTH`` engines serve either phase)."""
        if role is EngineRole.PREFILL:
            return ClusterView(tuple(e for e in self.engines if e.serves_prefill))
        return ClusterView(tuple(e for e in self.engines if e.serves_decode))

    def healthy(self) -> tuple[EngineView, ...]:
        return tuple(e for e in self.engines if e.healthy)

    def for_role(self, role: EngineRole) -> tuple[EngineView, ...]:
        """Healthy engines that can serve ``role`` (``BOTH`` means whole requests)."""
        if role is EngineRole.PREFILL:
            return tuple(e for e in self.engines if e.healthy and e.serves_prefill)
        if role is EngineRole.DECODE:
            return tuple(e for e in self.engines if e.healthy and e.serves_decode)
        return tuple(e for e in self.engines if e.healthy and e.role is EngineRole.BOTH)


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes.

    ``engine`` serves the request (or its decode phase when ``prefill_engine``
    is set). ``hold`` asks the dispatcher to keep the request in ``engine``'s
    router queue instead of sending it now. ``expected_hit_tokens`` is the
    policy's estimate of the prompt tokens already cached on the target.
    ``pd_reason`` says, in a disaggregated cluster, why the prefill runs where it does
    (:class:`gateway.policies.pd_rule.PDReason`); empty in a unified pool.
    """

    engine: EngineId
    prefill_engine: EngineId | None = None
    hold: bool = False
    expected_hit_tokens: int = 0
    reason: str = ""
    candidates: tuple[EngineId, ...] = ()
    pd_reason: str = ""


@dataclass(frozen=True, slots=True)
class Migration:
    """Move a router-queued request to another engine's queue."""

    request_id: str
    source: EngineId
    target: EngineId
    hit_tokens: int = 0


def engine_ids(engines: Sequence[EngineView]) -> tuple[EngineId, ...]:
    return tuple(e.id for e in engines)
