"""SGLang/SMG cache-aware routing: prefix affinity with a load-imbalance escape.

Algorithm (SMG ``cache_aware``, HTTP mode, on block hashes instead of chars):

1. Load is each engine's in-flight request count (router-side). If
   ``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold * min``
   the cluster is imbalanced: route to the least loaded engine.
2. Otherwise match the prompt against each engine's approximate prefix tree
   (the blocks of prompts previously routed there). If the best match covers
   more than ``cache_threshold`` of the prompt, route to that engine (ties:
   lower load); else route to the engine with the smallest tree.
3. Record the prompt in the chosen engine's tree (bounded LRU, see
   :class:`~gateway.policies.prefix_index.PrefixIndex`).

Knobs and defaults (SMG/vllm-router CLI): ``cache_threshold=0.3``,
``balance_abs_threshold=64``, ``balance_rel_threshold=1.5``;
``max_tree_blocks=262144`` per engine (about SGLang's 2^24-character tree).
Source: smg-project/smg ``model_gateway/src/policies/cache_aware.rs`` header
and the vllm-project/router docs (facts only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from gateway.core.types import ClusterView, Decision, EngineId, RequestInfo
from gateway.policies.base import PolicyBase, PolicyContext
from gateway.policies.prefix_index import PrefixIndex


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_blocks: int = 262_144
    precise: bool = False
    """Correct the approximate tree with the engines' KV events (stored, removed, cleared)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be within [0, 1]")
        if self.max_tree_blocks <= 0:
            raise ValueError("max_tree_blocks must be positive")


class CacheAwarePolicy(PolicyBase):
    name: ClassVar[str] = "cache_aware"

    def __init__(self, ctx: PolicyContext, config: CacheAwareConfig | None = None) -> None:
        self.config = config or CacheAwareConfig()
        self.wants_cache_events = self.config.precise or ctx.kv_events
        self.index = PrefixIndex(self.config.max_tree_blocks)

    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        cfg = self.config
        healthy = view.healthy()
        loads = [e.in_flight for e in healthy]
        lo, hi = min(loads), max(loads)
        if hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo:
            pick = min(range(len(healthy)), key=lambda i: (loads[i], i))
            return Decision(engine=healthy[pick].id, reason="cache_aware:balance")
        matched = self.index.match(req.block_hashes)
        best = max(
            range(len(healthy)), key=lambda i: (matched.get(healthy[i].id, 0), -loads[i], -i)
        )
        best_blocks = matched.get(healthy[best].id, 0)
        hit_tokens = best_blocks * req.block_size
        if req.prompt_tokens > 0 and hit_tokens / req.prompt_tokens > cfg.cache_threshold:
            return Decision(
                engine=healthy[best].id, expected_hit_tokens=hit_tokens, reason="cache_aware:hit"
            )
        pick = min(range(len(healthy)), key=lambda i: (self.index.size(healthy[i].id), loads[i], i))
        return Decision(
            engine=healthy[pick].id,
            expected_hit_tokens=matched.get(healthy[pick].id, 0) * req.block_size,
            reason="cache_aware:smallest_tree",
        )

    def on_routed(self, req: RequestInfo, decision: Decision, now: float) -> None:
        self.index.insert(decision.engine, req.block_hashes)

    def on_cache_event(
        self, engine: EngineId, stored: Sequence[int], removed: Sequence[int]
    ) -> None:
        """Precise mode: blocks the engine stored are recorded, the ones it evicted dropped."""
        if stored:
            self.index.insert(engine, stored)
        if removed:
            self.index.remove(engine, removed)

    def on_cache_reset(self, engine: EngineId) -> None:
        self.index.remove_engine(engine)

    def on_engine_removed(self, engine: EngineId) -> None:
        self.index.remove_engine(engine)

    def tree_sizes(self, engines: Sequence[EngineId]) -> list[int]:
        return [self.index.size(e) for e in engines]
