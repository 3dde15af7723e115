"""LoRA adapter affinity: narrow the engines a LoRA request may go to, before any policy.

Algorithm: for a request naming an adapter (``RequestInfo.lora``), sort the healthy
engines into tiers by what serving it there costs:

1. *resident*: the adapter is in the engine's batch (``EngineView.lora_resident``:
   scraped ``vllm:lora_requests_info`` plus the gateway's own requests in flight);
2. *free slot*: it is not, but fewer than ``max_lora`` adapters are, so loading it
   evicts nobody (an engine with unknown ``max_lora``, 0, counts here);
3. *must evict*: every adapter slot is taken by other adapters.

The best non-empty tier is kept; every other engine is marked unhealthy, order
unchanged, so the policy (cache-aware or not) chooses within the tier. A *load
guard* keeps one hot adapter from piling onto its resident engines while others
sit idle: while the least loaded kept engine carries more than
``factor`` x the least loaded engine of the next tier + ``margin`` requests
(load: ``max(in_flight, running + waiting) + router_queued``), the next tier is
added, and the policy weighs cache hits against load among both.
Prefill-only engines are tiered apart from the others, so in a disaggregated
cluster each pool keeps a healthy engine. Never narrows to an empty healthy set;
a base-model request, or a view with no tier difference, passes unchanged.

Knobs: ``factor`` (2.0) and ``margin`` (16 requests): an adapter stays on its
resident engines until they run 16 more requests than an idle engine, or twice as
many (plus 16) as a busy one. Measured with ``benchmarks/quality/lora_affinity_guard.py``
(``gen:lora``, 4 simulated engines, least_loaded and predicted_ttft): narrowing at
all is what matters (goodput 0.65 -> 0.99 under least_loaded at ``--max-loras 2``,
x0.5 rate); without a guard an overloaded ``--max-loras 1`` cluster piles requests
onto resident engines (TTFT p99 53-142 s against 42-61 s with this guard, two
seeds); a margin of 4 widened too early (goodput 0.01-0.07 lower than 16).
Source: llm-d's lora-affinity scorer idea (resident > has capacity > other); the
tiers-as-filter and the guard are kvgate's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from gateway.core.types import ClusterView, EngineRole, EngineView, RequestInfo

RESIDENT, FREE_SLOT, MUST_EVICT = 0, 1, 2


@dataclass(frozen=True, slots=True)
class LoraAffinityConfig:
    """The load guard: widen to the next tier when the kept engines' least load exceeds
    ``factor`` x the next tier's least load + ``margin`` (requests)."""

    factor: float = 2.0
    margin: int = 16


DEFAULT_LORA_AFFINITY = LoraAffinityConfig()


def engine_load(engine: EngineView) -> int:
    """Requests on the engine: the larger of the router's and the engine's own count,
    plus those held in the router's queue for it."""
    return max(engine.in_flight, engine.num_running + engine.num_waiting) + engine.router_queued


def adapter_tier(engine: EngineView, lora: str) -> int:
    """:data:`RESIDENT`, :data:`FREE_SLOT` or :data:`MUST_EVICT` for ``lora`` on ``engine``."""
    if lora in engine.lora_resident:
        return RESIDENT
    if engine.max_lora <= 0 or len(engine.lora_resident) < engine.max_lora:
        return FREE_SLOT
    return MUST_EVICT


def keep_for_adapter(
    engines: Sequence[EngineView], lora: str, config: LoraAffinityConfig
) -> set[str]:
    """The ids of ``engines`` (all healthy) worth sending a ``lora`` request to."""
    tiers: list[list[EngineView]] = [[], [], []]
    for e in engines:
        tiers[adapter_tier(e, lora)].append(e)
    present = [t for t in tiers if t]
    if len(present) <= 1:
        return {e.id for e in engines}
    kept = list(present[0])
    least = min(engine_load(e) for e in kept)
    for tier in present[1:]:
        below = min(engine_load(e) for e in tier)
        if least <= config.factor * below + config.margin:
            break
        kept.extend(tier)
        least = min(least, below)
    return {e.id for e in kept}


def narrow_to_adapter(
    req: RequestInfo, view: ClusterView, config: LoraAffinityConfig = DEFAULT_LORA_AFFINITY
) -> ClusterView:
    """``view`` with the engines outside the request's best adapter tier marked unhealthy
    (``view`` itself when the request names no adapter or nothing is narrowed)."""
    if not req.lora:
        return view
    healthy = view.healthy()
    prefill_only = [e for e in healthy if e.role is EngineRole.PREFILL]
    others = [e for e in healthy if e.role is not EngineRole.PREFILL]
    keep: set[str] = set()
    for group in (prefill_only, others):
        if group:
            keep |= keep_for_adapter(group, req.lora, config)
    if len(keep) == len(healthy):
        return view
    return ClusterView(
        tuple(e if not e.healthy or e.id in keep else replace(e, healthy=False) for e in view)
    )
