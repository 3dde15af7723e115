"""Parametric workload generators, modelled on the workloads of Preble's evaluation.

Use them as ``gen:NAME?key=value&...``. Every generator accepts ``n`` (requests,
default 1000), ``seed`` (default: the options' seed), ``rate`` (req/s; sessions/s
for ``multi_turn``), ``arrival`` (``poisson`` or ``gamma``) and ``cv`` (gamma
only, default 2.0); see :mod:`gateway.sim.arrivals`. Its own parameters:

============  ===========================================================  ====
generator     parameters (defaults)                                        rate
============  ===========================================================  ====
tool_use      tools=20 tool_tokens=2000 query_tokens=200 output_tokens=60   8
              zipf=1.1
long_doc_qa   docs=30 doc_tokens=8000 question_tokens=60 output_tokens=40   4
              zipf=0 (uniform)
multi_turn    systems=4 system_tokens=500 turns=5 user_tokens=150           1
              output_tokens=200 think=10
zipf_hotspot  prefixes=50 prefix_tokens=4000 suffix_tokens=200              6
              output_tokens=100 zipf=1.5
no_sharing    prompt_tokens=1000 output_tokens=128                          4
============  ===========================================================  ====

``chat`` and ``agent`` (production-shaped sessions after Mooncake's FAST'25
traces, no 32768 clip) are documented in :mod:`gateway.sim.production`,
``conversation`` in :mod:`gateway.sim.conversation`, ``lora``
(multi-adapter traffic) in :mod:`gateway.sim.lora_traffic`.

Prompts are lists of ``(segment_id, length)`` pieces (see
:func:`~gateway.core.blocks.hashes_from_segments`): shared content (a tool
prompt, a document, a system prompt, a hot prefix, a conversation's history)
reuses a segment id, everything else gets a fresh one. Lengths of shared
content are drawn once per item, uniformly within ±50% of the mean; per-request
lengths (queries, suffixes, outputs, unique prompts) are lognormal with the
given mean and σ = 0.5. Every length is clipped to [1, 32768]. Popularity is
Zipf: item ``k`` (from 0) has weight ``1 / (k + 1) ** zipf`` (``zipf=0`` is
uniform). ``multi_turn`` picks one of ``systems`` system prompts uniformly per
session and draws session lengths from a geometric law of mean ``turns``; the
next turn arrives an exponential ``think`` time (mean, seconds) after the
previous one's arrival, and a session stops early once its prompt would exceed
32768 tokens. Its ``n`` counts requests (turns), not sessions.

Generators are deterministic: content comes from ``Random(f"{seed}:{name}")``
and timing from a second stream, so changing the arrival process keeps the
prompts.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from gateway.core.blocks import hashes_from_segments, partition_seed
from gateway.sim import conversation, lora_traffic, production
from gateway.sim.arrivals import ARRIVAL_PARAMS, arrivals_from_params
from gateway.sim.gen_common import (
    MAX_TOKENS,
    Body,
    Draft,
    Piece,
    SegmentIds,
    Setup,
    skewed_len,
    spread_len,
    zipf_cum_weights,
)
from gateway.sim.workloads import (
    GeneratorFn,
    WorkloadOptions,
    WorkloadRequest,
    check_params,
    int_param,
)

__all__ = ["GENERATORS", "MAX_TOKENS", "Piece", "SegmentIds", "spread_len", "zipf_cum_weights"]

COMMON_PARAMS = ("n", "seed", *ARRIVAL_PARAMS)
DEFAULT_N = 1000


@dataclass(frozen=True, slots=True)
class _Spec:
    fn: Body
    rate: float
    defaults: Mapping[str, int | float]


def _prefixed(items: str, item_tokens: str, tail_tokens: str, doc: str) -> Body:
    """A generator body: a Zipf-popular shared item, then a unique tail."""

    def body(s: Setup) -> list[Draft]:
        shared = s.shared(s.get_int(items), s.get_int(item_tokens))
        weights = zipf_cum_weights(len(shared), s.get_float("zipf"))
        tail, out = s.get_int(tail_tokens), s.get_int("output_tokens")
        return [
            Draft(t, [s.pick(shared, weights), s.unique(tail)], skewed_len(s.rng, out))
            for t in s.arrivals
        ]

    body.__doc__ = doc
    return body


_tool_use = _prefixed(
    "tools", "tool_tokens", "query_tokens", "Shared tool prompts (Zipf), a unique query."
)
_long_doc_qa = _prefixed(
    "docs", "doc_tokens", "question_tokens", "Many questions about a few long documents."
)
_zipf_hotspot = _prefixed(
    "prefixes", "prefix_tokens", "suffix_tokens", "Hot shared prefixes (strong Zipf skew)."
)


def _no_sharing(s: Setup) -> list[Draft]:
    """Every prompt unique."""
    prompt, out = s.get_int("prompt_tokens"), s.get_int("output_tokens")
    return [Draft(t, [s.unique(prompt)], skewed_len(s.rng, out)) for t in s.arrivals]


def _multi_turn(s: Setup) -> list[Draft]:
    """Conversations: each turn's prompt is the previous prompt + answer + a new message."""
    systems = s.shared(s.get_int("systems"), s.get_int("system_tokens"))
    turns, user, out = s.get_int("turns"), s.get_int("user_tokens"), s.get_int("output_tokens")
    think = s.get_float("think")
    stop = 1.0 / turns
    drafts: list[Draft] = []
    for j, start in enumerate(s.arrivals):
        if len(drafts) >= s.n:
            break
        history = [s.rng.choice(systems)]
        size = history[0][1]
        t = start
        for k in range(s.n - len(drafts)):
            message = s.unique(user)
            if k and size + message[1] > MAX_TOKENS:
                break
            history.append(message)
            size += message[1]
            answer = skewed_len(s.rng, out)
            drafts.append(Draft(t, list(history), answer, session=f"{s.name}-s{j}"))
            history.append((s.ids.fresh(), answer))
            size += answer
            if s.rng.random() < stop:
                break
            t += s.times.expovariate(1.0 / think) if think > 0 else 0.0
    return drafts


_SPECS: dict[str, _Spec] = {
    "tool_use": _Spec(
        _tool_use,
        8.0,
        {"tools": 20, "tool_tokens": 2000, "query_tokens": 200, "output_tokens": 60, "zipf": 1.1},
    ),
    "long_doc_qa": _Spec(
        _long_doc_qa,
        4.0,
        {"docs": 30, "doc_tokens": 8000, "question_tokens": 60, "output_tokens": 40, "zipf": 0.0},
    ),
    "multi_turn": _Spec(
        _multi_turn,
        1.0,
        {
            "systems": 4,
            "system_tokens": 500,
            "turns": 5,
            "user_tokens": 150,
            "output_tokens": 200,
            "think": 10.0,
        },
    ),
    "zipf_hotspot": _Spec(
        _zipf_hotspot,
        6.0,
        {
            "prefixes": 50,
            "prefix_tokens": 4000,
            "suffix_tokens": 200,
            "output_tokens": 100,
            "zipf": 1.5,
        },
    ),
    "no_sharing": _Spec(_no_sharing, 4.0, {"prompt_tokens": 1000, "output_tokens": 128}),
    "chat": _Spec(production.chat, production.CHAT_RATE, production.CHAT_DEFAULTS),
    "agent": _Spec(production.agent, production.AGENT_RATE, production.AGENT_DEFAULTS),
    "chat_burst": _Spec(
        production.chat_burst, production.CHAT_BURST_RATE, production.CHAT_BURST_DEFAULTS
    ),
    "conversation": _Spec(
        conversation.conversation,
        conversation.CONVERSATION_RATE,
        conversation.CONVERSATION_DEFAULTS,
    ),
    "lora": _Spec(lora_traffic.lora, lora_traffic.LORA_RATE, lora_traffic.LORA_DEFAULTS),
}


def _make(name: str, spec: _Spec) -> GeneratorFn:
    def generate(params: Mapping[str, str], options: WorkloadOptions) -> list[WorkloadRequest]:
        check_params(params, (*COMMON_PARAMS, *spec.defaults), f"gen:{name}")
        n = int_param(params, "n", DEFAULT_N, minimum=1)
        seed = int_param(params, "seed", options.seed)
        times = random.Random(f"{seed}:{name}:arrivals")
        setup = Setup(
            name=name,
            params=params,
            defaults=spec.defaults,
            n=n,
            default_rate=spec.rate,
            rng=random.Random(f"{seed}:{name}"),
            times=times,
            ids=SegmentIds(f"{name}:{seed}"),
            arrivals=arrivals_from_params(params, n, spec.rate, times),
        )
        drafts = spec.fn(setup)
        drafts.sort(key=lambda d: d.arrival)
        slo = options.default_class
        return [
            WorkloadRequest(
                id=f"{name}-{i}",
                arrival=d.arrival,
                prompt_tokens=sum(length for _, length in d.pieces),
                output_tokens=d.output_tokens,
                block_hashes=hashes_from_segments(
                    d.pieces, options.block_size, seed=partition_seed(0, lora=d.lora)
                ),
                slo=slo,
                session=d.session,
                lora=d.lora,
            )
            for i, d in enumerate(drafts)
        ]

    generate.__name__ = f"gen_{name}"
    generate.__doc__ = spec.fn.__doc__
    return generate


GENERATORS: Mapping[str, GeneratorFn] = MappingProxyType(
    {name: _make(name, spec) for name, spec in _SPECS.items()}
)
"""Generator name -> function ``(params, options) -> requests``, in arrival order."""
