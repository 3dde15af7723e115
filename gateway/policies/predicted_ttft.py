"""Predicted TTFT: price each engine by the request's predicted latency and the work it adds.

Algorithm (kvgate's own; pricing queued prefill against cache hits is shared
with Preble's ``L + P``, Mooncake's conductor and Dynamo's KV cost; the share
cap answers the shared-system-prompt pile-up reported against SMG, llm-d and
Dynamo, ``../shared/docs/anchors.md``):

1. **Cache.** Match the prompt's chained block hashes against a per-engine
   prefix index (:class:`~gateway.policies.prefix_index.PrefixIndex`): the
   blocks of prompts routed to each engine, an LRU as large as the engine's
   KV cache; with KV events (``PolicyContext.kv_events`` or ``precise``) the
   engines' own stored/removed blocks correct it (other replicas' routing).
2. **Predict**, for every healthy engine ``e``, from the shared performance
   model (:mod:`~gateway.policies.ttft_estimate`)::

       ttft(e) = queued(e) / rate(e) + prefill(uncached(e), cached(e)) * slowdown(e)
       tpot(e) = (1 - duty(e)) * decode_step(batch + 1, ctx(e))
                 + duty(e) * mixed_step(chunk, batch + 1, ctx(e))

   ``rate``/``slowdown``: prefill throughput of a step shared with the running
   decodes. ``ctx(e)`` is the context those decodes attend to: the running
   count times the mean prompt this router has in flight there, at least the
   KV in use (:class:`~gateway.policies.inflight.InFlightContext`: KV usage
   counts a shared prefix once, attention reads it once per sequence).
   ``duty(e)`` is the engine's recent prefill duty cycle: prefill seconds
   routed there, decayed over ``duty_window_s`` (chunked prefill shares the
   decode steps, :class:`~gateway.policies.inflight.RoutedWork`); with KV
   events, the prefill of the blocks the engine announced instead, which
   every gateway replica sees alike. Over 10 s one prefill moved an engine's
   duty cycle enough to flip its TPOT prediction across the target, and
   questions on 8 H100 engines (``gen:long_doc_qa?docs=100``) swung between
   holders: attainment 0.970 / 0.899 / 0.890 / 0.899 at 300 / 350 / 400 /
   450 req/s (weighted_scorer 0.969 / 0.961 / 0.944 / 0.945); over 30 s
   0.968 / 0.966 / 0.942 / 0.940, and capacity over 8 draws of each suite
   shape at or above the 10 s window's but on A6000 chat (1.17 -> 1.13 of
   the best baseline) and agent (1.06 -> 1.04); H100 chat 1.12 -> 1.45
   (``benchmarks.quality.samples``, ``docs/evaluation.md``).
   ``kv_admission``: where the KV in use,
   the queued prefill and the request's own blocks exceed the engine's KV
   capacity, the request also waits about half a predicted output of decode
   steps for running sequences to free room
   (:func:`~gateway.policies.ttft_estimate.admission_wait_s`). Without it, on
   8 A6000 engines with long conversations (``gen:conversation?n=1500&think=600``,
   KV 90-100 % full) 7-16k-token prompts went to engines predicted at 2-5 s
   whose full caches held them 20-27 s, and TTFT p99 was above least_loaded's.
3. **Aging** (``wait_bound``): only engines whose predicted TTFT is within
   the request's TTFT target, or within ``wait_bound`` x its cold prefill
   time (at most ``wait_cap`` x the target) of the least-wait engine's, are
   candidates; so a request's wait beyond the best engine's is bounded by its
   size. Prompts whose cold prefill alone exceeds the target miss it anywhere,
   and every second they are steered is tail: without the cap, the Mooncake
   trace on 8 A6000 engines at its own rate (2,000 requests) had TTFT p99 8.9
   s against least_loaded's 7.6 (7.3 with it), for A6000 chat 1.20 -> 1.15 and
   chat_burst 1.16 -> 1.10 of the best baseline over 8 draws. The prices below (work, share,
   eviction) are all seconds of other requests' time and grow with the
   prompt: on an overloaded pool (8 A6000 engines, bursty ``gen:chat`` at 5.0
   req/s, past capacity) they sent 31 % of the requests to engines predicted 6.6 s slower
   on average (share penalty -10.4 s, work price -7.6 s, eviction -4.4 s),
   so the long prompts waited behind deep queues (``docs/evaluation.md``).
   **Feasible** engines among them meet the request's TTFT target and
   ``tpot_headroom`` x its TPOT target; **safe** ones meet ``ttft_margin`` x
   the TTFT target too. The cheapest safe engine wins, else the cheapest
   feasible one, else the cheapest candidate. TPOT is judged on the 90th
   percentile of the request's own mean TPOT over its predicted output, the
   mixed steps among its decode steps Poisson (``tpot_quantile``; 0: the
   steps' reading below). The margin keeps the cost from trading a queue
   that nearly spends the TTFT target (the prediction's error then misses
   it) for seconds of predicted decode. Read as the share of *steps*
   carrying a prefill chunk (pessimistic: a mixed step lasts 10-24 decode
   steps), on 8 x ``llama3-70b-tp2-h100`` the duty cycle predicted 0.10-0.15
   s per token after ~10 % of prefill where decodes took 0.03-0.05 s, and
   agent traffic crowded onto the few "feasible" engines behind their
   queues: 0.79 of the best baseline over 8 draws, lowest 0.49; the quantile
   alone 0.82 / 0.58, a 0.6 margin alone 0.80 / 0.49, both 0.96 / 0.76 (A6000
   chat_burst 1.21 -> 1.16, ``docs/evaluation.md``).
   ``tpot_after_prefill``: where decodes run, the TPOT judged is the one they
   get once the prefill this choice adds beyond the least any engine needs (a
   miss where another engine holds the prefix) joins their steps, its seconds
   added to the duty cycle; the prefill every engine would need changes
   nothing. Judged without it, on 8 A6000 engines with
   ``gen:long_doc_qa?docs=100`` at 22 req/s every engine sat near the 0.1 s
   target, the holder of a document just above it, and 228 of 2,000 questions
   went to an engine just below it and prefilled the document again there
   (hit 0.83, weighted_scorer 0.94), each one raising that engine's duty cycle;
   with it 60 left the holder (49 for a lower cost, mostly an idle engine),
   hit 0.92, SLO attainment 0.895 -> 0.902 (``benchmarks.quality.reprefill``).
4. **Cost** = ``ttft + out * tpot`` (``decode_in_cost``; ``out`` the request's
   predicted output, or learnt per prefix by an
   :class:`~gateway.policies.output_predictor.OutputPredictor`; ``tpot`` read by
   steps too; the mean reading here cost A6000 chat_burst 1.21 -> 1.16 of the best
   baseline over 8 draws, A6000 Mooncake 1.07 -> 1.00. ``decode_cap`` (off)
   counts it at most at the TPOT target: on the 70B pool 180 tokens x a 0.05 s
   gap in predicted TPOT outweighed 4 s of queue; with the mean filter, agent
   capacity there 0.97 of the best baseline (lowest 0.86), the suite's shapes
   within 0.04 but A6000 Mooncake's lowest draw 0.99 -> 0.88, and the 8 x A6000
   ``gen:chat_burst?n=1500&seed=0`` TTFT p99 10.6 -> 11.1 s, above
   least_loaded's 10.8. Both are the remedy measured for such pools)
   ``+ lambda * prefill(e)`` with ``lambda = work_weight * u / (1 - u)``:
   on a cluster whose engines have prefill queued (``u``: share of them, an
   EWMA over ``busy_window`` decisions, capped at ``max_utilisation``), the
   prefill a miss adds delays the requests behind it by about ``W u/(1-u)``,
   so a busy cluster keeps affinity and an idle one spreads
   ``+ decode_weight * u * prefill(e) * running(e) / mean running``: the prefill
   a request adds is mixed into the steps of the decodes running there, so an
   engine with a big batch pays more for it; the request's own TPOT does not
   see the decodes it slows (Mooncake on 8 H100 engines at 17.2 req/s: SLO
   attainment 0.880 -> 0.906, TPOT-only misses 11.8 -> 9.2 %; weighted_scorer
   0.915)
   ``+ harm_weight * prefill(e) * slowdown(e) * running(e) * min(1, rise / headroom)``:
   each decode running there waits out the prefill's chunks (its steps carry them),
   seconds of other requests' time; they count in proportion to the TPOT headroom
   they use: ``rise = prefill * slowdown / out`` spread over an output like this
   request's, ``headroom = tpot_headroom x TPOT target - tpot(e)``; where none is
   left, ``harm_past_target`` of it (those decodes already miss; counted in full, an
   8 x A6000 chat_burst at 3.2 req/s had TTFT p99 12.0 s against least_loaded's
   10.8 s, 10.6 s at one half). A cold document's prefill then goes where few decodes near
   their target run, and a short prompt beside a big batch costs almost nothing
   (over 8 draws of each suite shape: A6000 long_doc_qa 0.92 -> 0.94 of the best
   baseline, chat 1.13 -> 1.22, chat_burst 1.09 -> 1.21, H100 chat 1.45 -> 1.61;
   without the headroom share, H100 chat fell to 0.80, ``docs/evaluation.md``)
   ``+ evict_weight * reuse * (1 + lambda) * prefill(evicted(e))``: the cached
   blocks the request's uncached ones push out of a full engine (as the index
   sees it) will be prefilled again when their prompts come back; ``reuse`` is
   the share of prompt tokens found cached somewhere (EWMA over
   ``reuse_window`` decisions), so traffic without reuse pays nothing. Small
   caches holding a few hot prompts otherwise thrash: each idle-engine miss
   made a new copy and evicted another prompt (hit 0.72 vs Preble's 0.90 on
   the live benchmark's shape in the simulator)
   ``+ share_weight * prefill(whole prompt) * max(0, share(e) * N - 1 - share_slack)``:
   an engine whose recent share of requests (EWMA over ``share_window`` x N
   decisions, started at 0) exceeds its fair share by more than the slack
   costs about one cold prefill per excess share, so a prefix that all
   traffic shares spreads over the engines even when the views lag. It is
   charged only where the engine holds more of a *widely shared* prefix (the
   leading blocks that more than a fair share + slack of the last
   ``share_window`` x N prompts began with, :mod:`.prefix_traffic`) than the
   engine holding least of it: a system prompt cached on few engines, not a
   conversation's own history nor a miss (``share_prefix_only``). Charged on
   every engine, it sent conversations off their history's holder (A6000
   Mooncake trace on 8 engines at 1,500 requests, TTFT p99 7.07 -> 6.97 s
   (least_loaded 7.01), H100 mooncake 0.96 -> 0.98 of weighted_scorer over 8
   windows, ``docs/evaluation.md``).
5. **Pick** the cheapest; costs within ``tie_s`` go to the least queued
   engine, then the fewest in flight, then in turn (the turn advances once per
   request: in a disaggregated pool both of its legs are routed, and a turn moved
   twice sent every tied request of two-engine pools to the same engines).

Memory: the index holds at most ``2**22`` blocks (each engine's part at most
its KV capacity, ``index_blocks`` to override); the in-flight context at most
``2**20`` requests; the prefix traffic the last ``share_window`` x N prompts' first 256
block hashes; the rest is one small record per engine.

Knobs (defaults): ``work_weight=4``, ``decode_weight=1``, ``harm_weight=1``,
``harm_past_target=0.5``, ``evict_weight=3``, ``reuse_window=256``, ``decode_aware=true``,
``decode_in_cost=true``, ``tpot_headroom=1``, ``duty_window_s=30``, ``share_slack=0.2``,
``share_weight=10``, ``share_window=32``, ``share_prefix_only=true``, ``max_utilisation=0.9``,
``busy_window=32``, ``tie_s=0.005``, ``index_blocks=0``, ``precise=false``,
``wait_bound=1`` (0: no aging), ``wait_cap=0.3``, ``kv_admission=true``,
``tpot_after_prefill=true``, ``tpot_mean_filter=false``, ``tpot_quantile=0.9``,
``ttft_margin=0.5``, ``decode_cap=false``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import ClassVar

from gateway.core.types import ClusterView, Decision, EngineId, EngineView, RequestInfo
from gateway.perfmodel.model import PerfModel
from gateway.policies.base import PolicyBase, PolicyContext
from gateway.policies.inflight import InFlightContext, RoutedWork
from gateway.policies.output_predictor import OutputPredictor
from gateway.policies.predicted_ttft_config import (
    Candidates,
    PredictedTtftConfig,
    Prediction,
    Prices,
)
from gateway.policies.prefix_index import PrefixIndex
from gateway.policies.prefix_traffic import PrefixTraffic
from gateway.policies.ttft_estimate import (
    admission_wait_s,
    queued_tokens,
    step_rate,
    tpot_quantile_s,
    tpot_s,
    wait_s,
)

__all__ = ["Candidates", "PredictedTtftConfig", "PredictedTtftPolicy", "Prediction", "Prices"]

_FALLBACK_PERF = PerfModel(name="predicted-ttft-default", prefill_a=4.21, prefill_b=0.1084)
_DEFAULT_INDEX_BLOCKS = 31_250  # ~500k tokens of 16 when an engine reports no KV size
_MAX_INDEX_BLOCKS = 1 << 22


class PredictedTtftPolicy(PolicyBase):
    name: ClassVar[str] = "predicted_ttft"

    def __init__(self, ctx: PolicyContext, config: PredictedTtftConfig | None = None) -> None:
        self.config = config or PredictedTtftConfig()
        self.perf = ctx.perf or _FALLBACK_PERF
        self.wants_cache_events = self.config.precise or ctx.kv_events
        self.index = PrefixIndex(_MAX_INDEX_BLOCKS)
        self._capacity: dict[EngineId, int] = {}
        self._turn = 0
        self._last: tuple[str, float] = ("", -1.0)  # (id, arrival) of the last request routed
        # Each engine's recent share of requests, an EWMA over share_window x N decisions
        # started at 0 (not bias-corrected: a single early request must not look like 100 %)
        self._share: dict[EngineId, float] = {}
        self.traffic = PrefixTraffic(self.config.share_window)
        self.outputs = OutputPredictor(default=128.0)
        self.routed_work = RoutedWork(self.config.duty_window_s)
        self._block_size = ctx.block_size
        self._reads = self.config.tpot_mean_filter or self.config.tpot_quantile > 0
        self._clock = 0.0  # the latest time a decision or routing was made at
        self.flight = InFlightContext()
        self._engines = 1
        self._busy = 0.0
        self._observed = 0.0  # this decision's busy share, folded into _busy when routed
        self._reuse = 0.0  # share of prompt tokens cached somewhere, an EWMA over decisions
        self._reuse_seen = 0.0  # this decision's, folded in when routed

    # -- prediction ---------------------------------------------------------------
    def _duty(self, engine: EngineView, now: float) -> float:
        """``engine``'s recent prefill duty cycle; 0 while it is idle (nothing running, queued
        or in flight): the prefill it did is over, and a request sent to an idle engine
        decodes alone until others follow it (sequential clients keep their hits)."""
        if not (engine.num_running or engine.in_flight or queued_tokens(engine)):
            return 0.0
        return self.routed_work.duty(engine.id, now)

    def predict(self, req: RequestInfo, view: ClusterView, now: float = 0.0) -> list[Prediction]:
        """Every healthy engine's predicted TTFT, prefill work and cost for ``req``."""
        cfg = self.config
        matched = self.index.match(req.block_hashes)
        cap = max(0, req.prompt_tokens - 1)
        shared = self._shared_depth(req, len(view.healthy()))
        rows: list[Prediction] = []
        decoding: list[tuple[float, int, float]] = []  # each row's duty, context, slowdown
        out = self.predicted_output(req)
        for e in view.healthy():
            hit = min(matched.get(e.id, 0) * req.block_size, cap)
            ctx = self.flight.attended(self.perf, e, req.prompt_tokens)
            rate = step_rate(self.perf, e, ctx)
            wait = wait_s(self.perf, e, rate)
            if cfg.kv_admission:
                wait += admission_wait_s(self.perf, e, req.prompt_tokens - hit, out)
            work = self.perf.prefill_time(req.prompt_tokens - hit, hit)
            tpot = judged = duty = 0.0
            if cfg.decode_aware:
                duty = self._duty(e, now)
                tpot = tpot_s(self.perf, e, req.prompt_tokens, duty=duty, ctx_tokens=ctx)
                judged = self._judged_tpot(e, req, duty, ctx, out) if self._reads else tpot
            rows.append(
                Prediction(
                    e,
                    wait + work * rate.slowdown,
                    work,
                    hit,
                    tpot,
                    0.0,
                    judged,
                    rate.slowdown,
                    min(matched.get(e.id, 0), shared),
                )
            )
            decoding.append((duty, ctx, rate.slowdown))
        if not rows:
            return rows
        if cfg.decode_aware and cfg.tpot_after_prefill:
            # the prefill this choice adds beyond the least any engine needs (a hit elsewhere)
            least = min(p.work_s for p in rows)
            for i, (p, (duty, ctx, slowdown)) in enumerate(zip(rows, decoding, strict=True)):
                if p.engine.num_running and p.work_s > least:
                    added = (p.work_s - least) * slowdown / cfg.duty_window_s
                    after = self._judged_tpot(p.engine, req, duty + added, ctx, out)
                    rows[i] = replace(p, tpot_after_s=after)
        # how busy the cluster is: the share of engines with prefill queued, smoothed over
        # decisions; extra work W on a busy cluster delays later requests by ~W u / (1 - u)
        self._observed = sum(1 for p in rows if queued_tokens(p.engine) > 0) / len(rows)
        self._reuse_seen = max(p.hit_tokens for p in rows) / max(1, req.prompt_tokens)
        prices = self.prices(req, rows, out)
        return [replace(p, cost=sum(self.cost_terms(p, req, prices).values())) for p in rows]

    def predicted_output(self, req: RequestInfo) -> float:
        """The request's predicted output tokens: its own hint, else learnt per prefix."""
        return float(req.predicted_output_tokens or self.outputs.predict(req))

    def _judged_tpot(
        self, e: EngineView, req: RequestInfo, duty: float, ctx: int, out: float
    ) -> float:
        """The TPOT ``e``'s feasibility is judged on, at prefill duty cycle ``duty``."""
        q, n = self.config.tpot_quantile, req.prompt_tokens
        if q > 0:
            return tpot_quantile_s(
                self.perf, e, n, duty=duty, output_tokens=out, quantile=q, ctx_tokens=ctx
            )
        return tpot_s(self.perf, e, n, duty=duty, ctx_tokens=ctx, mean=self.config.tpot_mean_filter)

    def prices(self, req: RequestInfo, rows: Sequence[Prediction], out: float) -> Prices:
        """This decision's factors of the cost, from the smoothed cluster state."""
        cfg = self.config
        u = min(cfg.max_utilisation, self._busy)
        lam = cfg.work_weight * u / (1.0 - u)
        return Prices(
            out=out,
            u=u,
            work=lam,
            evict=cfg.evict_weight * self._reuse * (1.0 + lam),
            mean_running=max(1.0, sum(p.engine.num_running for p in rows) / len(rows)),
            full_s=self.perf.prefill_time(req.prompt_tokens, 0),
            fair=1.0 / len(rows),
            tpot_limit=req.slo.tpot_s * cfg.tpot_headroom,
            shared_floor=min(p.shared_blocks for p in rows),
        )

    def cost_terms(self, p: Prediction, req: RequestInfo, prices: Prices) -> dict[str, float]:
        """``p``'s cost, term by term (seconds); the cost is their sum."""
        cfg = self.config
        running = p.engine.num_running
        tpot = min(p.tpot_s, prices.tpot_limit) if cfg.decode_cap else p.tpot_s
        return {
            "ttft": p.ttft_s,
            "decode (out x tpot)": prices.out * tpot if cfg.decode_in_cost else 0.0,
            "work price": prices.work * p.work_s,
            "eviction price": prices.evict * self._evicted_s(p.engine.id, req, p.hit_tokens),
            "decode-batch price": cfg.decode_weight
            * prices.u
            * p.work_s
            * running
            / prices.mean_running,
            "decode harm": cfg.harm_weight * self._harm_s(p, prices) if running else 0.0,
            "share penalty": cfg.share_weight
            * prices.full_s
            * self._excess_share(p.engine.id, prices.fair)
            if not cfg.share_prefix_only or p.shared_blocks > prices.shared_floor
            else 0.0,
        }

    def _shared_depth(self, req: RequestInfo, engines: int) -> int:
        """Leading blocks of ``req``'s prompt that more than a fair share (+ slack) of recent
        requests began with (0, unused, when the penalty is not scoped to them)."""
        if not self.config.share_prefix_only:
            return 0
        fair = (1.0 + self.config.share_slack) / max(1, engines)
        return self.traffic.shared_depth(req.block_hashes, fair)

    def _harm_s(self, p: Prediction, prices: Prices) -> float:
        """Seconds the decodes running on ``p``'s engine wait out its prefill, counted in
        proportion to the TPOT headroom that uses (``harm_past_target`` when none is left)."""
        delay = p.work_s * p.slowdown
        headroom = prices.tpot_limit - p.tpot_s
        rise = delay / max(1.0, prices.out)
        share = self.config.harm_past_target if headroom <= 0.0 else min(1.0, rise / headroom)
        return delay * p.engine.num_running * share

    def _evicted_s(self, engine: EngineId, req: RequestInfo, hit: int) -> float:
        """Prefill seconds of the cached blocks a miss on ``engine`` would evict: what its
        uncached blocks take beyond the engine's KV capacity (as the index sees it)."""
        new = len(req.block_hashes) - hit // max(1, req.block_size)
        over = self.index.size(engine) + new - self._index_blocks(engine)
        return self.perf.prefill_time(over * req.block_size, 0) if over > 0 else 0.0

    def _excess_share(self, engine: EngineId, fair: float) -> float:
        """How far ``engine``'s recent share of requests is above its fair share (+ slack)."""
        share = self._share.get(engine, 0.0)
        return max(0.0, share / fair - 1.0 - self.config.share_slack)

    def candidates(self, req: RequestInfo, rows: Sequence[Prediction]) -> Candidates:
        """Step 3's sets of ``rows`` (``predict``'s, at least one): within the aging bound,
        feasible among those, safe among those."""
        cfg = self.config
        slo = req.slo.ttft_s
        pool = list(rows)
        if cfg.wait_bound > 0:  # aging: its wait bounded by its size, beyond the target
            floor = min(p.ttft_s for p in rows)
            slack = cfg.wait_bound * self.perf.prefill_time(req.prompt_tokens, 0)
            if cfg.wait_cap > 0:
                slack = min(slack, cfg.wait_cap * slo)
            limit = max(slo, floor + slack + cfg.tie_s)
            pool = [p for p in rows if p.ttft_s <= limit]
        tpot_limit = req.slo.tpot_s * cfg.tpot_headroom
        ok = [p for p in pool if p.ttft_s <= slo and p.tpot_after_s <= tpot_limit]
        safe = [p for p in ok if p.ttft_s <= slo * cfg.ttft_margin]
        return Candidates(pool, ok, safe)

    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        for e in view.engines:
            if e.kv_capacity_blocks:
                self._capacity[e.id] = e.kv_capacity_blocks
        self._clock = max(self._clock, now)
        rows = self.predict(req, view, now)
        self._engines = len(rows)
        sets = self.candidates(req, rows)
        feasible = sets.safe or sets.ok or sets.pool
        best = min(p.cost for p in feasible)
        near = [p for p in feasible if p.cost <= best + self.config.tie_s]
        order = {p.engine.id: i for i, p in enumerate(rows)}
        n = len(rows)
        pick = min(
            near,
            key=lambda p: (
                queued_tokens(p.engine),
                p.engine.in_flight,
                (order[p.engine.id] - self._turn) % n,
            ),
        )
        return Decision(
            engine=pick.engine.id,
            expected_hit_tokens=pick.hit_tokens,
            reason="predicted_ttft:hit" if pick.hit_tokens else "predicted_ttft:miss",
        )

    # -- hooks -------------------------------------------------------------------
    def _index_blocks(self, engine: EngineId) -> int:
        return self.config.index_blocks or self._capacity.get(engine) or _DEFAULT_INDEX_BLOCKS

    def on_routed(self, req: RequestInfo, decision: Decision, now: float) -> None:
        if (req.id, req.arrival) != self._last:  # once per request, not per leg
            self._turn += 1
            self._last = (req.id, req.arrival)
            if self.config.share_prefix_only:  # the count only scopes the share penalty
                self.traffic.resize(self.config.share_window * max(1, self._engines))
                self.traffic.observe(req.block_hashes)
        self._busy += (self._observed - self._busy) / self.config.busy_window
        self._reuse += (self._reuse_seen - self._reuse) / self.config.reuse_window
        if not self.wants_cache_events:  # with KV events the engines' stored blocks count
            self.routed_work.add_prefill(
                self.perf, decision.engine, req.prompt_tokens, decision.expected_hit_tokens, now
            )
        self.flight.add(req.id, decision.engine, req.prompt_tokens)
        n = max(1, self._engines)
        alpha = 1.0 / (self.config.share_window * n)
        for e in self._share:
            self._share[e] *= 1.0 - alpha
        self._share[decision.engine] = self._share.get(decision.engine, 0.0) + alpha
        self.index.insert(decision.engine, req.block_hashes, self._index_blocks(decision.engine))

    def on_finished(self, req: RequestInfo, engine: EngineId, now: float, ok: bool) -> None:
        self.flight.finish(req.id)
        if ok and req.output_tokens:
            self.outputs.observe(req, req.output_tokens)

    def on_cache_event(
        self, engine: EngineId, stored: Sequence[int], removed: Sequence[int]
    ) -> None:
        if stored:
            self.index.insert(engine, stored, self._index_blocks(engine))
            # what every replica sees: the engine prefilled these blocks, whoever routed them
            tokens = len(stored) * self._block_size
            self.routed_work.add(engine, self.perf.prefill_time(tokens, 0), self._clock)
        if removed:
            self.index.remove(engine, removed)

    def on_cache_reset(self, engine: EngineId) -> None:
        self.index.remove_engine(engine)

    def on_engine_removed(self, engine: EngineId) -> None:
        self.index.remove_engine(engine)
        self._capacity.pop(engine, None)
        self._share.pop(engine, None)
        self.routed_work.remove_engine(engine)
        self.flight.remove_engine(engine)
