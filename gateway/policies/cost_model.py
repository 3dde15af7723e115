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

Which options exist follows the P/D rule (:mod:`gateway.policies.pd_rule`, the
same rule the dispatcher applies in pair mode): for each decode engine the rule
says whether this request prefills there (local) or on the prefill pool (remote),
and only options of that kind are priced for that decode engine. The pricing then
chooses *which* engines: the option with the least added completion time among
those meeting the request's TTFT and TPOT targets wins; options within
``tie_s`` of it are equal, and among equals the decode engine with the fewest
requests in flight, then the one chosen least recently, wins (so a sequence of
requests does not pile on one idle-looking engine). Decode pricing counts the
slow-down a request adds to the requests already decoding there (``decode_e1``
per step each). With ``follow_pd_rule=false`` the cost model overrides the rule:
every local and remote option (remote from ``pd.min_uncached_tokens`` uncached
tokens) is priced, and a choice against the rule is labelled ``*_priced``.
When no option meets the targets (scarcity), greedy minimisation piles work on
one engine, so the router spreads instead: the least loaded option, rotating
among equals (``scarcity_guard``). In a unified pool only local options exist.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from gateway.core.types import ClusterView, Decision, EngineId, EngineRole, EngineView, RequestInfo
from gateway.perfmodel.model import PerfModel
from gateway.policies.base import PolicyBase, PolicyContext
from gateway.policies.output_predictor import OutputPredictor
from gateway.policies.pd_rule import PDReason, PDRule, predicted_wait
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
    kv_pressure_threshold: float = 0.9
    preemption_penalty: float = 2.0
    interference_weight: float = 1.0
    default_output_tokens: int = 128
    scarcity_guard: bool = True
    follow_pd_rule: bool = True
    """Local or remote prefill as the P/D rule says; false: as the prices say."""
    tie_s: float = 0.001
    """Options whose added completion times differ by less than this are equal."""

    def __post_init__(self) -> None:
        if self.kv_bandwidth_gbps <= 0 or self.preemption_penalty < 1:
            raise ValueError("kv_bandwidth_gbps must be positive, preemption_penalty >= 1")
        if self.tie_s < 0:
            raise ValueError("tie_s must be >= 0")
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
    reason: PDReason | None


class CostModelPolicy(PolicyBase):
    name: ClassVar[str] = "cost_model"
    pd_native: ClassVar[bool] = True

    def __init__(self, ctx: PolicyContext, config: CostModelConfig | None = None) -> None:
        self.config = config or CostModelConfig()
        self.perf = ctx.perf or _FALLBACK
        self.rule = PDRule(ctx.pd, self.perf)
        self.spt = self.perf.seconds_per_prefill_token()
        self.predictor = OutputPredictor(default=float(self.config.default_output_tokens))
        self.cache = PrefixIndex(1 << 22)
        self.wants_cache_events = ctx.kv_events
        self._capacity: dict[EngineId, int] = {}
        self._rotation = 0
        self._last_used: dict[EngineId, int] = {}

    # -- pricing -----------------------------------------------------------------
    def _decode_side(self, d: EngineView, req: RequestInfo, out: float) -> tuple[float, float]:
        """(time spent decoding incl. queue and the slow-down of the others, TPOT) on ``d``."""
        perf = self.perf
        cap = d.kv_capacity_blocks or perf.kv_capacity_blocks
        used_tokens = d.kv_usage * cap * perf.block_size
        others = max(d.num_running, d.in_flight)  # in flight: routed here, not yet scraped
        step = perf.decode_step_time(others + 1, int(used_tokens + req.prompt_tokens + out / 2))
        after = (d.kv_usage * cap + perf.blocks_for(req.prompt_tokens + int(out))) / cap
        tpot = step * (
            self.config.preemption_penalty if after > self.config.kv_pressure_threshold else 1.0
        )
        slow_down = self.config.interference_weight * others * perf.decode_e1 / 1000.0 * out
        return out * tpot + d.num_waiting * step + slow_down, tpot

    def _options(self, req: RequestInfo, view: ClusterView) -> list[_Option]:
        cfg = self.config
        perf = self.perf
        out = self.predictor.predict(req)
        matched = self.cache.match(req.block_hashes)
        bs = req.block_size
        limit = max(0, req.prompt_tokens - 1)
        per_token_transfer = perf.kv_bytes_per_token / (cfg.kv_bandwidth_gbps * 1e9)
        disagg = view.disaggregated
        decodes = view.pool(EngineRole.DECODE).healthy() if disagg else view.healthy()
        prefills = view.pool(EngineRole.PREFILL).healthy() if disagg else ()
        pool_wait = self.rule.pool_wait(prefills)
        options: list[_Option] = []
        for d in decodes:
            decode_time, tpot = self._decode_side(d, req, out)
            hit_d = min(matched.get(d.id, 0) * bs, limit)
            local_ok, remote_ok, rule = True, False, None
            if disagg:
                others = [p for p in prefills if p.id != d.id]
                wait = pool_wait if len(others) == len(prefills) else self.rule.pool_wait(others)
                choice = self.rule.decide(req, d, hit_d, others, pool_wait_s=wait)
                rule = choice.reason
                if cfg.follow_pd_rule:
                    local_ok, remote_ok = not choice.remote, choice.remote
                else:
                    remote_ok = choice.uncached >= self.rule.settings.min_uncached_tokens
            if local_ok:
                local_pf = perf.prefill_time(req.prompt_tokens - hit_d, hit_d)
                wait_d = predicted_wait(perf, d)
                interference = (
                    cfg.interference_weight * local_pf * d.num_running / (d.num_running + 1)
                )
                ttft = wait_d + local_pf
                reason = _label(rule, remote=False)
                cost = ttft + decode_time + interference
                options.append(_Option(cost, ttft, tpot, d, None, hit_d, reason))
            if not remote_ok:
                continue
            transfer = (req.prompt_tokens - hit_d) * per_token_transfer
            for p in prefills:
                if p.id == d.id:
                    continue
                hit_p = min(matched.get(p.id, 0) * bs, limit)
                ttft = (
                    predicted_wait(perf, p)
                    + perf.prefill_time(req.prompt_tokens - hit_p, hit_p)
                    + transfer
                    + d.num_waiting * tpot
                )
                reason = _label(rule, remote=True)
                options.append(_Option(ttft + decode_time, ttft, tpot, d, p, hit_p, reason))
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
            best = self._cheapest(feasible)
            reason = "cost_model:remote" if best.prefill else "cost_model:local"
        elif self.config.scarcity_guard:
            best = self._spread(options)
            reason = "cost_model:spread"
        else:
            best = self._cheapest(options)
            reason = "cost_model:greedy"
        return Decision(
            engine=best.decode.id,
            prefill_engine=best.prefill.id if best.prefill else None,
            expected_hit_tokens=best.hit,
            reason=reason,
            pd_reason=best.reason.value if best.reason else "",
        )

    def explain(self, req: RequestInfo, view: ClusterView) -> list[tuple[str, str, float, str]]:
        """Every option ``decide`` would price now: (decode engine, prefill engine or
        ``local``, added completion time in seconds, P/D reason), cheapest first."""
        return sorted(
            (
                (o.decode.id, o.prefill.id if o.prefill else "local", o.cost, str(o.reason or ""))
                for o in self._options(req, view)
            ),
            key=lambda t: t[2],
        )

    def _cheapest(self, options: Sequence[_Option]) -> _Option:
        """The least added completion time; among options within ``tie_s`` of it, the
        decode engine with the fewest requests in flight, then the least recently used."""
        low = min(o.cost for o in options)
        tied = [o for o in options if o.cost <= low + self.config.tie_s]
        if len(tied) == 1:
            return tied[0]
        last = self._last_used

        def key(o: _Option) -> tuple[int, int, int, int]:
            p = o.prefill
            return (
                o.decode.in_flight,
                last.get(o.decode.id, -1),
                p.pending_prefill_tokens if p else 0,
                last.get(p.id, -1) if p else 0,
            )

        return min(tied, key=key)

    def _spread(self, options: Sequence[_Option]) -> _Option:
        """Scarcity: the least loaded option, rotating among equally loaded ones.

        With a prefill pool, only remote options spread (when the rule left any): under
        overload, prefilling on decode engines would take decode time from every request
        already running there.
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
                self._last_used[engine] = self._rotation
                cap = self._capacity.get(engine, self.perf.kv_capacity_blocks)
                self.cache.insert(engine, req.block_hashes, cap)

    def on_finished(self, req: RequestInfo, engine: EngineId, now: float, ok: bool) -> None:
        if ok and req.output_tokens:
            self.predictor.observe(req, req.output_tokens)

    def on_cache_event(
        self, engine: EngineId, stored: Sequence[int], removed: Sequence[int]
    ) -> None:
        """KV events: blocks any replica's requests stored on ``engine``, and its evictions."""
        if stored:
            self.cache.insert(
                engine, stored, self._capacity.get(engine, self.perf.kv_capacity_blocks)
            )
        if removed:
            self.cache.remove(engine, removed)

    def on_cache_reset(self, engine: EngineId) -> None:
        self.cache.remove_engine(engine)

    def on_engine_removed(self, engine: EngineId) -> None:
        self.cache.remove_engine(engine)
        self._capacity.pop(engine, None)
        self._last_used.pop(engine, None)


def _label(rule: PDReason | None, *, remote: bool) -> PDReason | None:
    """The rule's reason when the option agrees with it, else the priced override's."""
    if rule is None or rule.remote == remote:
        return rule
    return PDReason.REMOTE_PRICED if remote else PDReason.LOCAL_PRICED
