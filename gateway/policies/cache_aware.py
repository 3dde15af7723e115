"""SGLang/SMG cache-aware routing: prefix affinity with a load-imbalance escape.

Algorithm (SMG ``cache_aware``, HTTP mode, as its code routes today, on block
hashes instead of chars):

1. Load is each engine's in-flight request count (router-side). If
   ``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold * min``
   the cluster is imbalanced: route to the least loaded engine.
2. Otherwise match the prompt against each engine's approximate prefix tree
   (the blocks of prompts previously routed there). If the best match covers
   more than ``cache_threshold`` of the prompt, route to that engine (ties:
   lower load); else (a miss) route to the least loaded engine — SMG's code
   does this since 2026 although its file header still says "the smallest
   tree"; ``miss=smallest_tree`` restores the older rule.
3. Record the prompt in the chosen engine's tree (bounded LRU, see
   :class:`~gateway.policies.prefix_index.PrefixIndex`).

Knobs and defaults (SMG's library defaults, ``CacheAwareConfig::default``):
``cache_threshold=0.5``, ``balance_abs_threshold=32``,
``balance_rel_threshold=1.1``; ``miss=least_loaded``; ``max_tree_blocks=262144``
per engine (about SGLang's 2^24-character tree). SMG's CLI and the
vllm-project/router launcher default to 0.3 / 64 / 1.5 instead (pass them as
options to reproduce those deployments). SMG's newer KV-pressure triggers of
the imbalance escape are not reproduced: their thresholds are unpublished.
``precise=true`` (or a driver delivering KV events) corrects the tree with the
engines' stored/removed blocks, as SMG's event-driven mode does.
Source: lightseekorg/smg ``model_gateway/src/policies/cache_aware.rs`` and
``config`` defaults (facts only; ``../shared/docs/anchors.md``, Update).
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
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.1
    miss: str = "least_loaded"
    """Where a request without a good match goes: ``least_loaded`` or ``smallest_tree``."""
    max_tree_blocks: int = 262_144
    precise: bool = False
    """Correct the approximate tree with the engines' KV events (stored, removed, cleared)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be within [0, 1]")
        if self.max_tree_blocks <= 0:
            raise ValueError("max_tree_blocks must be positive")
        if self.miss not in ("least_loaded", "smallest_tree"):
            raise ValueError("miss must be 'least_loaded' or 'smallest_tree'")


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
        if cfg.miss == "smallest_tree":
            pick = min(
                range(len(healthy)), key=lambda i: (self.index.size(healthy[i].id), loads[i], i)
            )
        else:
            pick = min(range(len(healthy)), key=lambda i: (loads[i], i))
        return Decision(
            engine=healthy[pick].id,
            expected_hit_tokens=matched.get(healthy[pick].id, 0) * req.block_size,
            reason=f"cache_aware:{cfg.miss}",
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
