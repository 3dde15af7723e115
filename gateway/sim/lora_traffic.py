"""``gen:lora``: multi-adapter traffic, one base model and ``adapters`` LoRA adapters on it.

A request runs on the base model with probability ``base_share``, otherwise on
adapter ``lora-k`` (``k`` from 0) drawn with Zipf popularity ``zipf`` (weight
``1 / (k + 1) ** zipf``; 0 is uniform). Its prompt is an optional ``common_tokens``
preamble identical in text for every adapter and the base model (0: none), one of
its adapter's ``systems`` system prompts (chosen uniformly; each adapter and the
base model have their own, ``system_tokens`` ±50 % each), then a unique user
message (lognormal, mean ``user_tokens``); outputs are lognormal (mean
``output_tokens``). Block hashes are seeded per adapter
(:func:`~gateway.core.blocks.partition_seed`), as vLLM keys its prefix cache: the
common preamble is cached once per adapter, never shared across adapters.

=========  ===================================================================  ====
generator  parameters (defaults)                                                rate
=========  ===================================================================  ====
lora       adapters=16 zipf=1.0 base_share=0.2 systems=2 system_tokens=1000        8
           common_tokens=0 user_tokens=300 output_tokens=150
=========  ===================================================================  ====

:func:`adapter_stats` gives what ``docs/simulator.md`` prints of such a workload.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.sim.gen_common import Draft, Piece, Setup, skewed_len, zipf_cum_weights
from gateway.sim.workloads import WorkloadRequest

LORA_RATE = 8.0
LORA_DEFAULTS: dict[str, int | float] = {
    "adapters": 16,
    "zipf": 1.0,
    "base_share": 0.2,
    "systems": 2,
    "system_tokens": 1000,
    "common_tokens": 0,
    "user_tokens": 300,
    "output_tokens": 150,
}


def adapter_name(k: int) -> str:
    """The name of adapter ``k`` (its model name in requests)."""
    return f"lora-{k}"


def lora(s: Setup) -> list[Draft]:
    """Multi-adapter traffic: Zipf-popular adapters, a base-model share, system prompts
    per adapter."""
    adapters = s.get_int("adapters")
    base_share = s.get_fraction("base_share")
    names = ["", *(adapter_name(k) for k in range(adapters))]
    common_len = s.get_int("common_tokens", minimum=0)
    common: list[Piece] = [(s.ids.fresh(), common_len)] if common_len else []
    count, mean = s.get_int("systems"), s.get_int("system_tokens")
    systems = {name: s.shared(count, mean) for name in names}
    weights = zipf_cum_weights(adapters, s.get_float("zipf"))
    user, out = s.get_int("user_tokens"), s.get_int("output_tokens")
    drafts: list[Draft] = []
    for t in s.arrivals:
        if s.rng.random() < base_share:
            name = ""
        else:
            name = s.rng.choices(names[1:], cum_weights=weights)[0]
        pieces = [*common, s.rng.choice(systems[name]), s.unique(user)]
        drafts.append(Draft(t, pieces, skewed_len(s.rng, out), lora=name))
    return drafts


@dataclass(frozen=True, slots=True)
class AdapterStats:
    """How a workload's requests spread over adapters."""

    requests: int
    base_share: float
    """Share of the requests on the base model."""
    adapters: int
    """Distinct adapters requested."""
    top_share: float
    """Share of the adapter requests on the most popular adapter."""
    top4_share: float
    """Share of the adapter requests on the four most popular adapters."""

    def line(self) -> str:
        return (
            f"{self.requests:,} requests: base {self.base_share:.0%}, {self.adapters} adapters, "
            f"top 1 {self.top_share:.0%} / top 4 {self.top4_share:.0%} of adapter traffic"
        )


def adapter_stats(requests: Sequence[WorkloadRequest]) -> AdapterStats:
    """The spread of ``requests`` over adapters."""
    counts = Counter(r.lora for r in requests if r.lora)
    on_adapters = sum(counts.values())
    ranked = [c for _, c in counts.most_common()]
    n = len(requests)
    return AdapterStats(
        requests=n,
        base_share=(n - on_adapters) / n if n else 0.0,
        adapters=len(counts),
        top_share=ranked[0] / on_adapters if on_adapters else 0.0,
        top4_share=sum(ranked[:4]) / on_adapters if on_adapters else 0.0,
    )
