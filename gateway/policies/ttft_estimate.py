"""TTFT estimates from the engine performance model and an engine's view.

Shared by the policies that price an engine's queue in seconds
(``predicted_ttft``, ``dualmap``). An engine step carries up to
``max_num_batched_tokens`` tokens: one per running sequence (their decodes),
the rest prefill chunks. With ``r`` sequences running and ``ctx`` tokens of
KV in use, a full step takes ``step_time([(budget - r, 0)], r, ctx)``, so the
engine prefills ``(budget - r) / step`` tokens per second, and a prefill is
stretched by ``step / step_time([(budget - r, 0)], 0, 0)`` compared with the
same prefill on an idle engine. ``ctx`` is the view's KV usage times its KV
capacity (the model's capacity when the engine reports none).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

from gateway.core.types import EngineView
from gateway.perfmodel.model import PerfModel


@dataclass(frozen=True, slots=True)
class StepRate:
    """How fast ``engine`` prefills now: tokens per second, and the stretch of a prefill."""

    tokens_per_s: float
    slowdown: float


def step_rate(perf: PerfModel, engine: EngineView, ctx_tokens: int | None = None) -> StepRate:
    """The prefill throughput of one of ``engine``'s steps, given its running decodes
    (``ctx_tokens``: the context they attend to, default the view's KV in use)."""
    budget = perf.max_num_batched_tokens
    running = max(0, min(engine.num_running, budget - 1))
    chunk = budget - running
    alone = perf.step_time([(chunk, 0)], 0, 0)
    if not running:
        return StepRate(chunk / alone, 1.0)
    ctx = kv_tokens(perf, engine) if ctx_tokens is None else ctx_tokens
    mixed = perf.step_time([(chunk, 0)], running, ctx)
    return StepRate(chunk / mixed, mixed / alone)


def queued_tokens(engine: EngineView) -> int:
    """Prefill tokens ahead of a new request: the engine's pending ones and the router's queue."""
    return engine.pending_prefill_tokens + engine.router_queued_tokens


def wait_s(perf: PerfModel, engine: EngineView, rate: StepRate | None = None) -> float:
    """Seconds until ``engine`` has prefilled the work queued ahead of a new request."""
    rate = rate or step_rate(perf, engine)
    return queued_tokens(engine) / rate.tokens_per_s


def ttft_s(
    perf: PerfModel, engine: EngineView, prompt_tokens: int, cached_tokens: int, extra: int = 0
) -> float:
    """Predicted TTFT on ``engine`` of a prompt with ``cached_tokens`` already there, behind
    ``extra`` more queued prefill tokens than the view shows."""
    rate = step_rate(perf, engine)
    wait = (queued_tokens(engine) + extra) / rate.tokens_per_s
    own = perf.prefill_time(prompt_tokens - cached_tokens, cached_tokens) * rate.slowdown
    return wait + own


def kv_tokens(perf: PerfModel, engine: EngineView) -> int:
    """Tokens of KV the engine's running sequences hold (KV usage x capacity)."""
    capacity = engine.kv_capacity_blocks or perf.kv_capacity_blocks
    return int(max(0.0, min(1.0, engine.kv_usage)) * capacity) * perf.block_size


def _decode_steps(
    perf: PerfModel, engine: EngineView, context_tokens: int, ctx_tokens: int | None
) -> tuple[float, Callable[[], float]]:
    """A decode step of ``engine``'s batch one larger, and (computed on demand) the same step
    carrying a full prefill chunk."""
    batch = engine.num_running + 1
    ctx = (kv_tokens(perf, engine) if ctx_tokens is None else ctx_tokens) + context_tokens
    chunk = max(1, perf.max_num_batched_tokens - batch)
    return perf.decode_step_time(batch, ctx), lambda: perf.step_time([(chunk, 0)], batch, ctx)


def tpot_s(
    perf: PerfModel,
    engine: EngineView,
    context_tokens: int,
    *,
    duty: float = 0.0,
    ctx_tokens: int | None = None,
    mean: bool = False,
) -> float:
    """Predicted time per output token on ``engine`` for a new sequence of ``context_tokens``.

    Its decode steps run with the batch one larger; ``duty`` is the engine's recent prefill
    duty cycle (prefills that arrive while it decodes), as chunked prefill shares the step
    with a full prefill chunk. Read as a share of the *steps* that carry a chunk (the
    default), the TPOT is the steps' mean duration: a pessimistic reading, as a mixed step
    lasts many decode steps. With ``mean``, ``duty`` is the share of the engine's *time* in
    mixed steps, and the TPOT the mean over a long decode, ``1 / ((1 - duty) / step + duty
    / mixed)``: on 8 x ``llama3-70b-tp2-h100`` (8,192-token chunks of a 70B model) the
    steps' reading predicted 0.10-0.15 s where decodes took 0.03-0.05 s. The prefill
    queued ahead of the request is done before its first token and does not count.
    ``ctx_tokens`` is the context the running batch attends to (default: the view's KV in
    use, which counts a prefix shared by many sequences once)."""
    step, mixed_step = _decode_steps(perf, engine, context_tokens, ctx_tokens)
    duty = max(0.0, min(1.0, duty))
    if duty > 0:
        mixed = mixed_step()
        if mean:
            return 1.0 / ((1.0 - duty) / step + duty / mixed)
        step = (1.0 - duty) * step + duty * mixed
    return step


def tpot_quantile_s(
    perf: PerfModel,
    engine: EngineView,
    context_tokens: int,
    *,
    duty: float,
    output_tokens: float,
    quantile: float,
    ctx_tokens: int | None = None,
) -> float:
    """The ``quantile`` of a new sequence's mean TPOT over its ``output_tokens`` on ``engine``.

    ``duty`` is read as the share of the engine's *time* in mixed steps (as with
    :func:`tpot_s`'s ``mean``), so a step carries a prefill chunk with probability
    ``p = (duty / mixed) / ((1 - duty) / step + duty / mixed)``. Of the request's ``k =
    output_tokens - 1`` decode steps, the number ``m`` that are mixed is taken as Poisson
    with mean ``k p`` (normal beyond a mean of 30); the reading is ``step + m_q (mixed -
    step) / k`` at the ``quantile`` ``m_q``: the TPOT the request exceeds with chance ``1 -
    quantile``. A long decode sees about the time share; a short one most likely no mixed
    step at all, but a single one in it weighs ``(mixed - step) / k``. The steps' reading
    (the default of :func:`tpot_s`) charges every decode the duty-weighted mixed step."""
    step, mixed_step = _decode_steps(perf, engine, context_tokens, ctx_tokens)
    duty = max(0.0, min(1.0, duty))
    if duty <= 0:
        return step
    mixed = mixed_step()
    k = max(1, math.ceil(output_tokens) - 1)
    p = (duty / mixed) / ((1.0 - duty) / step + duty / mixed)
    return step + min(k, poisson_quantile(k * p, quantile)) * (mixed - step) / k


def poisson_quantile(mean: float, quantile: float) -> int:
    """The least ``m`` with ``P(X <= m) >= quantile`` for ``X`` Poisson with ``mean`` (the
    normal approximation, rounded up, past a mean of 30)."""
    q = max(0.0, min(quantile, 1.0 - 1e-9))
    if mean <= 0:
        return 0
    if mean > 30:
        return max(0, math.ceil(mean + NormalDist().inv_cdf(q) * math.sqrt(mean) - 0.5))
    term = cdf = math.exp(-mean)
    m = 0
    while cdf < q:
        m += 1
        term *= mean / m
        cdf += term
    return m


def admission_wait_s(
    perf: PerfModel, engine: EngineView, new_tokens: int, output_tokens: float
) -> float:
    """Seconds a new request's prefill waits for KV space on ``engine`` beyond its queue.

    vLLM admits a waiting request only when its blocks fit beside the running sequences'
    (and those of the prefill queued ahead); near a full cache the running decodes also
    preempt one another for blocks. When the KV in use, the queued prefill and the request's
    ``new_tokens`` exceed the capacity, the request waits for running sequences to finish:
    about half of ``output_tokens`` decode steps of the current batch. 0 when the request
    fits or nothing runs. (Scaling that by the share of the cache to free predicted waits of
    0.6 s where the simulated engines took 20 s: at 99.9 % KV the freed blocks go to the
    running sequences' own growth first.)"""
    capacity = (engine.kv_capacity_blocks or perf.kv_capacity_blocks) * perf.block_size
    used = kv_tokens(perf, engine)
    excess = used + queued_tokens(engine) + new_tokens - capacity
    if excess <= 0 or used <= 0 or not engine.num_running:
        return 0.0
    step = perf.decode_step_time(engine.num_running, used)
    return max(1.0, output_tokens) / 2.0 * step
