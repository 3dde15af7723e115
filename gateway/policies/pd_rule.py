"""Conditional disaggregation: does a request's prefill run on the prefill pool or locally?

One rule for every policy that serves a disaggregated pool (pair mode through the
dispatcher, and the ``pd_native`` policies). Given the decode engine chosen for the
request and ``uncached`` — the prompt tokens not already cached there, by the policy's
own estimate — the first line that matches decides:

1. no healthy prefill engine                              -> local, ``local_no_prefill``
2. ``uncached < min_uncached_tokens`` (16)                 -> local, ``local_short``
3. ``uncached < max_local_tokens`` (2,048) **and**
   ``uncached / prompt < max_local_ratio`` (0.7)           -> local, ``local_cached``
4. the prefill pool's predicted wait > ``saturation_wait_s`` (1 s) and the decode
   engine's own predicted wait is shorter                  -> local, ``local_saturated``
5. otherwise remote: ``remote_long`` when ``uncached >= max_local_tokens``, else
   ``remote_uncached`` (shorter, but mostly not cached on the decode engine).

Line 2 is llm-d's prefix-based P/D decider (remote iff uncached >= ``nonCachedTokens``,
16 in its shipped P/D config); line 3 is Dynamo's ``isl_bounding`` default (local iff
effective ISL < 2,048 and effective ISL / ISL < 0.7); line 4 is Dynamo's
``prefill_load`` with the threshold in seconds of predicted wait. The predicted wait of
an engine is the prefill time of the tokens queued there (router-side pending tokens,
which include requests routed but not yet reported by the engine) under the engine
performance model: ``ceil(pending / max_num_batched_tokens)`` chunk steps of fixed cost
``prefill_a`` plus ``prefill_b`` per token. The pool's wait is its least loaded engine's.
Facts from the anchors' docs and code; re-implemented.

**Decode balance.** When the prefill runs remotely and the decode engine the policy
picked holds less than ``1 - max_local_ratio`` (30 %) of the prompt (no reuse pays
for it), :meth:`PDRule.balance_decode` moves the leg to a decode engine that is idle by
the router's own count (no request in flight or held there, no pending prefill; the
scrape is not needed) when the pick is busy or was given a decode leg more recently:
between two scrapes a run of cold prompts otherwise piled on one decode engine
while another sat idle (ties broken alike for every request).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from gateway.core.types import EngineId, EngineView, RequestInfo
from gateway.perfmodel.model import PerfModel


class PDReason(StrEnum):
    """Why a disaggregated request was prefilled where it was (a bounded label set)."""

    REMOTE_LONG = "remote_long"
    REMOTE_UNCACHED = "remote_uncached"
    LOCAL_SHORT = "local_short"
    LOCAL_CACHED = "local_cached"
    LOCAL_SATURATED = "local_saturated"
    LOCAL_NO_PREFILL = "local_no_prefill"
    REMOTE_PRICED = "remote_priced"
    """The cost model's own choice against the rule (``follow_pd_rule=false``)."""
    LOCAL_PRICED = "local_priced"

    @property
    def remote(self) -> bool:
        return self.value.startswith("remote")


@dataclass(frozen=True, slots=True)
class PDSettings:
    """The thresholds of the rule (the ``pd`` section of the gateway's config)."""

    min_uncached_tokens: int = 16
    max_local_tokens: int = 2048
    max_local_ratio: float = 0.7
    saturation_wait_s: float = 1.0

    def __post_init__(self) -> None:
        if self.min_uncached_tokens < 0 or self.max_local_tokens < 0:
            raise ValueError("min_uncached_tokens and max_local_tokens must be >= 0")
        if not 0.0 <= self.max_local_ratio <= 1.0:
            raise ValueError("max_local_ratio must be within [0, 1]")
        if not self.saturation_wait_s > 0:
            raise ValueError("saturation_wait_s must be positive")


@dataclass(frozen=True, slots=True)
class PDChoice:
    """The rule's answer for one (request, decode engine)."""

    reason: PDReason
    uncached: int
    pool_wait_s: float = 0.0

    @property
    def remote(self) -> bool:
        return self.reason.remote


def predicted_wait(perf: PerfModel, engine: EngineView) -> float:
    """Seconds until ``engine`` has prefilled what is queued there now (the model's estimate)."""
    pending = engine.pending_prefill_tokens + engine.router_queued_tokens
    if pending <= 0:
        return 0.0
    steps = math.ceil(pending / perf.max_num_batched_tokens)
    return (steps * perf.prefill_a + pending * perf.prefill_b) / 1000.0


class PDRule:
    """The rule above for one set of thresholds and one engine performance model."""

    def __init__(self, settings: PDSettings, perf: PerfModel) -> None:
        self.settings = settings
        self.perf = perf

    def pool_wait(self, prefills: Sequence[EngineView]) -> float:
        """The predicted wait of the pool's least loaded healthy engine (inf when none)."""
        return min((predicted_wait(self.perf, e) for e in prefills if e.healthy), default=math.inf)

    def decide(
        self,
        req: RequestInfo,
        decode: EngineView,
        decode_hit_tokens: int,
        prefills: Sequence[EngineView],
        *,
        pool_wait_s: float | None = None,
    ) -> PDChoice:
        """Where ``req`` is prefilled if it decodes on ``decode`` (``prefills``: the pool,
        without ``decode``). ``pool_wait_s`` may pass :meth:`pool_wait` computed once."""
        s = self.settings
        uncached = max(0, req.prompt_tokens - max(0, decode_hit_tokens))
        wait = self.pool_wait(prefills) if pool_wait_s is None else pool_wait_s
        if math.isinf(wait):
            return PDChoice(PDReason.LOCAL_NO_PREFILL, uncached, wait)
        if uncached < s.min_uncached_tokens:
            return PDChoice(PDReason.LOCAL_SHORT, uncached, wait)
        ratio = uncached / req.prompt_tokens if req.prompt_tokens > 0 else 0.0
        if uncached < s.max_local_tokens and ratio < s.max_local_ratio:
            return PDChoice(PDReason.LOCAL_CACHED, uncached, wait)
        if wait > s.saturation_wait_s and predicted_wait(self.perf, decode) < wait:
            return PDChoice(PDReason.LOCAL_SATURATED, uncached, wait)
        long = uncached >= s.max_local_tokens
        return PDChoice(PDReason.REMOTE_LONG if long else PDReason.REMOTE_UNCACHED, uncached, wait)

    def reuse_pays(self, req: RequestInfo, decode_hit_tokens: int) -> bool:
        """True when the decode engine holds enough of the prompt to keep the leg there."""
        share = 1.0 - self.settings.max_local_ratio
        return decode_hit_tokens > 0 and decode_hit_tokens >= share * req.prompt_tokens

    @staticmethod
    def balance_decode(
        pick: EngineView, decodes: Sequence[EngineView], last_leg: Mapping[EngineId, int]
    ) -> EngineView:
        """The decode engine of a remote leg without reuse: ``pick`` unless another healthy
        engine of ``decodes`` is idle by the router's count while ``pick`` is busy or got a
        decode leg more recently (``last_leg``: the sequence number of each engine's last
        decode leg); then the least recently used idle engine."""
        idle = [e for e in decodes if e.healthy and _router_idle(e)]
        if not idle:
            return pick
        best = min(idle, key=lambda e: last_leg.get(e.id, -1))
        if _router_idle(pick) and last_leg.get(pick.id, -1) <= last_leg.get(best.id, -1):
            return pick
        return best


def _router_idle(engine: EngineView) -> bool:
    """Nothing in flight, held or pending there as the router counts (its own and its peers')."""
    return not (engine.in_flight or engine.router_queued or engine.pending_prefill_tokens)
