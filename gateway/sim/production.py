"""Production-shaped generators: ``chat`` and ``agent``, after Mooncake's FAST'25 traces.

Both are sessions of turns. A session opens with a first prompt; after each
turn it continues with probability ``follow`` — so about ``follow`` of all
requests continue a conversation — and the next prompt is the previous prompt
+ the previous answer (its ``output_tokens``) + a new piece (a user turn, or a
tool's result). The next turn arrives ``max(think', tick)`` seconds after the
previous one (``think'`` exponential of mean ``think``; open loop, whether or
not the answer is done). New sessions start at ``rate × (1 − follow)`` per
second (the spec's arrival process), so the request rate is ``rate``; arrival
times are then rounded down to multiples of ``tick`` seconds (``tick=0``: not
quantised). A session ends early when its next prompt + output would pass
``max_len``; every length is clipped so that prompt + output <= ``max_len``.

===========  ==============================================================  =====
generator    parameters (defaults)                                           rate
===========  ==============================================================  =====
chat         system_tokens=512 user_tokens=10800 user_sigma=1.15             3.34
             followup_tokens=1200 followup_sigma=1.2 output_tokens=340
             output_sigma=0.8 follow=0.3 think=90 tick=3 max_len=131072
agent        system_tokens=512 tools=2 tool_tokens=5000 tool_share=0.7       6.56
             zipf=0.5 task_tokens=4200 task_sigma=1.0 result_tokens=1500
             result_sigma=1.0 output_tokens=180 output_sigma=0.8 follow=0.3
             think=10 tick=0 max_len=131072
===========  ==============================================================  =====

``chat``: one system prompt of ``system_tokens`` in front of EVERY request,
then the user's first message (lognormal: mean ``user_tokens``, log-σ
``user_sigma``); follow-up messages are lognormal (``followup_*``).
``agent``: every prompt starts with the ``system_tokens`` header; a share
``tool_share`` of the sessions then carry one of ``tools`` hot tool prompts
(lengths evenly spaced from 0.5x to 1.5x ``tool_tokens``, the shortest the
most popular: Zipf ``zipf``; by default 2,500 and 7,500 tokens, so that with
the header they span about 6 and 15 of Mooncake's 512-token blocks), then a task
(lognormal ``task_*``); each further step appends the model's output and a
tool result (lognormal ``result_*``). Outputs are lognormal (``output_*``,
clipped to 8192). The rates are the traces' (12,031 and 23,608 requests in
one hour); ``docs/simulator.md`` compares the statistics with the traces'.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from gateway.core.errors import WorkloadError
from gateway.sim.gen_common import (
    MAX_MODEL_LEN,
    Draft,
    Piece,
    Setup,
    lognormal_len,
    quantise,
    zipf_cum_weights,
)

OUTPUT_CAP = 8192
"""Largest output length drawn by ``chat`` and ``agent``."""

_SESSION_DEFAULTS: dict[str, int | float] = {
    "output_sigma": 0.8,
    "follow": 0.3,
    "tick": 0.0,
    "max_len": MAX_MODEL_LEN,
}

CHAT_DEFAULTS: dict[str, int | float] = {
    **_SESSION_DEFAULTS,
    "system_tokens": 512,
    "user_tokens": 10800,
    "user_sigma": 1.15,
    "followup_tokens": 1200,
    "followup_sigma": 1.2,
    "output_tokens": 340,
    "think": 90.0,
    "tick": 3.0,
}
CHAT_RATE = 12_031 / 3600
"""Requests per second of Mooncake's conversation trace."""

AGENT_DEFAULTS: dict[str, int | float] = {
    **_SESSION_DEFAULTS,
    "system_tokens": 512,
    "tools": 2,
    "tool_tokens": 5000,
    "tool_share": 0.7,
    "zipf": 0.5,
    "task_tokens": 4200,
    "task_sigma": 1.0,
    "result_tokens": 1500,
    "result_sigma": 1.0,
    "output_tokens": 180,
    "think": 10.0,
}
AGENT_RATE = 23_608 / 3600
"""Requests per second of Mooncake's tool&agent trace."""


@dataclass(frozen=True, slots=True)
class _Shape:
    follow: float
    think: float
    tick: float
    max_len: int
    out_mean: int
    out_sigma: float


def _shape(s: Setup) -> _Shape:
    max_len = s.get_int("max_len", minimum=2)
    return _Shape(
        follow=s.get_fraction("follow", below_one=True),
        think=s.get_float("think"),
        tick=s.get_float("tick"),
        max_len=max_len,
        out_mean=s.get_int("output_tokens"),
        out_sigma=s.get_float("output_sigma"),
    )


def _sessions(
    s: Setup,
    shape: _Shape,
    opening: Callable[[int], list[Piece]],
    next_piece: Callable[[], int],
) -> list[Draft]:
    """Sessions of growing prompts; the first ``s.n`` requests by arrival.

    ``opening(budget)`` builds a first prompt of at most ``budget`` tokens;
    ``next_piece()`` draws the length of the new piece of a further turn.
    """
    rng, times = s.rng, s.times
    out_cap = min(OUTPUT_CAP, shape.max_len - 1)
    starts = s.arrivals_at(s.n, s.rate * (1.0 - shape.follow))
    drafts: list[Draft] = []
    for j, start in enumerate(starts):
        session = f"{s.name}-s{j}"
        out = lognormal_len(rng, shape.out_mean, shape.out_sigma, out_cap)
        pieces = opening(shape.max_len - out)
        size = sum(length for _, length in pieces)
        out = max(1, min(out, shape.max_len - size))
        t = start
        while True:
            drafts.append(Draft(quantise(t, shape.tick), list(pieces), out, session))
            if rng.random() >= shape.follow:
                break
            nxt = lognormal_len(rng, shape.out_mean, shape.out_sigma, out_cap)
            piece = next_piece()
            if size + out + piece + nxt > shape.max_len:
                break
            pieces.append((s.ids.fresh(), out))
            pieces.append((s.ids.fresh(), piece))
            size += out + piece
            out = nxt
            gap = times.expovariate(1.0 / shape.think) if shape.think > 0 else 0.0
            t += max(gap, shape.tick)
    drafts.sort(key=lambda d: d.arrival)
    return drafts[: s.n]


def chat(s: Setup) -> list[Draft]:
    """Chat sessions behind one shared system prompt; long-tailed prompts; 3-second ticks."""
    shape = _shape(s)
    system = (s.ids.fresh(), s.get_int("system_tokens"))
    if system[1] >= shape.max_len - 1:
        raise WorkloadError("parameter system_tokens must leave room below max_len")
    user, user_sigma = s.get_int("user_tokens"), s.get_float("user_sigma")
    follow_mean, follow_sigma = s.get_int("followup_tokens"), s.get_float("followup_sigma")

    def opening(budget: int) -> list[Piece]:
        first = lognormal_len(s.rng, user, user_sigma, max(1, budget - system[1]))
        return [system, (s.ids.fresh(), first)]

    def next_piece() -> int:
        return lognormal_len(s.rng, follow_mean, follow_sigma, shape.max_len)

    return _sessions(s, shape, opening, next_piece)


def tool_lengths(count: int, mean: int) -> list[int]:
    """``count`` tool-prompt lengths evenly spaced from 0.5x to 1.5x ``mean`` (mean ``mean``)."""
    if count == 1:
        return [mean]
    return [max(1, round(mean * (0.5 + k / (count - 1)))) for k in range(count)]


def agent(s: Setup) -> list[Draft]:
    """Agent loops: a shared header, hot tool prompts, steps that append tool results."""
    shape = _shape(s)
    system = (s.ids.fresh(), s.get_int("system_tokens"))
    tools = [(s.ids.fresh(), n) for n in tool_lengths(s.get_int("tools"), s.get_int("tool_tokens"))]
    if system[1] + max(n for _, n in tools) >= shape.max_len - 1:
        raise WorkloadError("parameters system_tokens + tool_tokens must leave room below max_len")
    weights = zipf_cum_weights(len(tools), s.get_float("zipf"))
    share = s.get_fraction("tool_share")
    task, task_sigma = s.get_int("task_tokens"), s.get_float("task_sigma")
    result, result_sigma = s.get_int("result_tokens"), s.get_float("result_sigma")

    def opening(budget: int) -> list[Piece]:
        head = [system]
        if s.rng.random() < share:
            head.append(s.pick(tools, weights))
        used = sum(n for _, n in head)
        head.append((s.ids.fresh(), lognormal_len(s.rng, task, task_sigma, max(1, budget - used))))
        return head

    def next_piece() -> int:
        return lognormal_len(s.rng, result, result_sigma, shape.max_len)

    return _sessions(s, shape, opening, next_piece)


CHAT_BURST_DEFAULTS: dict[str, int | float] = {
    **_SESSION_DEFAULTS,
    "system_tokens": 512,
    "user_tokens": 12000,
    "pareto_alpha": 1.3,
    "followup_tokens": 1200,
    "followup_sigma": 1.2,
    "output_tokens": 340,
    "think": 60.0,
    "tick": 1.0,
    "burst_cv": 3.0,
}
CHAT_BURST_RATE = CHAT_RATE
"""``chat_burst`` arrives at the conversation trace's rate."""


def pareto_len(rng: random.Random, mean: float, alpha: float, cap: int) -> int:
    """A Pareto length of mean ``mean`` and tail index ``alpha`` (> 1), clipped to [1, cap]."""
    scale = mean * (alpha - 1.0) / alpha
    value: float = scale * (1.0 - rng.random()) ** (-1.0 / alpha)
    return max(1, min(cap, round(value)))


def chat_burst(s: Setup) -> list[Draft]:
    """Chat sessions behind one shared first block, Pareto-tailed first messages, and
    sessions that start in bursts (Gamma gaps of CV ``burst_cv`` unless ``arrival`` is set)."""
    if "arrival" not in s.params:
        s = replace(s, params={**s.params, "arrival": "gamma", "cv": repr(s.get_float("burst_cv"))})
    shape = _shape(s)
    system = (s.ids.fresh(), s.get_int("system_tokens"))
    if system[1] >= shape.max_len - 1:
        raise WorkloadError("parameter system_tokens must leave room below max_len")
    alpha = s.get_float("pareto_alpha")
    if alpha <= 1.0:
        raise WorkloadError(f"parameter pareto_alpha must be > 1, got {alpha:g}")
    user = s.get_int("user_tokens")
    follow_mean, follow_sigma = s.get_int("followup_tokens"), s.get_float("followup_sigma")

    def opening(budget: int) -> list[Piece]:
        return [system, (s.ids.fresh(), pareto_len(s.rng, user, alpha, max(1, budget - system[1])))]

    def next_piece() -> int:
        return lognormal_len(s.rng, follow_mean, follow_sigma, shape.max_len)

    return _sessions(s, shape, opening, next_piece)
