"""Metrics of a simulation run: latency percentiles, goodput, hit rates, balance.

Definitions (see ``docs/simulator.md``): TTFT = first token − arrival;
TPOT = (finish − first token) / (output − 1), undefined for one-token
outputs; E2E = finish − arrival. Goodput is the fraction of *all* requests
(rejected ones included) that meet both targets of their SLO class. The cache
hit rate counts, per request, the prompt tokens found cached when it was
first scheduled, over all prompt tokens of served requests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gateway.sim.loop import RequestRecord, SimRun
from gateway.sim.workloads import Workload, WorkloadRequest


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation; None when empty."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def latency_summary(records: Iterable[RequestRecord]) -> dict[str, Any]:
    """Latency percentiles, goodput and hit rate of a group of requests."""
    recs = list(records)
    ttft = [r.ttft for r in recs if r.ttft is not None]
    tpot = [r.tpot for r in recs if r.tpot is not None]
    e2e = [r.e2e for r in recs if r.e2e is not None]
    served = [r for r in recs if r.rejected is None]
    prompt = sum(r.source.prompt_tokens for r in served)
    met = sum(
        1
        for r in recs
        if r.finish_time is not None and r.ttft is not None and r.info.slo.met(r.ttft, r.tpot)
    )
    return {
        "requests": len(recs),
        "completed": sum(1 for r in recs if r.finish_time is not None),
        "rejected": len(recs) - len(served),
        "ttft_mean": _mean(ttft),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p90": percentile(ttft, 90),
        "ttft_p99": percentile(ttft, 99),
        "tpot_p50": percentile(tpot, 50),
        "tpot_p99": percentile(tpot, 99),
        "e2e_mean": _mean(e2e),
        "e2e_p50": percentile(e2e, 50),
        "e2e_p99": percentile(e2e, 99),
        "goodput": met / len(recs) if recs else 0.0,
        "cache_hit_rate": (sum(r.cached_tokens for r in served) / prompt) if prompt else 0.0,
        "router_hit_estimate": (
            sum(r.expected_hit_tokens for r in served) / prompt if prompt else 0.0
        ),
    }


def summarize(run: SimRun) -> dict[str, Any]:
    """The per-policy entry of ``results.json``."""
    recs = run.records
    out = latency_summary(recs)
    first = min((r.source.arrival for r in recs), default=0.0)
    duration = run.end_time - first
    out["throughput_rps"] = out["completed"] / duration if duration > 0 else 0.0
    out["output_tokens_per_s"] = (
        sum(r.source.output_tokens for r in recs if r.finish_time is not None) / duration
        if duration > 0
        else 0.0
    )
    cvs = [cv for _, cv in run.load_cv]
    out["load_cv_mean"] = _mean(cvs) or 0.0
    out["load_cv_p95"] = percentile(cvs, 95) or 0.0
    us = [s * 1e6 for s in run.decision_seconds]
    out["decision_us_p50"] = percentile(us, 50)
    out["decision_us_p99"] = percentile(us, 99)
    out["preemptions"] = run.preemptions
    out["held"] = sum(1 for r in recs if r.held)
    out["migrations"] = run.migrations
    out["engine_steps"] = run.engine_steps
    if run.lora_loads is not None:  # only with LoRA traffic: other results keep their keys
        out["lora_loads"] = run.lora_loads
    out["capacity_rps"] = None
    flow = [r for r in recs if r.flow_wait > 0 or r.refused_at is not None]
    if flow:  # flow control ran and held or refused some: other results keep their keys
        waits = [r.flow_wait for r in recs if r.flow_wait > 0 and r.rejected is None]
        refused: dict[str, int] = {}
        for r in flow:
            if r.refused_at is not None and r.rejected is not None:
                refused[r.rejected] = refused.get(r.rejected, 0) + 1
        out["flow"] = {
            "queued": len(flow),
            "wait_p50": percentile(waits, 50),
            "wait_p99": percentile(waits, 99),
            "refused": dict(sorted(refused.items())),
        }
    classes = sorted({r.info.slo.name for r in recs})
    if len(classes) > 1:
        out["per_class"] = {
            name: latency_summary(r for r in recs if r.info.slo.name == name) for name in classes
        }
    return out


def slo_attainment(run: SimRun, *, ttft_only: bool = False) -> float:
    """Fraction of all requests meeting their SLO: both targets, or TTFT alone."""
    if not ttft_only:
        return float(latency_summary(run.records)["goodput"])
    recs = run.records
    met = sum(1 for r in recs if r.ttft is not None and r.ttft <= r.info.slo.ttft_s)
    return met / len(recs) if recs else 0.0


def cache_hit_upper_bound(
    workload: Workload, admissible: Callable[[WorkloadRequest], bool] | None = None
) -> float:
    """Token hit rate with an infinite cache shared by all engines, in the best order.

    A block can be a hit for every request holding it within its hittable
    range (all but the last prompt token), except for one first computation
    when no request holds it outside that range. With chained hashes the
    prefix constraint holds by itself, so no schedule can beat this.
    """
    block_size = workload.block_size
    hittable: Counter[int] = Counter()
    beyond: set[int] = set()
    prompt = 0
    for req in workload.requests:
        if admissible is not None and not admissible(req):
            continue
        prompt += req.prompt_tokens
        limit = min(len(req.block_hashes), (req.prompt_tokens - 1) // block_size)
        hashes = req.block_hashes
        hittable.update(hashes[:limit])
        beyond.update(hashes[limit:])
    if prompt == 0:
        return 0.0
    hits = sum(count - (0 if h in beyond else 1) for h, count in hittable.items())
    return hits * block_size / prompt
