"""Cost-model router for (disaggregated) serving: the added completion time of each option.

Algorithm (after the calibrated cost-model router of ``algorithms.md`` §3;
re-implemented): for a request, every option is either a (prefill, decode)
pair — remote prefill, KV transfer, decode — or a decode engine that prefills
locally (conditional disaggregation). Each option is priced with the engine
performance model (calibrate it: ``kvgate calibrate``):

* prefill: queue ahead (pending prefill tokens x seconds per token) + the
  prefill time of the prompt's part not cached there (exact prompt length;
  cached part estimated from a per-engine LRU of routed prompts);
* transfer: prompt tokens x KV bytes per token / ``kv_bandwidth_gbps``;
* decode: predicted output (online predictor by prefix group and SLO class,
  capped by ``max_tokens``) x the decode step time with this request added to
  the batch; x ``preemption_penalty`` when the engine's KV use *after*
  admission would pass ``kv_pressure_threshold``; plus the engine's waiting
  queue; a local prefill also delays the engine's running decodes
  (``interference_weight``).

The option with the least added completion time among those meeting the
request's TTFT and TPOT targets wins. When none does (scarcity), greedy
minimisation piles work on one engine, so the router spreads instead: the
least loaded pair, rotating among equals (``scarcity_guard``). Remote prefill
is only considered when at least ``min_uncached_tokens`` are not cached on the
decode engine. In a unified pool only local options exist.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from gateway.core.types import ClusterView, Decision, EngineId, EngineRole, EngineView, RequestInfo
from gateway.perfmodel.model import PerfModel
from gateway.policies.base import PolicyBase, PolicyContext
from gateway.policies.output_predictor import OutputPredictor
from gateway.policies.prefix_index import PrefixIndex

_FALLBACK = PerfModel(
    name="cost-model-default",
    prefill_a=5.0,
    prefill_b=0.0325,
    prefill_c=4.9e-5,
    prefill_d=1.06e-6,
    decode_e0=7.5,
    decode_e1=0.03,
    decode_e2=4.9e-5,
    kv_capacity_blocks=25_000,
)


@dataclass(frozen=True, slots=True)
class CostModelConfig:
    kv_bandwidth_gbps: float = 25.0
    min_uncached_tokens: int = 256
    kv_pressure_threshold: float = 0.9
    preemption_penalty: float = 2.0
    interference_weight: float = 1.0
    default_output_tokens: int = 128
    scarcity_guard: bool = True

    def __post_init__(self) -> None:
        if self.kv_bandwidth_gbps <= 0 or self.preemption_penalty < 1:
            raise ValueError("kv_bandwidth_gbps must be positive, preemption_penalty >= 1")
        if not 0 < self.kv_pressure_threshold <= 1:
            raise ValueError("kv_pressure_threshold must be within (0, 1]")


@dataclass(frozen=True, slots=True)
class _Option:
    cost: float
    ttft: float
    tpot: float
    decode: EngineView
    prefill: EngineView | None
    hit: int


class CostModelPolicy(PolicyBase):
    name: ClassVar[str] = "cost_model"
    pd_native: ClassVar[bool] = True

    def __init__(self, ctx: PolicyContext, config: CostModelConfig | None = None) -> None:
        self.config = config or CostModelConfig()
        self.perf = ctx.perf or _FALLBACK
        self.spt = self.perf.seconds_per_prefill_token()
        self.predictor = OutputPredictor(default=float(self.config.default_output_tokens))
        self.cache = PrefixIndex(1 << 22)
        self._capacity: dict[EngineId, int] = {}
        self._rotation = 0

    # -- pricing -----------------------------------------------------------------
    def _decode_side(self, d: EngineView, req: RequestInfo, out: float) -> tuple[float, float]:
        """(time spent decoding incl. queue, TPOT) of ``req`` on ``d``."""
        perf = self.perf
        cap = d.kv_capacity_blocks or perf.kv_capacity_blocks
        used_tokens = d.kv_usage * cap * perf.block_size
        batch = d.num_running + 1
        step = perf.decode_step_time(batch, int(used_tokens + req.prompt_tokens + out / 2))
        after = (d.kv_usage * cap + perf.blocks_for(req.prompt_tokens + int(out))) / cap
        tpot = step * (
            self.config.preemption_penalty if after > self.config.kv_pressure_threshold else 1.0
        )
        return out * tpot + d.num_waiting * step, tpot

    def _options(self, req: RequestInfo, view: ClusterView) -> list[_Option]:
        cfg = self.config
        perf = self.perf
        out = self.predictor.predict(req)
        matched = self.cache.match(req.block_hashes)
        bs = req.block_size
        limit = max(0, req.prompt_tokens - 1)
        transfer = req.prompt_tokens * perf.kv_bytes_per_token / (cfg.kv_bandwidth_gbps * 1e9)
        disagg = view.disaggregated
        decodes = view.pool(EngineRole.DECODE).healthy() if disagg else view.healthy()
        prefills = view.pool(EngineRole.PREFILL).healthy() if disagg else ()
        options: list[_Option] = []
        for d in decodes:
            decode_time, tpot = self._decode_side(d, req, out)
            hit_d = min(matched.get(d.id, 0) * bs, limit)
            local_pf = perf.prefill_time(req.prompt_tokens - hit_d, hit_d)
            wait_d = d.pending_prefill_tokens * self.spt
            interference = cfg.interference_weight * local_pf * d.num_running / (d.num_running + 1)
            ttft = wait_d + local_pf
            options.append(_Option(ttft + decode_time + interference, ttft, tpot, d, None, hit_d))
            if req.prompt_tokens - hit_d < cfg.min_uncached_tokens:
                continue
            for p in prefills:
                if p.id == d.id:
                    continue
                hit_p = min(matched.get(p.id, 0) * bs, limit)
                ttft = (
                    p.pending_prefill_tokens * self.spt
                    + perf.prefill_time(req.prompt_tokens - hit_p, hit_p)
                    + transfer
                    + d.num_waiting * tpot
                )
                options.append(_Option(ttft + decode_time, ttft, tpot, d, p, hit_p))
        return options

    # -- decision ------------------------------------------------------------------
    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        for e in view.engines:
            if e.kv_capacity_blocks:
                self._capacity[e.id] = e.kv_capacity_blocks
        options = self._options(req, view)
        if not options:  # no decode-capable engine healthy: any healthy engine, locally
            e = view.healthy()[0]
            return Decision(engine=e.id, reason="cost_model:fallback")
        slo = req.slo
        feasible = [o for o in options if o.ttft <= slo.ttft_s and o.tpot <= slo.tpot_s]
        if feasible:
            best = min(feasible, key=lambda o: o.cost)
            reason = "cost_model:remote" if best.prefill else "cost_model:local"
        elif self.config.scarcity_guard:
            best = self._spread(options)
            reason = "cost_model:spread"
        else:
            best = min(options, key=lambda o: o.cost)
            reason = "cost_model:greedy"
        return Decision(
            engine=best.decode.id,
            prefill_engine=best.prefill.id if best.prefill else None,
            expected_hit_tokens=best.hit,
            reason=reason,
        )

    def _spread(self, options: Sequence[_Option]) -> _Option:
        """Scarcity: the least loaded option, rotating among equally loaded ones.

        With a prefill pool, only remote options spread: under overload, prefilling on
        decode engines would take decode time from every request already running there.
        """
        remote = [o for o in options if o.prefill is not None]
        pool = remote or list(options)

        def load(o: _Option) -> tuple[int, int]:
            prefill_side = o.prefill if o.prefill is not None else o.decode
            return (prefill_side.pending_prefill_tokens, o.decode.in_flight + o.decode.num_waiting)

        lowest = min(load(o) for o in pool)
        tied = [o for o in pool if load(o) == lowest]
        return tied[self._rotation % len(tied)]

    # -- hooks ---------------------------------------------------------------------
    def on_routed(self, req: RequestInfo, decision: Decision, now: float) -> None:
        self._rotation += 1
        for engine in (decision.prefill_engine, decision.engine):
            if engine is not None:
                cap = self._capacity.get(engine, self.perf.kv_capacity_blocks)
                self.cache.insert(engine, req.block_hashes, cap)

    def on_finished(self, req: RequestInfo, engine: EngineId, now: float, ok: bool) -> None:
        if ok and req.output_tokens:
            self.predictor.observe(req, req.output_tokens)

    def on_engine_removed(self, engine: EngineId) -> None:
        self.cache.remove_engine(engine)
        self._capacity.pop(engine, None)
