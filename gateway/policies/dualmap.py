"""DualMap: two hash candidates per request, SLO-aware choice, router queues, rebalancing.

Algorithm (DualMap, arXiv 2602.06502, ICLR 2026; ``../shared/docs/algorithms.md`` §2):

1. **Key.** The first ``d`` blocks of the prompt, ``d`` adaptive per prefix
   (:class:`~gateway.policies.prefix_hotness.PrefixHotness`): hot prefixes are
   keyed one block deeper so they spread. ``adaptive=false`` keys on a fixed
   ``fixed_depth`` blocks.
2. **Two candidates** from two consistent-hash rings with independent seeds
   (:class:`~gateway.policies.hash_ring.HashRing`, ``vnodes`` points per engine);
   when both give the same engine, the second ring's next distinct engine.
   Unhealthy engines are skipped clockwise, so a flapping engine moves only
   its own keys.
3. **SLO-aware choice.** Each candidate's TTFT estimate is (router-queued +
   engine-pending prefill tokens + this request's uncached tokens there) x
   seconds per prefill token (engine model). Prefer the longer cache hit
   (estimated from a per-engine LRU of routed prompts, as large as the
   engine's KV) unless its estimate breaches the request's TTFT SLO; then the
   lower estimate. Equal hits: lower KV usage, then the seeded RNG.
   ``slo_aware=false`` is affinity only.
4. **Router queues.** With ``queueing``, a request is held in its engine's
   router queue while that engine has ``dispatch_pending_tokens`` or more
   prefill tokens pending (or others already wait); the driver releases held
   requests as engines make progress, longest cache hit first, then FIFO.
5. **Hotspot rebalancing.** An engine is overloaded when its queue's estimated
   TTFT breaches the SLO or its oldest held request waited ``overload_wait_s``.
   Its held requests move to their other candidate when the benefit
   ``TTFT(i) - TTFT(j)`` is positive and ``TTFT(j)`` meets the SLO, largest
   benefit first, until the source queue meets the SLO. No recursion.

State is two rings, the prefix table, and per-engine prompt LRUs: small, and
the candidates of a prompt depend only on the engine list (and on the hot
prefixes this replica has seen), so gateway replicas agree without sharing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import xxhash

from gateway.core.types import ClusterView, Decision, EngineId, EngineView, Migration, RequestInfo
from gateway.perfmodel.model import PerfModel
from gateway.policies.base import PolicyBase, PolicyContext
from gateway.policies.hash_ring import HashRing
from gateway.policies.prefix_hotness import PrefixHotness
from gateway.policies.prefix_index import PrefixIndex
from gateway.policies.router_queues import QueuedRequest, RouterQueues

_FALLBACK_SPT = 0.1084 / 1000.0  # seconds per prefill token, Mistral-7B/A6000 (Preble's fit)
_DEFAULT_LRU_BLOCKS = 31_250


@dataclass(frozen=True, slots=True)
class DualMapConfig:
    vnodes: int = 100
    seeds: tuple[int, int] = (0x5EED1, 0x5EED2)
    adaptive: bool = True
    fixed_depth: int = 1
    window: int = 200
    min_samples: int = 20
    hot_share: float = 0.0
    cold_share: float = 0.0
    slo_aware: bool = True
    queueing: bool = True
    dispatch_pending_tokens: int = 8192
    rebalance: bool = True
    overload_wait_s: float = 60.0
    cache_blocks: int = 0

    def __post_init__(self) -> None:
        if self.vnodes <= 0 or self.fixed_depth <= 0 or self.dispatch_pending_tokens <= 0:
            raise ValueError("vnodes, fixed_depth and dispatch_pending_tokens must be positive")
        if self.hot_share < 0 or self.cold_share < 0 or self.cache_blocks < 0:
            raise ValueError("hot_share, cold_share and cache_blocks must be >= 0")


class DualMapPolicy(PolicyBase):
    name: ClassVar[str] = "dualmap"

    def __init__(self, ctx: PolicyContext, config: DualMapConfig | None = None) -> None:
        cfg = self.config = config or DualMapConfig()
        self.may_hold = cfg.queueing
        self.rings = self._new_rings()
        # Rings per engine set: a multi-model gateway shows each model's engines in turn.
        self._ring_sets: OrderedDict[tuple[EngineId, ...], tuple[HashRing, HashRing]] = (
            OrderedDict()
        )
        self.hotness = PrefixHotness(
            window=cfg.window,
            min_samples=cfg.min_samples,
            hot=cfg.hot_share or None,
            cold=cfg.cold_share or None,
        )
        self.cache = PrefixIndex(cfg.cache_blocks or 1 << 22)
        perf: PerfModel | None = ctx.perf
        self.spt = perf.seconds_per_prefill_token() if perf is not None else _FALLBACK_SPT
        self._rng = ctx.rng(self.name)
        self._capacity: dict[EngineId, int] = {}

    # -- membership ------------------------------------------------------------
    def _new_rings(self) -> tuple[HashRing, HashRing]:
        cfg = self.config
        return (
            HashRing(seed=cfg.seeds[0], vnodes=cfg.vnodes),
            HashRing(seed=cfg.seeds[1], vnodes=cfg.vnodes),
        )

    def on_membership(self, engines: Sequence[EngineId]) -> None:
        members = tuple(sorted(engines))
        rings = self._ring_sets.get(members)
        if rings is None:
            rings = self._new_rings()
            for ring in rings:
                ring.set_engines(members)
            self._ring_sets[members] = rings
            while len(self._ring_sets) > 16:
                self._ring_sets.popitem(last=False)
        self._ring_sets.move_to_end(members)
        self.rings = rings
        self.hotness.instances = len(engines)
        # The prompt LRUs stay: a multi-model gateway shows each model's engines in turn;
        # an engine that really left is forgotten in on_engine_removed.

    def on_engine_removed(self, engine: EngineId) -> None:
        for ring in self.rings:
            ring.remove(engine)
        self._ring_sets = OrderedDict((k, v) for k, v in self._ring_sets.items() if engine not in k)
        self.cache.remove_engine(engine)

    # -- decision ----------------------------------------------------------------
    def key(self, req: RequestInfo) -> tuple[int, int]:
        """(key, depth in blocks) of a request; prompts without a full block key on their id."""
        hashes = req.block_hashes
        if not hashes:
            return xxhash.xxh3_64_intdigest(req.id.encode()), 0
        if self.config.adaptive:
            depth = self.hotness.depth(hashes)
        else:
            depth = min(self.config.fixed_depth, len(hashes))
        return hashes[depth - 1], depth

    def candidates(self, key: int, view: ClusterView) -> list[EngineView]:
        """The two candidates of ``key`` among the view's healthy engines (one when only one is
        up). A view may be one pool of a disaggregated cluster: ring engines outside it are
        skipped like engines that are down."""
        usable = {e.id for e in view.engines if e.healthy}
        down = {e for ring in self.rings for e in ring.engines} - usable
        first = self.rings[0].lookup(key, skip=down)
        if first is None:
            return []
        second = self.rings[1].lookup(key, skip=down | {first})
        out = [view.get(first)]
        if second is not None:
            out.append(view.get(second))
        return [e for e in out if e is not None]

    def ttft_estimate(self, engine: EngineView, uncached: int) -> float:
        pending = engine.router_queued_tokens + engine.pending_prefill_tokens + uncached
        return pending * self.spt

    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        cfg = self.config
        for e in view.engines:  # the engines' KV size bounds our per-engine prompt LRUs
            if e.kv_capacity_blocks:
                self._capacity[e.id] = e.kv_capacity_blocks
        key, _ = self.key(req)
        cands = self.candidates(key, view)
        if not cands:  # healthy engines the rings do not know yet: the least loaded of them
            cands = sorted(view.healthy(), key=lambda e: e.pending_prefill_tokens)[:1]
        matched = self.cache.match(req.block_hashes)
        hits = {
            e.id: min(matched.get(e.id, 0) * req.block_size, req.prompt_tokens - 1) for e in cands
        }
        est = {e.id: self.ttft_estimate(e, req.prompt_tokens - hits[e.id]) for e in cands}
        if len(cands) == 1:
            chosen, reason = cands[0], "dualmap:single"
        else:
            a, b = cands
            if hits[a.id] != hits[b.id]:
                prefer, other = (a, b) if hits[a.id] > hits[b.id] else (b, a)
            elif a.kv_usage != b.kv_usage:
                prefer, other = (a, b) if a.kv_usage < b.kv_usage else (b, a)
            else:
                prefer, other = (a, b) if self._rng.random() < 0.5 else (b, a)
            chosen, reason = prefer, "dualmap:affinity"
            if cfg.slo_aware and est[prefer.id] > req.slo.ttft_s and est[other.id] < est[prefer.id]:
                chosen, reason = other, "dualmap:slo"
        hold = cfg.queueing and (
            chosen.router_queued > 0 or chosen.pending_prefill_tokens >= cfg.dispatch_pending_tokens
        )
        return Decision(
            engine=chosen.id,
            hold=hold,
            expected_hit_tokens=hits[chosen.id],
            reason=reason + (":held" if hold else ""),
            candidates=tuple(e.id for e in cands),
        )

    def _there(self, engine: EngineView, queued: int, extra: int, prompt: int, hit: int) -> float:
        """TTFT estimate of a request on ``engine`` behind ``queued`` + ``extra`` tokens."""
        return (engine.pending_prefill_tokens + queued + extra + prompt - hit) * self.spt

    # -- hooks -------------------------------------------------------------------
    def on_routed(self, req: RequestInfo, decision: Decision, now: float) -> None:
        cap = self.config.cache_blocks or self._capacity.get(decision.engine, _DEFAULT_LRU_BLOCKS)
        self.cache.insert(decision.engine, req.block_hashes, cap)
        _, depth = self.key(req)
        if self.config.adaptive and depth:
            self.hotness.observe(req.block_hashes, depth)

    def can_dispatch(self, engine: EngineView, pending_tokens: int, item: QueuedRequest) -> bool:
        return pending_tokens < self.config.dispatch_pending_tokens

    def rebalance(self, queues: RouterQueues, view: ClusterView, now: float) -> list[Migration]:
        cfg = self.config
        if not cfg.rebalance:
            return []
        moves: list[Migration] = []
        extra: dict[EngineId, int] = {}  # tokens this round moves onto each engine
        for source_id in queues.engines():
            source = view.get(source_id)
            if source is None:
                continue
            items = list(queues.items(source_id))
            if not items:
                continue
            queued = queues.tokens(source_id)
            backlog = (source.pending_prefill_tokens + queued) * self.spt
            oldest = queues.oldest(source_id)
            slo = min(q.req.slo.ttft_s for q in items)
            if backlog <= slo and (oldest is None or now - oldest < cfg.overload_wait_s):
                continue
            options: list[tuple[float, QueuedRequest, EngineView, int]] = []
            for item in items:
                other = next((c for c in item.candidates if c != source_id), None)
                target = view.get(other) if other is not None else None
                if target is None or not target.healthy:
                    continue
                hit = min(
                    self.cache.match(item.req.block_hashes).get(target.id, 0) * item.req.block_size,
                    item.req.prompt_tokens - 1,
                )
                benefit = self._there(source, queued, 0, item.req.prompt_tokens, 0) - self._there(
                    target,
                    target.router_queued_tokens,
                    extra.get(target.id, 0),
                    item.req.prompt_tokens,
                    hit,
                )
                if benefit > 0:
                    options.append((benefit, item, target, hit))
            options.sort(key=lambda o: -o[0])
            for _, item, target, hit in options:
                stale = now - item.enqueued >= cfg.overload_wait_s
                if (source.pending_prefill_tokens + queued) * self.spt <= slo and not stale:
                    continue  # the source meets the SLO; only requests waiting too long still go
                here = (source.pending_prefill_tokens + queued) * self.spt
                there = self._there(
                    target,
                    target.router_queued_tokens,
                    extra.get(target.id, 0),
                    item.req.prompt_tokens,
                    hit,
                )
                if here - there <= 0 or there >= item.req.slo.ttft_s:
                    continue  # priced again with what this round already moved there
                moves.append(Migration(item.req.id, source_id, target.id, hit))
                queued -= item.uncached_tokens
                extra[target.id] = extra.get(target.id, 0) + item.req.prompt_tokens - hit
        return moves
