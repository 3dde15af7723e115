"""Least-squares fits of the engine model's constants from calibration samples.

Prefill samples fit ``ms = a + b*extend + c*ctx + d*extend*ctx`` and decode
samples ``ms = e0 + e1*batch + e2*ctx_total`` (see :mod:`gateway.perfmodel.model`).
Both minimise the *relative* error (each row weighted by ``1/ms``, since the
times span two orders of magnitude) subject to every constant being ``>= 0``.
A term the data cannot identify (its column is zero or nearly a combination of
the terms before it) keeps the caller's fallback value and is reported as not
fitted.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

PREFILL_TERMS = ("prefill_a", "prefill_b", "prefill_c", "prefill_d")
DECODE_TERMS = ("decode_e0", "decode_e1", "decode_e2")
_MIN_SINGULAR = 1e-4
"""Smallest singular value, relative to the largest, of the unit-norm columns kept."""


class FitError(ValueError):
    """The samples cannot support a fit (none, or not finite)."""


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One single-chunk prefill: ``extend`` new tokens on ``ctx`` cached ones took ``ms``."""

    extend: float
    ctx: float
    ms: float


@dataclass(frozen=True, slots=True)
class DecodeSample:
    """One decode step of ``batch`` sequences holding ``ctx_total`` tokens took ``ms``."""

    batch: float
    ctx_total: float
    ms: float


@dataclass(frozen=True, slots=True)
class FitResult:
    """Constants (all terms, in milliseconds) and how well they explain the samples."""

    coefficients: Mapping[str, float]
    fitted: tuple[str, ...]
    points: int
    r2: float | None
    median_rel_err: float
    max_rel_err: float

    @property
    def kept(self) -> tuple[str, ...]:
        """Terms the data could not identify (their fallback value was kept)."""
        return tuple(name for name in self.coefficients if name not in self.fitted)

    def quality(self) -> str:
        """One line: points, R², median and max relative error."""
        r2 = "n/a" if self.r2 is None else f"{self.r2:.4f}"
        return (
            f"{self.points} points, R² {r2}, relative error median "
            f"{self.median_rel_err:.1%} max {self.max_rel_err:.1%}"
        )


def nnls(a: FloatArray, y: FloatArray) -> FloatArray:
    """Non-negative least squares, exactly, by trying every support set (n <= 8 columns).

    The optimum's non-zero entries are the unconstrained solution on their
    columns, so the best non-negative candidate among all subsets is optimal
    (given full column rank, which :func:`fit_linear` ensures).
    """
    n = a.shape[1]
    if n > 8:
        raise ValueError(f"nnls: {n} columns is too many for the exhaustive search")
    best = np.zeros(n)
    best_cost = float(y @ y)
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            idx = list(cols)
            sol = np.linalg.lstsq(a[:, idx], y, rcond=None)[0]
            if np.any(sol < 0):
                continue
            cost = float(np.sum((a[:, idx] @ sol - y) ** 2))
            if cost < best_cost:
                best_cost = cost
                best = np.zeros(n)
                best[idx] = sol
    return best


def identifiable(a: FloatArray) -> list[int]:
    """Columns kept in order, each only if it is not (nearly) spanned by those kept before."""
    norms = np.linalg.norm(a, axis=0)
    keep: list[int] = []
    for j in range(a.shape[1]):
        if not norms[j] > 0 or len(keep) >= a.shape[0]:
            continue
        cand = [*keep, j]
        unit = a[:, cand] / norms[cand]
        sv = np.linalg.svd(unit, compute_uv=False)
        if sv[-1] >= _MIN_SINGULAR * sv[0]:
            keep = cand
    return keep


def fit_linear(
    design: FloatArray, y: FloatArray, names: Sequence[str], fallback: Mapping[str, float]
) -> FitResult:
    """Fit ``y ≈ design @ coef`` with ``coef >= 0``, minimising relative error."""
    if design.ndim != 2 or design.shape[0] != y.shape[0] or design.shape[1] != len(names):
        raise ValueError("fit_linear: design, y and names do not match")
    if y.shape[0] == 0:
        raise FitError("no samples to fit")
    if not (np.all(np.isfinite(design)) and np.all(np.isfinite(y))):
        raise FitError("samples must be finite")
    if not np.any(y > 0):
        raise FitError("every measured time is zero or negative")
    floor = 1e-3 * float(np.max(y))
    weights = 1.0 / np.maximum(y, floor)
    weighted = design * weights[:, None]
    keep = identifiable(weighted)
    coef = np.array([max(0.0, float(fallback.get(n, 0.0))) for n in names])
    coef[keep] = 0.0
    target = (y - design @ coef) * weights
    if keep:
        scale = np.linalg.norm(weighted[:, keep], axis=0)
        coef[keep] = nnls(weighted[:, keep] / scale, target) / scale
    pred = design @ coef
    resid = y - pred
    ss_tot = float(np.sum((y - np.mean(y)) ** 2))
    r2 = 1.0 - float(resid @ resid) / ss_tot if ss_tot > 0 else None
    rel = np.abs(resid) / np.maximum(np.abs(y), floor)
    return FitResult(
        coefficients={n: float(c) for n, c in zip(names, coef, strict=True)},
        fitted=tuple(names[j] for j in keep),
        points=int(y.shape[0]),
        r2=r2,
        median_rel_err=float(np.median(rel)),
        max_rel_err=float(np.max(rel)),
    )


def fit_prefill(
    samples: Sequence[PrefillSample], fallback: Mapping[str, float] | None = None
) -> FitResult:
    """Prefill constants ``a, b, c, d`` from single-chunk prefill times."""
    e = np.array([s.extend for s in samples], dtype=np.float64)
    x = np.array([s.ctx for s in samples], dtype=np.float64)
    y = np.array([s.ms for s in samples], dtype=np.float64)
    design = np.column_stack([np.ones_like(e), e, x, e * x]) if len(samples) else np.zeros((0, 4))
    return fit_linear(design, y, PREFILL_TERMS, fallback or {})


def fit_decode(
    samples: Sequence[DecodeSample], fallback: Mapping[str, float] | None = None
) -> FitResult:
    """Decode constants ``e0, e1, e2`` from inter-token latencies."""
    bs = np.array([s.batch for s in samples], dtype=np.float64)
    ctx = np.array([s.ctx_total for s in samples], dtype=np.float64)
    y = np.array([s.ms for s in samples], dtype=np.float64)
    design = np.column_stack([np.ones_like(bs), bs, ctx]) if len(samples) else np.zeros((0, 3))
    return fit_linear(design, y, DECODE_TERMS, fallback or {})


def significant(value: float, digits: int = 6) -> float:
    """``value`` rounded to ``digits`` significant digits (for readable profiles)."""
    if value == 0 or not math.isfinite(value):
        return value
    return float(f"{value:.{digits}g}")
