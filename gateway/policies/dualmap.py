"""DualMap: two hash candidates per request, SLO-aware choice, router queues, rebalancing.

Algorithm (DualMap, arXiv 2602.06502, ICLR 2026; ``../shared/docs/algorithms.md`` §2):

1. **Key.** The first ``d`` key units of the prompt, a unit being
   ``key_tokens`` tokens (512, as the paper counts its hash key; a whole number
   of the engine's blocks), ``d`` adaptive per prefix
   (:class:`~gateway.policies.prefix_hotness.PrefixHotness`): hot prefixes
   (traffic share > 2/n over the last ``window`` requests) are keyed one unit
   deeper so they spread, and cool back under 1/n. A unit that ``shared_share``
   (0.5) of all traffic uses — a system prompt in front of every request — is
   never the final key, from the first request on, so shared prompts never
   pin all traffic on two engines while the window warms up. Prompts shorter
   than one unit key on their last full block. ``adaptive=false`` keys on a
   fixed ``fixed_depth`` units.
2. **Two candidates** from two consistent-hash rings with independent seeds
   (:class:`~gateway.policies.hash_ring.HashRing`, ``vnodes`` points per engine);
   when both give the same engine, the second ring's next distinct engine.
   Unhealthy engines are skipped clockwise, so a flapping engine moves only
   its own keys.
3. **SLO-aware choice.** Each candidate's TTFT estimate is the router-queued
   and engine-pending prefill tokens plus this request's uncached tokens there,
   priced by the engine model with the engine's running decodes
   (:mod:`~gateway.policies.ttft_estimate`). Prefer the longer cache hit
   (estimated from a per-engine LRU of routed prompts, as large as the
   engine's KV; corrected by KV events when the driver delivers them) unless
   its estimate breaches the request's TTFT SLO; then the lower estimate.
   Equal hits: the lower estimate, then lower KV usage, then a coin derived
   from the key (the same on every replica).
   ``slo_aware=false`` is affinity only.
4. **Router queues.** With ``queueing``, a request is held in its engine's
   router queue while that engine has ``dispatch_pending_tokens`` or more
   prefill tokens pending (default 0: 8,192 and at least two of its steps'
   token budget), or others already wait; the driver releases held requests
   as engines make progress, longest cache hit first, then FIFO.
5. **Hotspot rebalancing.** An engine is overloaded when its queue's estimated
   TTFT breaches the SLO or its oldest held request waited ``overload_wait_s``.
   Its held requests move to their other candidate when the benefit
   ``TTFT(i) - TTFT(j)`` is positive and ``TTFT(j)`` meets the SLO, largest
   benefit first, until the source queue meets the SLO. No recursion.

State is two rings, the prefix table, and per-engine prompt LRUs: small, and
the candidates of a prompt depend only on the engine list (and on the hot
prefixes this replica has seen), so gateway replicas agree without sharing.

Deviations from the paper, each measured in ``docs/policies.md`` (all have a
knob that restores the paper's rule):

* ``fresh_headroom=0.25``: a key not seen in the window (nothing to keep
  together yet) breaches at a quarter of the SLO, so first-seen prompts balance
  early; a seen key keeps affinity until the SLO itself (``slo_headroom=1``).
  The paper's rule (1.0 for both) lost 20 % of least loaded's capacity on
  long-prompt traffic with little reuse.
* ``overflow=true``: when every candidate's estimate breaches, the request goes
  to the engine with the lowest estimate anywhere, and the engine holding the
  longest part of a prompt joins its candidates when it holds more than both
  (so an overflowed prefix is found again). Two candidates alone cannot
  balance long, heavy-tailed prompts: power of two choices trails least loaded
  there, and so did DualMap without this.
* ``fresh_spread=true``: a prompt no engine holds a block of, keyed on a key
  unseen in the window (nothing cached to reuse, nothing seen to keep together),
  goes to the engine with the lowest estimate anywhere (ties: the fewest in
  flight, then its ring candidates); with two candidates only, unique prompts
  are power of two choices until both breach, which trails least loaded
  (``docs/evaluation.md``, "DualMap on unique prompts"). A prompt sharing any
  cached block (a system prompt, a document, a conversation) keeps the paper's
  two candidates.
* The default hold gate is at least two steps' token budget (``2 x
  max_num_batched_tokens``; ``dispatch_pending_tokens=8192`` restores a
  fixed gate): with the 8,192-token gate on an engine whose step takes 8,192
  tokens (H100 presets), the engine's next step started part
  empty after each release, and DualMap kept 0.88x least loaded's capacity on
  unique prompts (0.884 vs 0.941 SLO attainment at 900 req/s on 8 H100
  engines; 0.934 with the larger gate).
* ``tie_by_estimate=true``: equal hits go to the lower TTFT estimate before
  the lower KV usage (the paper's tie-break): in the gateway KV usage is scraped, so between two
  scrapes every request whose candidates tie on it went to the same engine of
  the pair; live on unique prompts (4 emulated engines at 70 % load) DualMap's
  TTFT p50/p99 was 210 / 1,288 ms, with this rule 71 / 423 ms (round robin
  68 / 262 ms).
* The TTFT estimate includes the decode batch's slowdown of prefill steps
  (the paper prices tokens at the bare prefill rate, which is optimistic on
  a busy engine).
* ``tpot_aware=true``: a candidate also breaches when the request's predicted
  time per output token there misses its TPOT target: the batch one larger,
  attending to the context of the requests in flight there, with a share of
  the steps (the prefill duty cycle of the work this router sent there over
  ``duty_window_s``, 10 s) carrying a prefill chunk. The paper's SLO is TTFT
  alone; on agent traffic (hot multi-thousand-token tool prompts), affinity
  piled prefill on engines whose decodes then missed TPOT: 13 % of requests
  at 6.3 req/s on 8 A6000 engines, against 0.9 % with this check.
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
from gateway.policies.inflight import InFlightContext, RoutedWork, routed_tpot_s
from gateway.policies.prefix_hotness import PrefixHotness
from gateway.policies.prefix_index import PrefixIndex
from gateway.policies.router_queues import QueuedRequest, RouterQueues
from gateway.policies.ttft_estimate import step_rate, ttft_s

_FALLBACK_PERF = PerfModel(name="dualmap-default", prefill_a=4.21, prefill_b=0.1084)
_DEFAULT_LRU_BLOCKS = 31_250
_DISPATCH_TOKENS = 8192  # the hold gate's base (dispatch_pending_tokens=0)


@dataclass(frozen=True, slots=True)
class DualMapConfig:
    vnodes: int = 100
    seeds: tuple[int, int] = (0x5EED1, 0x5EED2)
    key_tokens: int = 512
    shared_share: float = 0.5
    adaptive: bool = True
    fixed_depth: int = 1
    window: int = 200
    min_samples: int = 20
    hot_share: float = 0.0
    cold_share: float = 0.0
    slo_aware: bool = True
    slo_headroom: float = 1.0
    fresh_headroom: float = 0.25
    fresh_spread: bool = True
    tie_by_estimate: bool = True
    tpot_aware: bool = True
    duty_window_s: float = 10.0
    overflow: bool = True
    queueing: bool = True
    dispatch_pending_tokens: int = 0
    rebalance: bool = True
    overload_wait_s: float = 60.0
    cache_blocks: int = 0

    def __post_init__(self) -> None:
        if self.vnodes <= 0 or self.fixed_depth <= 0 or self.dispatch_pending_tokens < 0:
            raise ValueError(
                "vnodes and fixed_depth must be positive, dispatch_pending_tokens >= 0 (0: auto)"
            )
        if self.key_tokens <= 0:
            raise ValueError("key_tokens must be positive")
        if not 0.0 <= self.shared_share <= 1.0:
            raise ValueError("shared_share must be within [0, 1] (0 turns the rule off)")
        if self.hot_share < 0 or self.cold_share < 0 or self.cache_blocks < 0:
            raise ValueError("hot_share, cold_share and cache_blocks must be >= 0")


class DualMapPolicy(PolicyBase):
    name: ClassVar[str] = "dualmap"

    def __init__(self, ctx: PolicyContext, config: DualMapConfig | None = None) -> None:
        cfg = self.config = config or DualMapConfig()
        self.may_hold = cfg.queueing
        self.wants_cache_events = ctx.kv_events
        self.flight = InFlightContext()
        self.routed_work = RoutedWork(cfg.duty_window_s)
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
            shared=cfg.shared_share or None,
        )
        self.cache = PrefixIndex(cfg.cache_blocks or 1 << 22)
        self.perf: PerfModel = ctx.perf or _FALLBACK_PERF
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

    def on_cache_event(
        self, engine: EngineId, stored: Sequence[int], removed: Sequence[int]
    ) -> None:
        """KV events: what the engines stored (routed by any replica) and evicted."""
        if stored:
            cap = self.config.cache_blocks or self._capacity.get(engine, _DEFAULT_LRU_BLOCKS)
            self.cache.insert(engine, stored, cap)
        if removed:
            self.cache.remove(engine, removed)

    def on_cache_reset(self, engine: EngineId) -> None:
        self.cache.remove_engine(engine)

    def on_engine_removed(self, engine: EngineId) -> None:
        for ring in self.rings:
            ring.remove(engine)
        self._ring_sets = OrderedDict((k, v) for k, v in self._ring_sets.items() if engine not in k)
        self.cache.remove_engine(engine)
        self.flight.remove_engine(engine)
        self.routed_work.remove_engine(engine)

    # -- decision ----------------------------------------------------------------
    def key_units(self, req: RequestInfo) -> tuple[int, ...]:
        """The chained hashes that end each key unit of the prompt; the last unit may be
        partial (it ends at the prompt's last full block), as a Mooncake trace's last
        512-token hash id covers a partial block."""
        hashes = req.block_hashes
        step = max(1, self.config.key_tokens // max(1, req.block_size))
        units = hashes[step - 1 :: step]
        if len(hashes) % step:
            units = (*units, hashes[-1])
        return units

    def _keyed_blocks(self, req: RequestInfo, depth: int) -> int:
        """Blocks of the prompt its key covers (its first ``depth`` key units)."""
        step = max(1, self.config.key_tokens // max(1, req.block_size))
        return max(1, min(depth * step, len(req.block_hashes)))

    def key(self, req: RequestInfo) -> tuple[int, int]:
        """(key, depth in key units) of a request; a prompt without a full block keys on
        its id (depth 0)."""
        hashes = req.block_hashes
        if not hashes:
            return xxhash.xxh3_64_intdigest(req.id.encode()), 0
        units = self.key_units(req)
        if self.config.adaptive:
            depth = self.hotness.depth(units)
        else:
            depth = min(self.config.fixed_depth, len(units))
        return units[depth - 1], depth

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

    def ttft_estimate(self, engine: EngineView, prompt: int, hit: int) -> float:
        """Queued prefill work plus this prompt's uncached part, priced by the engine model
        with the engine's running decodes (:mod:`~gateway.policies.ttft_estimate`)."""
        return ttft_s(self.perf, engine, prompt, hit)

    def _tpot_breach(self, engine: EngineView, req: RequestInfo, now: float) -> bool:
        """``tpot_aware``: would ``req``'s decode on ``engine`` miss its TPOT target? (the
        batch one larger, attending to the context of what runs there, a share of its steps
        carrying the prefill chunks this router has been sending there)"""
        if not self.config.tpot_aware:
            return False
        tpot = routed_tpot_s(
            self.perf, engine, req.prompt_tokens, flight=self.flight, work=self.routed_work, now=now
        )
        return tpot > req.slo.tpot_s

    def _backlog(self, engine: EngineView, queued: int) -> float:
        """Seconds to prefill what ``engine`` has pending plus ``queued`` router-held tokens."""
        rate = step_rate(self.perf, engine)
        return (engine.pending_prefill_tokens + queued) / rate.tokens_per_s

    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        cfg = self.config
        for e in view.engines:  # the engines' KV size bounds our per-engine prompt LRUs
            if e.kv_capacity_blocks:
                self._capacity[e.id] = e.kv_capacity_blocks
        key, depth = self.key(req)
        cands = self.candidates(key, view)
        if not cands:  # healthy engines the rings do not know yet: the least loaded of them
            cands = sorted(view.healthy(), key=lambda e: e.pending_prefill_tokens)[:1]
        ring = list(cands)
        matched = self.cache.match(req.block_hashes)
        cap = max(0, req.prompt_tokens - 1)
        if cfg.overflow and matched and len(cands) == 2:
            # the engine holding this prompt's whole keyed prefix and more of it than both
            # candidates (an earlier overflow put it there) joins them; a prefix shared by
            # all traffic (shorter than the key) never makes an engine a holder
            holder = view.get(max(matched, key=lambda k: matched[k]))
            keyed = self._keyed_blocks(req, depth)
            if (
                holder is not None
                and holder.healthy
                and holder.id not in {c.id for c in cands}
                and matched[holder.id] >= keyed
                and matched[holder.id] > max(matched.get(c.id, 0) for c in cands)
            ):
                cands.append(holder)
        if cfg.fresh_spread and not matched and not self.hotness.count(key):
            return self._spread(req, view, ring, now)
        hits = {e.id: min(matched.get(e.id, 0) * req.block_size, cap) for e in cands}
        est = {e.id: self.ttft_estimate(e, req.prompt_tokens, hits[e.id]) for e in cands}
        if len(cands) == 1:
            chosen, reason = cands[0], "dualmap:single"
        else:
            a, b = cands[0], cands[1]
            if hits[a.id] != hits[b.id]:
                prefer, other = (a, b) if hits[a.id] > hits[b.id] else (b, a)
            elif cfg.tie_by_estimate and est[a.id] != est[b.id]:  # fresh in the gateway
                prefer, other = (a, b) if est[a.id] < est[b.id] else (b, a)
            elif a.kv_usage != b.kv_usage:
                prefer, other = (a, b) if a.kv_usage < b.kv_usage else (b, a)
            else:
                # a coin from the key, not a stateful RNG: every replica flips it alike
                flip = xxhash.xxh3_64_intdigest(key.to_bytes(16, "little", signed=True)) & 1
                prefer, other = (a, b) if flip else (b, a)
            if len(cands) == 3:  # the holder is preferred; the better ring candidate is other
                prefer, other = cands[2], min((a, b), key=lambda e: est[e.id])
            chosen, reason = prefer, "dualmap:affinity"
            # a key seen in the window will be reused: affinity until the SLO itself is at
            # risk; a first-seen key has nothing to keep together: balance earlier
            seen = self.hotness.count(key) > 0
            limit = req.slo.ttft_s * (cfg.slo_headroom if seen else cfg.fresh_headroom)
            breach = {
                e.id: est[e.id] > limit or self._tpot_breach(e, req, now) for e in (prefer, other)
            }
            if (
                cfg.slo_aware
                and breach[prefer.id]
                and (not breach[other.id] or est[other.id] < est[prefer.id])
            ):
                chosen, reason = other, "dualmap:slo"
            if cfg.slo_aware and cfg.overflow and breach[chosen.id]:
                # every candidate breaches: the engine with the lowest estimate anywhere
                spill_est, spill, spill_hit = min(
                    (
                        (self.ttft_estimate(e, req.prompt_tokens, h), e, h)
                        for e in view.healthy()
                        if e.id not in hits
                        for h in (min(matched.get(e.id, 0) * req.block_size, cap),)
                    ),
                    key=lambda t: t[0],
                    default=(float("inf"), None, 0),
                )
                if spill is not None and (
                    spill_est < est[chosen.id]
                    or (spill_est <= limit and not self._tpot_breach(spill, req, now))
                ):
                    chosen, reason = spill, "dualmap:overflow"
                    hits[spill.id] = spill_hit
        hold = cfg.queueing and (
            chosen.router_queued > 0 or chosen.pending_prefill_tokens >= self.dispatch_tokens
        )
        return Decision(
            engine=chosen.id,
            hold=hold,
            expected_hit_tokens=hits[chosen.id],
            reason=reason + (":held" if hold else ""),
            candidates=tuple(e.id for e in ring),
        )

    def _spread(
        self, req: RequestInfo, view: ClusterView, ring: list[EngineView], now: float
    ) -> Decision:
        """``fresh_spread``: nothing cached anywhere and a first-seen key: the engine with the
        lowest TTFT estimate anywhere, preferring one where neither SLO target breaches; ties
        go to the fewest in flight, then to the ring candidates (in ring order)."""
        order = {e.id: i for i, e in enumerate(ring)}

        def rank(e: EngineView) -> tuple[bool, float, int, int]:
            est = self.ttft_estimate(e, req.prompt_tokens, 0)
            breach = est > req.slo.ttft_s or self._tpot_breach(e, req, now)
            return breach, est, e.in_flight + e.router_queued, order.get(e.id, len(order))

        chosen = min(view.healthy(), key=rank)
        hold = self.config.queueing and (
            chosen.router_queued > 0 or chosen.pending_prefill_tokens >= self.dispatch_tokens
        )
        return Decision(
            engine=chosen.id,
            hold=hold,
            reason="dualmap:spread" + (":held" if hold else ""),
            candidates=tuple(e.id for e in ring),
        )

    def _there(self, engine: EngineView, queued: int, extra: int, prompt: int, hit: int) -> float:
        """TTFT estimate of a request on ``engine`` behind ``queued`` + ``extra`` tokens."""
        rate = step_rate(self.perf, engine)
        own = self.perf.prefill_time(prompt - hit, hit) * rate.slowdown
        return (engine.pending_prefill_tokens + queued + extra) / rate.tokens_per_s + own

    # -- hooks -------------------------------------------------------------------
    def on_routed(self, req: RequestInfo, decision: Decision, now: float) -> None:
        cap = self.config.cache_blocks or self._capacity.get(decision.engine, _DEFAULT_LRU_BLOCKS)
        self.cache.insert(decision.engine, req.block_hashes, cap)
        _, depth = self.key(req)
        if self.config.adaptive and depth:
            self.hotness.observe(self.key_units(req), depth)
        self.flight.add(req.id, decision.engine, req.prompt_tokens)
        self.routed_work.add_prefill(
            self.perf, decision.engine, req.prompt_tokens, decision.expected_hit_tokens, now
        )

    def on_finished(self, req: RequestInfo, engine: EngineId, now: float, ok: bool) -> None:
        self.flight.finish(req.id)

    @property
    def dispatch_tokens(self) -> int:
        """Pending prefill tokens from which requests wait in the router queue: the knob when
        set, else 8,192 and at least two of the engine's steps (a smaller gate leaves the next
        step part empty)."""
        if self.config.dispatch_pending_tokens:
            return self.config.dispatch_pending_tokens
        return max(_DISPATCH_TOKENS, 2 * self.perf.max_num_batched_tokens)

    def can_dispatch(self, engine: EngineView, pending_tokens: int, item: QueuedRequest) -> bool:
        return pending_tokens < self.dispatch_tokens

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
            backlog = self._backlog(source, queued)
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
                if self._backlog(source, queued) <= slo and not stale:
                    continue  # the source meets the SLO; only requests waiting too long still go
                here = self._backlog(source, queued)
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
