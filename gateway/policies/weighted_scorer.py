"""llm-d-style weighted scorer: prefix, queue and KV-usage scores, summed with weights.

Algorithm (llm-d Router / GAIE EPP default profile, re-implemented):

* prefix score: the fraction of the prompt's blocks found in the engine's
  approximate prefix cache (blocks of prompts routed there, an LRU as large
  as the engine's KV capacity when known);
* queue score: ``(max_q - q) / (max_q - min_q)`` over the engines' waiting
  queues, 1 for all when they are equal;
* KV-cache score: ``1 - kv_usage``.

The engine with the highest ``3*prefix + 2*queue + 2*kv`` wins; ties are
broken with the policy's seeded RNG (llm-d's max-score picker picks randomly
among equals). Knobs: ``prefix_weight=3``, ``queue_weight=2``,
``kv_weight=2``, ``lru_capacity_blocks=0`` (0: the engine's KV capacity,
else this many blocks). Source: llm-d docs and the approx-prefix-cache
producer README (facts only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from gateway.core.types import ClusterView, Decision, EngineId, RequestInfo
from gateway.policies.base import PolicyBase, PolicyContext
from gateway.policies.prefix_index import PrefixIndex

_DEFAULT_LRU_BLOCKS = 31_250  # ~500k tokens of 16: a large GPU's KV cache


@dataclass(frozen=True, slots=True)
class WeightedScorerConfig:
    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    kv_weight: float = 2.0
    lru_capacity_blocks: int = 0
    precise: bool = False
    """Correct the approximate index with the engines' KV events (llm-d's precise mode)."""

    def __post_init__(self) -> None:
        if min(self.prefix_weight, self.queue_weight, self.kv_weight) < 0:
            raise ValueError("weights must be >= 0")
        if self.lru_capacity_blocks < 0:
            raise ValueError("lru_capacity_blocks must be >= 0")


class WeightedScorerPolicy(PolicyBase):
    name: ClassVar[str] = "weighted_scorer"

    def __init__(self, ctx: PolicyContext, config: WeightedScorerConfig | None = None) -> None:
        self.config = config or WeightedScorerConfig()
        self.wants_cache_events = self.config.precise or ctx.kv_events
        cap = self.config.lru_capacity_blocks
        self.index = PrefixIndex(cap if cap > 0 else 1 << 22)
        self._rng = ctx.rng(self.name)
        self._capacity: dict[EngineId, int] = {}

    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        cfg = self.config
        healthy = view.healthy()
        # Remember each engine's KV capacity: the LRU size of its prefix cache (auto mode).
        for e in healthy:
            self._capacity[e.id] = e.kv_capacity_blocks
        matched = self.index.match(req.block_hashes)
        total = len(req.block_hashes)
        queues = [e.num_waiting for e in healthy]
        q_lo, q_hi = min(queues), max(queues)
        scores: list[float] = []
        for e, q in zip(healthy, queues, strict=True):
            prefix = matched.get(e.id, 0) / total if total else 0.0
            queue = 1.0 if q_hi == q_lo else (q_hi - q) / (q_hi - q_lo)
            kv = 1.0 - min(max(e.kv_usage, 0.0), 1.0)
            scores.append(
                cfg.prefix_weight * prefix + cfg.queue_weight * queue + cfg.kv_weight * kv
            )
        top = max(scores)
        best = [i for i, s in enumerate(scores) if s >= top - 1e-12]
        pick = best[0] if len(best) == 1 else self._rng.choice(best)
        chosen = healthy[pick]
        return Decision(
            engine=chosen.id,
            expected_hit_tokens=matched.get(chosen.id, 0) * req.block_size,
            reason="weighted_scorer",
        )

    def on_routed(self, req: RequestInfo, decision: Decision, now: float) -> None:
        self.index.insert(decision.engine, req.block_hashes, self._lru_blocks(decision.engine))

    def _lru_blocks(self, engine: EngineId) -> int:
        cap = self.config.lru_capacity_blocks or self._capacity.get(engine, 0)
        return cap or _DEFAULT_LRU_BLOCKS

    def on_cache_event(
        self, engine: EngineId, stored: Sequence[int], removed: Sequence[int]
    ) -> None:
        """Precise mode: blocks the engine stored are recorded, the ones it evicted dropped."""
        if stored:
            self.index.insert(engine, stored, self._lru_blocks(engine))
        if removed:
            self.index.remove(engine, removed)

    def on_cache_reset(self, engine: EngineId) -> None:
        self.index.remove_engine(engine)

    def on_engine_removed(self, engine: EngineId) -> None:
        self.index.remove_engine(engine)
        self._capacity.pop(engine, None)
