"""Length heuristic: place requests by their token lengths, not by a cost model.

Algorithm (a common production heuristic, the third baseline of the
cost-model router's evaluation): prompts of at least ``remote_min_tokens`` go
to the prefill engine with the fewest pending prefill tokens; shorter ones are
prefilled on their decode engine. The decode engine is the one with the
fewest outstanding tokens — the router's own count of prompt + expected
output (``max_tokens`` when given, else ``default_output_tokens``) of its
requests in flight. In a unified pool it is simply "fewest outstanding tokens".
Ties (every engine idle: requests one after another) rotate with the number of decisions
made, so a sequence of requests does not pile on the first engine of the list.
It is a baseline with its own length rule, not the P/D rule of
:mod:`gateway.policies.pd_rule`; its decisions are labelled ``remote_long`` and
``local_short`` (by its own threshold) so that they count in the same metric.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from gateway.core.types import (
    ClusterView,
    Decision,
    EngineId,
    EngineRole,
    EngineView,
    RequestInfo,
)
from gateway.policies.base import PolicyBase, PolicyContext
from gateway.policies.pd_rule import PDReason


@dataclass(frozen=True, slots=True)
class LengthHeuristicConfig:
    remote_min_tokens: int = 1024
    default_output_tokens: int = 256


class LengthHeuristicPolicy(PolicyBase):
    name: ClassVar[str] = "length_heuristic"
    pd_native: ClassVar[bool] = True

    def __init__(self, ctx: PolicyContext, config: LengthHeuristicConfig | None = None) -> None:
        self.config = config or LengthHeuristicConfig()
        self.outstanding: dict[EngineId, int] = {}
        self._requests: dict[str, tuple[EngineId, int]] = {}
        self._turn = 0
        """Decisions made: ties go to the engine this many places down the list."""

    def _size(self, req: RequestInfo) -> int:
        return req.prompt_tokens + (req.max_tokens or self.config.default_output_tokens)

    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        disagg = view.disaggregated
        decodes = view.pool(EngineRole.DECODE).healthy() if disagg else view.healthy()
        order = self._rotation(decodes)
        decode = min(
            decodes, key=lambda e: (self.outstanding.get(e.id, 0), e.in_flight, order[e.id])
        )
        prefill = None
        if disagg and req.prompt_tokens >= self.config.remote_min_tokens:
            pool = [e for e in view.pool(EngineRole.PREFILL).healthy() if e.id != decode.id]
            if pool:
                order = self._rotation(pool)
                prefill = min(
                    pool, key=lambda e: (e.pending_prefill_tokens, e.in_flight, order[e.id])
                ).id
        pd = ""
        if disagg:
            pd = (PDReason.REMOTE_LONG if prefill else PDReason.LOCAL_SHORT).value
        return Decision(
            engine=decode.id,
            prefill_engine=prefill,
            reason="length_heuristic:" + ("remote" if prefill else "local"),
            pd_reason=pd,
        )

    def _rotation(self, engines: Sequence[EngineView]) -> dict[EngineId, int]:
        """Each engine's place in the tie order: the list rotated by the decisions made."""
        n = len(engines)
        return {e.id: (i - self._turn) % n for i, e in enumerate(engines)}

    def on_routed(self, req: RequestInfo, decision: Decision, now: float) -> None:
        size = self._size(req)
        self.outstanding[decision.engine] = self.outstanding.get(decision.engine, 0) + size
        self._requests[req.id] = (decision.engine, size)
        self._turn += 1

    def on_finished(self, req: RequestInfo, engine: EngineId, now: float, ok: bool) -> None:
        entry = self._requests.pop(req.id, None)
        if entry is not None:
            self.outstanding[entry[0]] = self.outstanding.get(entry[0], 0) - entry[1]

    def on_engine_removed(self, engine: EngineId) -> None:
        self.outstanding.pop(engine, None)
