"""Building blocks shared by the workload generators: ids, lengths, popularity, drafts.

A generator body receives a :class:`Setup` (its parameters, two seeded random
streams — content and timing — fresh segment ids and the default arrival
times) and returns :class:`Draft` requests; :mod:`gateway.sim.generators`
turns drafts into :class:`~gateway.sim.workloads.WorkloadRequest` objects.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gateway.core.errors import WorkloadError
from gateway.sim.arrivals import arrivals_from_params
from gateway.sim.workloads import float_param, int_param

MAX_TOKENS = 32768
"""Upper clip of every drawn length (and of a multi-turn prompt) in the Preble-style generators."""

MAX_MODEL_LEN = 131_072
"""Default cap of prompt + output in ``chat`` and ``agent`` (the presets' max_model_len)."""

_SIGMA = 0.5

Piece = tuple[int, int]
"""A prompt piece: ``(segment_id, length)``."""


class SegmentIds:
    """Fresh segment ids for one workload, tagged so that workloads do not collide."""

    def __init__(self, tag: str) -> None:
        self._base = zlib.crc32(tag.encode("utf-8")) << 32
        self._next = 0

    def fresh(self) -> int:
        self._next += 1
        return self._base + self._next


def zipf_cum_weights(count: int, exponent: float) -> list[float]:
    """Cumulative Zipf weights of ``count`` items, for :meth:`random.Random.choices`."""
    out: list[float] = []
    total = 0.0
    for k in range(count):
        total += (k + 1.0) ** -exponent  # underflows to 0 rather than overflowing
        out.append(total)
    return out


def spread_len(rng: random.Random, mean: int, cap: int = MAX_TOKENS) -> int:
    """A length uniform within ±50% of ``mean``, clipped to [1, cap]."""
    lo = min(max(1, mean - mean // 2), cap)
    hi = max(lo, min(mean + mean // 2, cap))
    return rng.randint(lo, hi)


def lognormal_len(rng: random.Random, mean: float, sigma: float, cap: int) -> int:
    """A lognormal length of mean ``mean`` and log-σ ``sigma``, clipped to [1, cap]."""
    if sigma <= 0:
        return max(1, min(cap, round(mean)))
    value = rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)
    return max(1, min(cap, round(value)))


def skewed_len(rng: random.Random, mean: int) -> int:
    """A lognormal length of mean ``mean`` (σ = 0.5), clipped to [1, MAX_TOKENS]."""
    return lognormal_len(rng, mean, _SIGMA, MAX_TOKENS)


@dataclass(slots=True)
class Draft:
    """A request before hashing: arrival, prompt pieces, output length, session, adapter."""

    arrival: float
    pieces: list[Piece]
    output_tokens: int
    session: str | None = None
    lora: str = ""


@dataclass(slots=True)
class Setup:
    """What a generator body works from."""

    name: str
    params: Mapping[str, str]
    defaults: Mapping[str, int | float]
    n: int
    default_rate: float
    rng: random.Random
    times: random.Random
    ids: SegmentIds
    arrivals: list[float]

    def get_int(self, key: str, minimum: int = 1) -> int:
        return int_param(self.params, key, int(self.defaults[key]), minimum=minimum)

    def get_float(self, key: str) -> float:
        """A float parameter; infinity is capped at 1e9."""
        return min(float_param(self.params, key, float(self.defaults[key])), 1e9)

    def get_fraction(self, key: str, *, below_one: bool = False) -> float:
        """A parameter in [0, 1] (or [0, 1) with ``below_one``)."""
        value = self.get_float(key)
        if value > 1 or (below_one and value >= 1):
            bound = "< 1" if below_one else "<= 1"
            raise WorkloadError(f"parameter {key} must be {bound}, got {value:g}")
        return value

    @property
    def rate(self) -> float:
        return float_param(self.params, "rate", self.default_rate)

    def arrivals_at(self, count: int, rate: float) -> list[float]:
        """``count`` arrivals of the spec's arrival process at ``rate`` (req/s)."""
        params = dict(self.params)
        params["rate"] = repr(rate)
        return arrivals_from_params(params, count, rate, self.times)

    def shared(self, count: int, mean: int) -> list[Piece]:
        """``count`` shared items, each with its own id and fixed length."""
        return [(self.ids.fresh(), spread_len(self.rng, mean)) for _ in range(count)]

    def unique(self, mean: int) -> Piece:
        return (self.ids.fresh(), skewed_len(self.rng, mean))

    def pick(self, items: Sequence[Piece], cum_weights: list[float]) -> Piece:
        return self.rng.choices(items, cum_weights=cum_weights)[0]


Body = Callable[[Setup], list[Draft]]
"""A generator body: setup in, drafts out (any order; the caller sorts by arrival)."""


def quantise(t: float, tick: float) -> float:
    """``t`` rounded down to a multiple of ``tick`` (unchanged when ``tick`` is 0)."""
    return math.floor(t / tick + 1e-9) * tick if tick > 0 else t
