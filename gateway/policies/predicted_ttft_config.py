"""predicted_ttft's knobs and the records of one decision (see :mod:`.predicted_ttft`)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.core.types import EngineView


@dataclass(frozen=True, slots=True)
class PredictedTtftConfig:
    work_weight: float = 4.0
    decode_aware: bool = True
    decode_in_cost: bool = True
    tpot_headroom: float = 1.0
    duty_window_s: float = 30.0
    decode_weight: float = 1.0
    harm_weight: float = 1.0
    """Price the decodes running on an engine wait out the prefill a choice adds there,
    in proportion to the TPOT headroom it uses (0: off)."""
    harm_past_target: float = 0.5
    """Share of each running decode's wait counted where the engine's TPOT is already past
    its target (1: all of it). Counted in full, it kept new prompts off every engine past
    target and made the others' queues the tail (small pools, issue 24)."""
    evict_weight: float = 3.0
    reuse_window: int = 256
    share_slack: float = 0.2
    share_weight: float = 10.0
    share_window: int = 32
    share_prefix_only: bool = True
    """Charge the share penalty only on an engine holding more of a prefix that more than a
    fair share of recent traffic begins with than the engine holding least of it (a system
    prompt cached on few engines), not on a hit only one conversation wants, nor on a miss."""
    max_utilisation: float = 0.9
    busy_window: int = 32
    tie_s: float = 0.005
    index_blocks: int = 0
    precise: bool = False
    """Correct the routed-prompt index with the engines' KV events (stored, removed, cleared)."""
    wait_bound: float = 1.0
    wait_cap: float = 0.3
    """Cap the aging slack at this share of the TTFT target (0: the cold prefill alone)."""
    kv_admission: bool = True
    """Add to an engine's wait the time its KV cache needs to make room for the request
    (:func:`~gateway.policies.ttft_estimate.admission_wait_s`)."""
    ttft_margin: float = 0.5
    """Prefer engines predicted within this share of the TTFT target (1: any within it)."""
    decode_cap: bool = False
    """Count the cost's decode term at most at the TPOT target (``out x min(tpot, target)``):
    with ``tpot_mean_filter``, the remedy measured for 70B pools with 8,192-token chunks."""
    tpot_mean_filter: bool = False
    """Judge TPOT feasibility on the mean over a long decode, the duty cycle read as a share
    of time (:func:`~gateway.policies.ttft_estimate.tpot_s` with ``mean``), not of steps."""
    tpot_quantile: float = 0.9
    """Judge TPOT feasibility on this quantile of the request's mean TPOT over its predicted
    output (:func:`~gateway.policies.ttft_estimate.tpot_quantile_s`); 0: the steps' reading."""
    tpot_after_prefill: bool = True
    """Judge an engine's TPOT feasibility with the prefill this choice adds beyond the least
    any engine needs added to its duty cycle: the decodes running there share their steps
    with that prefill."""

    def __post_init__(self) -> None:
        if min(self.work_weight, self.decode_weight, self.harm_weight, self.tie_s,
               self.wait_bound) < 0:  # fmt: skip
            raise ValueError(
                "work_weight, decode_weight, harm_weight, tie_s and wait_bound must be >= 0"
            )
        if not 0.0 <= self.harm_past_target <= 1.0:
            raise ValueError("harm_past_target must be within [0, 1]")
        if not 0.0 < self.max_utilisation < 1.0:
            raise ValueError("max_utilisation must be within (0, 1)")
        if self.index_blocks < 0:
            raise ValueError("index_blocks must be >= 0")
        if self.evict_weight < 0 or self.reuse_window <= 0:
            raise ValueError("evict_weight must be >= 0, reuse_window > 0")
        if self.wait_cap < 0:
            raise ValueError("wait_cap must be >= 0")
        if not 0.0 < self.ttft_margin <= 1.0:
            raise ValueError("ttft_margin must be within (0, 1]")
        if not 0.0 <= self.tpot_quantile < 1.0:
            raise ValueError("tpot_quantile must be within [0, 1)")
        if self.share_slack < 0 or self.share_weight < 0 or self.share_window <= 0:
            raise ValueError("share_slack and share_weight must be >= 0, share_window > 0")


@dataclass(frozen=True, slots=True)
class Prediction:
    """One engine's price for a request."""

    engine: EngineView
    ttft_s: float
    work_s: float
    hit_tokens: int
    tpot_s: float = 0.0
    cost: float = 0.0
    tpot_after_s: float = 0.0
    """The TPOT feasibility is judged on: ``tpot_s``, or where decodes run, theirs once the
    prefill this choice adds beyond the least any engine needs joins their steps."""
    slowdown: float = 1.0
    """How much longer the request's prefill takes in a step shared with the running decodes."""
    shared_blocks: int = 0
    """Blocks of the request's widely shared prefix (see ``share_prefix_only``) held here."""


@dataclass(frozen=True, slots=True)
class Prices:
    """The per-decision factors of every engine's cost (see the module's step 4)."""

    out: float
    """The request's predicted output tokens."""
    u: float
    """The cluster's busy share (engines with prefill queued), capped."""
    work: float
    """Seconds of later requests' time per second of prefill: ``work_weight u / (1 - u)``."""
    evict: float
    """Seconds per second of evicted prefill: ``evict_weight reuse (1 + work)``."""
    mean_running: float
    full_s: float
    """The request's cold prefill time."""
    fair: float
    """An engine's fair share of requests."""
    tpot_limit: float
    shared_floor: int = 0
    """The fewest blocks of the request's widely shared prefix any engine holds."""


@dataclass(frozen=True, slots=True)
class Candidates:
    """The engines one decision chooses among (the module's step 3), each set within the last."""

    pool: list[Prediction]
    """Within the aging bound of the least-wait engine (all engines with ``wait_bound=0``)."""
    ok: list[Prediction]
    """Feasible: meeting the TTFT target and ``tpot_headroom`` x the TPOT target."""
    safe: list[Prediction]
    """Feasible and within ``ttft_margin`` x the TTFT target."""
