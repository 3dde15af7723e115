"""Predicted TTFT: each engine's time to first token from the engine model and its cache.

Algorithm (kvgate's own; the idea of pricing queued prefill work against
cache hits is shared with Preble's ``L + P``, Mooncake's conductor and
Dynamo's KV cost):

1. **Cache.** Match the prompt's chained block hashes against a per-engine
   prefix index (:class:`~gateway.policies.prefix_index.PrefixIndex`): the
   blocks of prompts routed to each engine, an LRU as large as the engine's
   KV cache; with KV events (``PolicyContext.kv_events`` or ``precise``) the
   engines' own stored/removed blocks correct it.
2. **Predict.** For every healthy engine ``e``::

       ttft(e) = wait(e) + prefill(uncached(e), cached(e)) * slowdown(e)
       wait(e) = (pending prefill tokens + router-queued tokens) / rate(e)

   ``rate(e)`` is the prefill throughput of one engine step (the token budget
   less one token per running sequence, over the step time with that decode
   batch and the context it holds, from the shared performance model);
   ``slowdown(e)`` is how much the decodes sharing the steps stretch this
   request's own prefill. ``uncached(e)`` is the prompt less the blocks
   engine ``e`` is believed to hold.
3. **Pick** the lowest predicted TTFT; near-equal predictions (within
   ``tie_s``) go to the engine with the least queued work, then in turn, so
   an idle cluster spreads unique prompts evenly.

A prefix shared by all traffic (a system prompt) is cached on every engine
after its first request there and stops mattering; a hot prefix stays on its
engines only while their queues are shorter than the prefill it would cost
elsewhere, so it spreads over as many engines as its load needs, and a
multi-turn session keeps its engine unless that engine is busier by more than
its history costs to recompute.

Knobs: ``tie_s=0.005``; ``index_blocks=0`` (0: each engine's KV capacity);
``precise=false`` (also on when the driver delivers KV events).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from gateway.core.types import ClusterView, Decision, EngineId, EngineView, RequestInfo
from gateway.perfmodel.model import PerfModel
from gateway.policies.base import PolicyBase, PolicyContext
from gateway.policies.prefix_index import PrefixIndex

_FALLBACK_PERF = PerfModel(name="predicted-ttft-default", prefill_a=4.21, prefill_b=0.1084)
_DEFAULT_INDEX_BLOCKS = 31_250  # ~500k tokens of 16 when an engine reports no KV size
_MAX_INDEX_BLOCKS = 1 << 22


@dataclass(frozen=True, slots=True)
class PredictedTtftConfig:
    tie_s: float = 0.005
    waste_weight: float = 0.0
    decode_weight: float = 0.0
    busy_scaled: bool = False
    index_blocks: int = 0
    precise: bool = False
    """Correct the routed-prompt index with the engines' KV events (stored, removed, cleared)."""

    def __post_init__(self) -> None:
        if self.tie_s < 0:
            raise ValueError("tie_s must be >= 0")
        if self.index_blocks < 0:
            raise ValueError("index_blocks must be >= 0")


class PredictedTtftPolicy(PolicyBase):
    name: ClassVar[str] = "predicted_ttft"

    def __init__(self, ctx: PolicyContext, config: PredictedTtftConfig | None = None) -> None:
        self.config = config or PredictedTtftConfig()
        self.perf = ctx.perf or _FALLBACK_PERF
        self.wants_cache_events = self.config.precise or ctx.kv_events
        self.index = PrefixIndex(_MAX_INDEX_BLOCKS)
        self._capacity: dict[EngineId, int] = {}
        self._turn = 0

    # -- prediction ---------------------------------------------------------------
    def _step_rates(self, e: EngineView) -> tuple[float, float]:
        """(prefill tokens per second, slowdown of a prefill) on ``e`` given its decodes."""
        perf = self.perf
        budget = perf.max_num_batched_tokens
        running = min(e.num_running, budget - 1)
        chunk = budget - running
        ctx_total = int(e.kv_usage * (e.kv_capacity_blocks or perf.kv_capacity_blocks)) * (
            perf.block_size
        )
        alone = perf.step_time([(chunk, 0)], 0, 0)
        mixed = perf.step_time([(chunk, 0)], running, ctx_total) if running else alone
        return chunk / mixed, mixed / alone

    def predict(self, req: RequestInfo, view: ClusterView) -> list[tuple[float, int, EngineView]]:
        """(cost seconds, cached tokens, engine) for every healthy engine."""
        matched = self.index.match(req.block_hashes)
        cap = max(0, req.prompt_tokens - 1)
        rows = []
        for e in view.healthy():
            hit = min(matched.get(e.id, 0) * req.block_size, cap)
            rate, slowdown = self._step_rates(e)
            queued = e.pending_prefill_tokens + e.router_queued_tokens
            work = self.perf.prefill_time(req.prompt_tokens - hit, hit)
            rows.append((queued / rate, work * slowdown, work, hit, e))
        w = self.config.waste_weight
        if self.config.busy_scaled and rows:
            step = self.perf.step_time([(self.perf.max_num_batched_tokens, 0)], 0, 0)
            busy = sum(1 for r in rows if r[0] > step) / len(rows)
            w *= busy / max(1e-3, 1.0 - busy) if busy < 1 else 1e3
            w = min(w, 4.0 * self.config.waste_weight)
        least = min((r[2] for r in rows), default=0.0)
        g = self.config.decode_weight
        mean_running = max(1.0, sum(r[4].num_running for r in rows) / max(1, len(rows)))
        return [
            (wait + own + w * (work - least) + g * work * e.num_running / mean_running, hit, e)
            for wait, own, work, hit, e in rows
        ]

    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        for e in view.engines:
            if e.kv_capacity_blocks:
                self._capacity[e.id] = e.kv_capacity_blocks
        predictions = self.predict(req, view)
        best = min(p[0] for p in predictions)
        near = [p for p in predictions if p[0] <= best + self.config.tie_s]
        n = len(predictions)
        order = {p[2].id: i for i, p in enumerate(predictions)}
        _cost, hit, chosen = min(
            near,
            key=lambda p: (
                p[2].pending_prefill_tokens + p[2].router_queued_tokens,
                p[2].in_flight,
                (order[p[2].id] - self._turn) % n,
            ),
        )
        return Decision(
            engine=chosen.id,
            expected_hit_tokens=hit,
            reason="predicted_ttft:hit" if hit else "predicted_ttft:miss",
        )

    # -- hooks -------------------------------------------------------------------
    def _index_blocks(self, engine: EngineId) -> int:
        return self.config.index_blocks or self._capacity.get(engine) or _DEFAULT_INDEX_BLOCKS

    def on_routed(self, req: RequestInfo, decision: Decision, now: float) -> None:
        self._turn += 1
        self.index.insert(decision.engine, req.block_hashes, self._index_blocks(decision.engine))

    def on_cache_event(
        self, engine: EngineId, stored: Sequence[int], removed: Sequence[int]
    ) -> None:
        if stored:
            self.index.insert(engine, stored, self._index_blocks(engine))
        if removed:
            self.index.remove(engine, removed)

    def on_cache_reset(self, engine: EngineId) -> None:
        self.index.remove_engine(engine)

    def on_engine_removed(self, engine: EngineId) -> None:
        self.index.remove_engine(engine)
        self._capacity.pop(engine, None)
