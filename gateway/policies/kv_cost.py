"""Dynamo's KV router cost: new prefill blocks after the cache credit, plus decode blocks.

Algorithm (NVIDIA Dynamo KV router, docs v1.5-1.6, temperature 0), per engine::

    prefill  = active prefill blocks + this prompt's blocks
    adjusted = max(prefill - overlap_credit * cached blocks of this prompt, 0)
    decode   = active decode blocks + this prompt's blocks
    cost     = prefill_load_scale * adjusted + decode

The lowest cost wins; equal costs are broken with the seeded RNG.
*Active prefill blocks* are the engine's uncached prompt tokens not yet
prefilled (``pending_prefill_tokens``) over the block size; *active decode
blocks* are the router's own count of the KV blocks its in-flight requests
hold there (each routed request adds its prompt's blocks until it finishes),
as Dynamo's slot tracker predicts them. *Cached blocks* come from an
approximate index of routed prompts whose entries expire ``ttl_s`` after
their last use (Dynamo's ApproxKvIndexer, 120 s) and never exceed the
engine's KV size; with KV events (``precise`` or ``PolicyContext.kv_events``)
the engines' stored/removed blocks are used instead of the TTL, as Dynamo's
event-driven indexer does.

Knobs and defaults (Dynamo's): ``overlap_credit=1.0``,
``prefill_load_scale=1.0``, ``ttl_s=120``. Not reproduced: the softmax over
costs when the temperature is > 0, credit decay (default off), host/disk
cache tiers. Source: ai-dynamo/dynamo KV router docs (facts only;
``../shared/docs/anchors.md``, Update).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from gateway.core.types import ClusterView, Decision, EngineId, RequestInfo
from gateway.policies.base import PolicyBase, PolicyContext
from gateway.policies.prefix_index import PrefixIndex

_DEFAULT_INDEX_BLOCKS = 31_250
_MAX_INDEX_BLOCKS = 1 << 22
_MAX_TRACKED = 1 << 20  # in-flight requests whose decode blocks are counted


@dataclass(frozen=True, slots=True)
class KvCostConfig:
    overlap_credit: float = 1.0
    prefill_load_scale: float = 1.0
    ttl_s: float = 120.0
    precise: bool = False
    """Use the engines' KV events for cached blocks (Dynamo's event-driven indexer)."""

    def __post_init__(self) -> None:
        if self.overlap_credit < 0 or self.prefill_load_scale < 0:
            raise ValueError("overlap_credit and prefill_load_scale must be >= 0")
        if self.ttl_s <= 0:
            raise ValueError("ttl_s must be positive")


class KvCostPolicy(PolicyBase):
    name: ClassVar[str] = "kv_cost"

    def __init__(self, ctx: PolicyContext, config: KvCostConfig | None = None) -> None:
        self.config = config or KvCostConfig()
        self.wants_cache_events = self.config.precise or ctx.kv_events
        self.index = PrefixIndex(_MAX_INDEX_BLOCKS)
        self._rng = ctx.rng(self.name)
        self._capacity: dict[EngineId, int] = {}
        self._touched: dict[EngineId, OrderedDict[int, float]] = {}
        self._decode_blocks: dict[EngineId, int] = {}
        self._held: OrderedDict[str, tuple[EngineId, int]] = OrderedDict()

    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        cfg = self.config
        self._expire(now)
        healthy = view.healthy()
        for e in healthy:
            if e.kv_capacity_blocks:
                self._capacity[e.id] = e.kv_capacity_blocks
        bs = max(1, req.block_size)
        blocks = -(-req.prompt_tokens // bs)
        matched = self.index.match(req.block_hashes)
        costs: list[float] = []
        for e in healthy:
            prefill = -(-e.pending_prefill_tokens // bs) + blocks
            adjusted = max(prefill - cfg.overlap_credit * matched.get(e.id, 0), 0.0)
            decode = self._decode_blocks.get(e.id, 0) + blocks
            costs.append(cfg.prefill_load_scale * adjusted + decode)
        low = min(costs)
        best = [i for i, c in enumerate(costs) if c <= low + 1e-9]
        pick = best[0] if len(best) == 1 else self._rng.choice(best)
        chosen = healthy[pick]
        hit = min(matched.get(chosen.id, 0) * bs, max(0, req.prompt_tokens - 1))
        return Decision(engine=chosen.id, expected_hit_tokens=hit, reason="kv_cost")

    # -- hooks -------------------------------------------------------------------
    def on_routed(self, req: RequestInfo, decision: Decision, now: float) -> None:
        engine = decision.engine
        cap = self._capacity.get(engine) or _DEFAULT_INDEX_BLOCKS
        self.index.insert(engine, req.block_hashes, cap)
        if not self.wants_cache_events:  # the TTL clock mirrors the index's LRU order
            touched = self._touched.setdefault(engine, OrderedDict())
            for h in reversed(req.block_hashes):
                touched[h] = now
                touched.move_to_end(h)
            while len(touched) > cap:
                touched.popitem(last=False)
        blocks = -(-req.prompt_tokens // max(1, req.block_size))
        if req.id not in self._held:
            self._held[req.id] = (engine, blocks)
            self._decode_blocks[engine] = self._decode_blocks.get(engine, 0) + blocks
            while len(self._held) > _MAX_TRACKED:  # a lost finish must not grow this forever
                self._release(next(iter(self._held)))

    def on_finished(self, req: RequestInfo, engine: EngineId, now: float, ok: bool) -> None:
        self._release(req.id)

    def on_cache_event(
        self, engine: EngineId, stored: Sequence[int], removed: Sequence[int]
    ) -> None:
        if stored:
            cap = self._capacity.get(engine) or _DEFAULT_INDEX_BLOCKS
            self.index.insert(engine, stored, cap)
        if removed:
            self.index.remove(engine, removed)

    def on_cache_reset(self, engine: EngineId) -> None:
        self.index.remove_engine(engine)
        self._touched.pop(engine, None)

    def on_engine_removed(self, engine: EngineId) -> None:
        self.index.remove_engine(engine)
        self._touched.pop(engine, None)
        self._capacity.pop(engine, None)
        self._decode_blocks.pop(engine, None)
        for rid in [r for r, (e, _) in self._held.items() if e == engine]:
            del self._held[rid]

    # -- helpers -------------------------------------------------------------------
    def _release(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is None:
            return
        engine, blocks = held
        left = self._decode_blocks.get(engine, 0) - blocks
        if left > 0:
            self._decode_blocks[engine] = left
        else:
            self._decode_blocks.pop(engine, None)

    def _expire(self, now: float) -> None:
        """Approximate mode: forget blocks not routed to an engine for ``ttl_s``."""
        if self.wants_cache_events:
            return
        horizon = now - self.config.ttl_s
        for engine, touched in self._touched.items():
            old: list[int] = []
            while touched:
                h, when = next(iter(touched.items()))
                if when >= horizon:
                    break
                touched.popitem(last=False)
                old.append(h)
            if old:
                self.index.remove(engine, old)
