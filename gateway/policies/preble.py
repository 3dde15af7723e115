"""Preble: E2 (exploit/explore) global scheduling over a radix tree.

Algorithm (Preble, arXiv 2407.00023, ICLR 2025; ``../shared/docs/algorithms.md`` §1):

1. Match the prompt in the global radix tree. **Exploit** when the longest
   cached match covers more tokens than it leaves uncached: route to the
   engines holding that match, the one with the least window load.
2. Otherwise **explore**: argmin over engines of ``L + M + P`` where
   ``L`` = window load (prefill time of each routed request's uncached part +
   its predicted output x the engine's TPOT, over the last ``window_s``),
   ``M`` = eviction cost (simulated LRU eviction of the space this request
   needs; each evicted node costs its prefill time x the share of window
   requests that used it), ``P`` = prefill time of this request's part not
   cached on the engine. Times come from the engine performance model.
3. **P/D balancing** (explore only, off by default; the paper leaves the rule
   loose, this is ours): among engines whose explore cost is within ``pd_margin`` of the
   best, send this prefill-heavy request to the one whose window load is most
   decode-heavy, so prefill and decode work mix on every engine.
4. **Post-assignment rebalancing**: once ``rebalance_warmup`` x engines
   requests were routed, if the chosen engine's load >= ``th_bal`` x the least
   loaded engine's (and exceeds it by ``rebalance_min_gap_s``), send the
   request to the least loaded engine instead.
5. **Hot-prefix replication**: when the mean TTFT of requests through a shared
   node in the second half of the window is >= ``replicate_ratio`` x the
   first half, that prefix is marked on the least loaded engine too, so
   exploit spreads its traffic over both.

The tree learns placements when requests are routed, and forgets them from the
engines' eviction events (``on_cache_event``: simulator, vLLM KV events); the
blocks engines announce as stored also count as cached (``announced``), so a
gateway replica sees what the others routed. For engines that send no events,
evictions are modelled: an engine's cached blocks never exceed its KV capacity
(LRU). Each mechanism has an on/off knob.

Deviations from the paper (measured in ``docs/policies.md``; knobs restore it):

* **Load informed by the queue** (``queue_aware=true``): an engine's load is its
  window work scaled to the next ``load_horizon_s`` (1 s; the window's 180 s
  restores the paper) plus the time to prefill what it has queued now. The
  3-minute sum alone cannot see a burst and, on traffic where every request
  shares a system prompt, sent work to engines already seconds behind. With
  10 s of window work the past still outweighed the queue (SLO attainment
  at one rate near capacity, 10 s -> 2 s: H100 chat 0.937 -> 0.963, agent
  0.890 -> 0.927, Mooncake 0.895 -> 0.933; A6000 zipf_hotspot 0.946 -> 0.996,
  multi_turn 0.973 -> 1.000, Mooncake 0.891 -> 0.901, agent 0.932 -> 0.920),
  and with 2 s on fast engines: capacity / least_loaded over 8 draws of each
  suite shape (``benchmarks.quality.samples``), 2 s -> 1 s: H100 Mooncake
  windows 0.91 -> 0.98, H100 chat 1.01 -> 1.23; A6000 chat 1.11 -> 1.07,
  chat_burst 1.06 -> 1.01, agent 1.18 -> 1.14, Mooncake 1.00 -> 0.99,
  long_doc_qa 1.61 -> 1.62.
* **P/D balancing off** (``pd_balance=false``): sending prefill-heavy requests
  to decode-heavy engines stretches those decodes (chunked prefill shares the
  step), which cost up to 7 points of SLO attainment on long-prompt traffic.
* **This request's decode in the load**: each engine's load adds the
  request's predicted output tokens times its predicted TPOT there (the
  batch one larger, attending to the context in flight there), so a hot
  prefix stops piling onto engines whose decode batches are already slow.
* **TPOT-aware explore** (``tpot_aware=true``): explore considers only the
  engines where this request's predicted time per output token meets its
  target (the batch one larger, the context in flight there, the prefill duty
  cycle routed there over ``duty_window_s``, 10 s), all of them when none
  does. The paper prices decode only through the window load; on the
  Mooncake trace on 8 A6000 engines (little reuse, long prompts) explore put
  requests on engines about to run long prefills: SLO attainment 0.873 against
  least loaded's 0.907 at 2.9 req/s, 0.911 with the filter. Applied to
  exploit as well it cost more than it saved (0.861).
* **Rebalancing from the first request** (``rebalance_warmup=0``; the paper waits
  for 50 x engines requests, kvgate's default was that, then 5 x engines): with the
  queue in the load the warm-up guards against nothing, and on traffic where every
  prompt shares a long prefix it sent the first requests to the one holder while its
  queue grew. Agent traffic (an 8,000-token tool prefix) on 8 ``llama3-70b-tp2-a100``
  engines (24k tokens of KV each), capacity / least_loaded over 8 draws
  (``benchmarks.quality.samples``), warm-up 5 -> 0: geometric mean 1.10 -> 1.19, lowest
  draw 0.57 -> 0.97; A6000 agent 1.14 -> 1.16 (lowest 0.97 -> 1.02), other suite shapes
  within 0.02.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from gateway.core.types import ClusterView, Decision, EngineId, EngineView, RequestInfo
from gateway.perfmodel.model import PerfModel
from gateway.policies.base import PolicyBase, PolicyContext
from gateway.policies.inflight import InFlightContext, RoutedWork, routed_tpot_s
from gateway.policies.prefix_index import PrefixIndex
from gateway.policies.radix_tree import Node, RadixTree
from gateway.policies.ttft_estimate import tpot_s, wait_s

_FALLBACK_PERF = PerfModel(
    name="preble-default",
    prefill_a=5.0,
    prefill_b=0.0325,
    prefill_c=4.9e-5,
    prefill_d=1.06e-6,
    decode_e0=7.5,
)


@dataclass(frozen=True, slots=True)
class PrebleConfig:
    window_s: float = 180.0
    max_tree_blocks: int = 1_000_000
    explore: bool = True
    rebalance: bool = True
    th_bal: float = 1.5
    rebalance_warmup: int = 0
    rebalance_min_gap_s: float = 1.0
    replicate: bool = True
    replicate_ratio: float = 2.0
    replicate_min_samples: int = 4
    pd_balance: bool = False
    pd_margin: float = 0.1
    initial_tpot_s: float = 0.15
    default_output_tokens: int = 128
    eviction_cost_max_nodes: int = 256
    queue_aware: bool = True
    load_horizon_s: float = 1.0
    tpot_aware: bool = True
    duty_window_s: float = 10.0

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.max_tree_blocks <= 0 or self.th_bal < 1.0:
            raise ValueError("window_s and max_tree_blocks must be positive, th_bal >= 1")
        if self.pd_margin < 0:
            raise ValueError("pd_margin must be >= 0")
        if self.load_horizon_s <= 0:
            raise ValueError("load_horizon_s must be positive")


@dataclass(slots=True)
class _Routed:
    path: list[Node]
    engine: EngineId
    arrival: float
    first_token: float | None = None


class _WindowLoad:
    """Per-engine sums of prefill and decode seconds routed within the window."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._log: deque[tuple[float, EngineId, float, float]] = deque()
        self.prefill: dict[EngineId, float] = {}
        self.decode: dict[EngineId, float] = {}
        self._requests: deque[float] = deque()

    def add(self, now: float, engine: EngineId, prefill_s: float, decode_s: float) -> None:
        self._log.append((now, engine, prefill_s, decode_s))
        self.prefill[engine] = self.prefill.get(engine, 0.0) + prefill_s
        self.decode[engine] = self.decode.get(engine, 0.0) + decode_s
        self._requests.append(now)

    def expire(self, now: float) -> None:
        horizon = now - self.window_s
        log = self._log
        while log and log[0][0] < horizon:
            _, engine, p, d = log.popleft()
            self.prefill[engine] = max(0.0, self.prefill[engine] - p)
            self.decode[engine] = max(0.0, self.decode[engine] - d)
        while self._requests and self._requests[0] < horizon:
            self._requests.popleft()

    def load(self, engine: EngineId) -> float:
        return self.prefill.get(engine, 0.0) + self.decode.get(engine, 0.0)

    def decode_share(self, engine: EngineId) -> float:
        total = self.load(engine)
        return self.decode.get(engine, 0.0) / total if total > 0 else 0.0

    @property
    def requests(self) -> int:
        return len(self._requests)

    def forget(self, engine: EngineId) -> None:
        self.prefill.pop(engine, None)
        self.decode.pop(engine, None)
        self._log = deque(entry for entry in self._log if entry[1] != engine)


class PreblePolicy(PolicyBase):
    name: ClassVar[str] = "preble"
    wants_cache_events: bool = True

    def __init__(self, ctx: PolicyContext, config: PrebleConfig | None = None) -> None:
        self.config = config or PrebleConfig()
        self.perf = ctx.perf or _FALLBACK_PERF
        self.block_size = ctx.block_size
        self.tree = RadixTree(window_s=self.config.window_s, max_blocks=self.config.max_tree_blocks)
        self.loads = _WindowLoad(self.config.window_s)
        self.tpot: dict[EngineId, float] = {}
        self.capacity: dict[EngineId, int] = {}
        self.exact: set[EngineId] = set()
        # Blocks the engines announced (KV events): what other gateway replicas routed there.
        self.announced = PrefixIndex(1 << 22)
        self.flight = InFlightContext()
        self.routed_work = RoutedWork(self.config.duty_window_s)
        self.routed = 0
        self.replications = 0
        self._requests: dict[str, _Routed] = {}
        self._output_mean = float(self.config.default_output_tokens)
        self._replicated_at: dict[int, float] = {}
        self._engines: list[EngineId] = []

    # -- decision -------------------------------------------------------------
    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        cfg = self.config
        healthy = view.healthy()
        # Window bookkeeping is a function of time alone; observing capacity is a cache.
        self.loads.expire(now)
        self.tree.expire(now)
        self._engines = [e.id for e in healthy]
        for e in healthy:
            if e.kv_capacity_blocks:
                self.capacity[e.id] = e.kv_capacity_blocks
        match = self.tree.match(req.block_hashes)
        self.block_size = req.block_size  # keys are in the request's blocks (16, or 32 on CPU)
        told = self.announced.match(req.block_hashes) if self.exact else {}
        cached = {
            e.id: max(match.per_engine.get(e.id, 0), told.get(e.id, 0)) * req.block_size
            for e in healthy
        }
        best = max(cached.values())
        out = self._predict_output(match.path)
        load = {e.id: self._load(e, req, out) for e in healthy}
        if best > req.prompt_tokens - best or not cfg.explore:
            holders = [e for e in healthy if cached[e.id] == best]
            chosen = min(holders, key=lambda e: load[e.id])
            reason = "preble:exploit" if best else "preble:cold"
        else:
            chosen, reason = self._explore(req, healthy, cached, match.path, now, load=load)
        if cfg.rebalance and self.routed >= cfg.rebalance_warmup * len(healthy):
            lightest = min(healthy, key=lambda e: load[e.id])
            heavy, light = load[chosen.id], load[lightest.id]
            if heavy >= cfg.th_bal * light and heavy - light >= cfg.rebalance_min_gap_s:
                chosen, reason = lightest, "preble:rebalance"
        hit = min(cached[chosen.id], max(0, req.prompt_tokens - 1))
        return Decision(engine=chosen.id, expected_hit_tokens=hit, reason=reason)

    def _tpot_breach(self, engine: EngineView, req: RequestInfo, now: float) -> bool:
        """Would ``req``'s decode on ``engine`` miss its TPOT target (the batch one larger,
        the context in flight there, the prefill duty cycle routed there)?"""
        tpot = routed_tpot_s(
            self.perf, engine, req.prompt_tokens, flight=self.flight, work=self.routed_work, now=now
        )
        return tpot > req.slo.tpot_s

    def _explore(
        self,
        req: RequestInfo,
        healthy: Sequence[EngineView],
        cached: dict[EngineId, int],
        path: Sequence[Node],
        now: float,
        *,
        load: dict[EngineId, float],
    ) -> tuple[EngineView, str]:
        cfg = self.config
        since = now - cfg.window_s
        total = max(1, self.loads.requests)
        costs: list[tuple[float, EngineView]] = []
        if cfg.tpot_aware:  # engines whose decodes keep this request's TPOT target, if any
            healthy = [e for e in healthy if not self._tpot_breach(e, req, now)] or healthy
        for e in healthy:
            hit = min(cached[e.id], req.prompt_tokens - 1)
            prefill = self.perf.prefill_time(req.prompt_tokens - hit, hit)
            need = self.perf.blocks_for(req.prompt_tokens - hit)
            cost = load[e.id] + prefill + self._eviction_cost(e.id, need, since, total, path)
            costs.append((cost, e))
        best_cost, best = min(costs, key=lambda c: c[0])
        if cfg.pd_balance and len(costs) > 1:
            near = [e for c, e in costs if c <= best_cost * (1 + cfg.pd_margin)]
            pick = max(near, key=lambda e: self.loads.decode_share(e.id))
            if pick is not best and self.loads.decode_share(pick.id) > self.loads.decode_share(
                best.id
            ):
                return pick, "preble:pd_balance"
        return best, "preble:explore"

    def _eviction_cost(
        self, engine: EngineId, need: int, since: float, total: int, keep: Sequence[Node] = ()
    ) -> float:
        capacity = self.capacity.get(engine)
        if capacity is None:
            return 0.0
        short = self.tree.cached_blocks(engine) + need - capacity
        if short <= 0:
            return 0.0
        cost = 0.0
        own = {id(n) for n in keep}  # the request's own prefix would be reused, not evicted
        for seen, node in enumerate(self.tree.lru_nodes(engine)):
            if short <= 0 or seen >= self.config.eviction_cost_max_nodes:
                break
            if id(node) in own:
                continue
            held = self.tree.held(node, engine)
            cost += self.perf.prefill_time(held * self.block_size, node.depth * self.block_size) * (
                node.count(since) / total
            )
            short -= held
        return cost

    # -- hooks -------------------------------------------------------------------
    def on_routed(self, req: RequestInfo, decision: Decision, now: float) -> None:
        engine = decision.engine
        self.flight.add(req.id, engine, req.prompt_tokens)
        self.routed_work.add_prefill(
            self.perf, engine, req.prompt_tokens, decision.expected_hit_tokens, now
        )
        path = self.tree.insert(req.block_hashes, now)
        self.tree.record(path, engine, now)
        self.tree.add_engine(path, engine, now)
        hit = decision.expected_hit_tokens
        prefill = self.perf.prefill_time(req.prompt_tokens - hit, hit)
        decode = self._predict_output(path) * self.tpot.get(engine, self.config.initial_tpot_s)
        self.loads.add(now, engine, prefill, decode)
        self._requests[req.id] = _Routed(path, engine, req.arrival)
        self.routed += 1
        capacity = self.capacity.get(engine)
        if engine not in self.exact and capacity:
            excess = self.tree.cached_blocks(engine) - capacity
            if excess > 0:
                self.tree.evict_lru(engine, excess)

    def on_first_token(self, req: RequestInfo, engine: EngineId, now: float) -> None:
        state = self._requests.get(req.id)
        if state is None:
            return
        state.first_token = now
        # The tree may have split nodes of the routed path since: walk it again.
        state.path = self._current_path(req, state.path)
        ttft = now - state.arrival
        for node in state.path:
            node.ttfts.append((now, ttft))
        if self.config.replicate:
            self._maybe_replicate(state, now)

    def on_finished(self, req: RequestInfo, engine: EngineId, now: float, ok: bool) -> None:
        self.flight.finish(req.id)
        state = self._requests.pop(req.id, None)
        if state is None or not ok:
            return
        out = req.output_tokens
        if out:
            for node in self._current_path(req, state.path):
                node.outputs.append(out)
            self._output_mean += 0.05 * (out - self._output_mean)
            if out > 1 and state.first_token is not None:
                tpot = (now - state.first_token) / (out - 1)
                old = self.tpot.get(engine, self.config.initial_tpot_s)
                self.tpot[engine] = old + 0.2 * (tpot - old)

    def on_cache_event(
        self, engine: EngineId, stored: Sequence[int], removed: Sequence[int]
    ) -> None:
        self.exact.add(engine)
        if stored:
            self.announced.insert(engine, stored, self.capacity.get(engine) or 1 << 22)
        if removed:
            self.tree.remove_blocks(engine, removed)
            self.announced.remove(engine, removed)

    def on_cache_reset(self, engine: EngineId) -> None:
        self.tree.remove_engine(engine)
        self.announced.remove_engine(engine)
        self.exact.discard(engine)  # modelled again until its events resume

    def on_engine_removed(self, engine: EngineId) -> None:
        self.flight.remove_engine(engine)
        self.routed_work.remove_engine(engine)
        self.tree.remove_engine(engine)
        self.announced.remove_engine(engine)
        self.loads.forget(engine)
        self.tpot.pop(engine, None)
        self.capacity.pop(engine, None)
        self.exact.discard(engine)

    # -- helpers -------------------------------------------------------------------
    def _load(self, engine: EngineView, req: RequestInfo, out: float) -> float:
        """Window load L, plus (``queue_aware``) the time to prefill what is queued now and
        this request's predicted decode time there (its batch and the context it attends)."""
        cfg = self.config
        window = self.loads.load(engine.id)
        if not cfg.queue_aware:
            return window
        ctx = self.flight.attended(self.perf, engine, req.prompt_tokens)
        decode = out * tpot_s(self.perf, engine, req.prompt_tokens, ctx_tokens=ctx)
        scaled = window * min(1.0, cfg.load_horizon_s / cfg.window_s)
        return scaled + wait_s(self.perf, engine) + decode

    def _current_path(self, req: RequestInfo, old: list[Node]) -> list[Node]:
        match = self.tree.match(req.block_hashes)
        return match.path if match.blocks == len(req.block_hashes) else old

    def _predict_output(self, path: Sequence[Node]) -> float:
        for node in reversed(path):
            if node.outputs:
                return sum(node.outputs) / len(node.outputs)
        return self._output_mean

    def _maybe_replicate(self, state: _Routed, now: float) -> None:
        cfg = self.config
        half = now - cfg.window_s / 2
        start = now - cfg.window_s
        for depth, node in enumerate(reversed(state.path)):
            if len(node.engines) >= len(self._engines) or node.count(start) < 2:
                continue
            last = self._replicated_at.get(id(node))
            if last is not None and now - last < cfg.window_s / 2:
                continue
            early = [t for when, t in node.ttfts if start <= when < half]
            late = [t for when, t in node.ttfts if when >= half]
            if min(len(early), len(late)) < cfg.replicate_min_samples:
                continue
            if sum(late) / len(late) < cfg.replicate_ratio * (sum(early) / len(early)):
                continue
            others = [e for e in self._engines if e not in node.engines]
            if not others:
                continue
            target = min(others, key=self.loads.load)
            prefix = state.path[: len(state.path) - depth]
            self.tree.add_engine(prefix, target, now)
            if len(self._replicated_at) > 10_000:  # bounded: forget old replications
                self._replicated_at = {
                    k: v for k, v in self._replicated_at.items() if now - v < cfg.window_s
                }
            self._replicated_at[id(node)] = now
            self.replications += 1
            return
