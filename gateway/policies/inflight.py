"""What a router has sent each engine: the context in flight, and recent prefill work.

A decode step's cost grows with the context every running sequence attends to.
An engine's KV usage cannot tell it: a prefix shared by many sequences is held
once but attended to by each. The router knows the prompts it sent, so it
keeps, per engine, how many requests it has in flight there and their prompt
tokens; ``attended`` scales that mean to the engine's running count (which, in
the gateway, includes other replicas' requests). Memory: at most
``max_requests`` requests are tracked (the oldest are dropped first, so a lost
finish cannot grow it).

:class:`RoutedWork` keeps, per engine, the prefill seconds the router sent there, decayed
with a time constant: divided by that constant it is the engine's recent prefill duty cycle,
the share of its steps that carry a prefill chunk, which stretches every decode there
(chunked prefill shares the step). One float pair per engine.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from gateway.core.types import EngineId, EngineView
from gateway.perfmodel.model import PerfModel
from gateway.policies.ttft_estimate import kv_tokens, tpot_s


class InFlightContext:
    """Requests in flight per engine and the prompt tokens they carry."""

    def __init__(self, max_requests: int = 1 << 20) -> None:
        if max_requests <= 0:
            raise ValueError("max_requests must be positive")
        self.max_requests = max_requests
        self._held: OrderedDict[str, tuple[EngineId, int]] = OrderedDict()
        self._per: dict[EngineId, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def add(self, request_id: str, engine: EngineId, tokens: int) -> None:
        """``request_id`` (``tokens`` of prompt) now runs on ``engine``; repeats are ignored."""
        if request_id in self._held:
            return
        self._held[request_id] = (engine, tokens)
        self._count(engine, 1, tokens)
        while len(self._held) > self.max_requests:
            self.finish(next(iter(self._held)))

    def finish(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None:
            self._count(held[0], -1, -held[1])

    def requests(self, engine: EngineId) -> int:
        return self._per.get(engine, (0, 0))[0]

    def mean_context(self, engine: EngineId, default: float) -> float:
        count, total = self._per.get(engine, (0, 0))
        return total / count if count else default

    def attended(self, perf: PerfModel, engine: EngineView, default_context: int) -> int:
        """Context tokens ``engine``'s running sequences attend to: its running count times the
        mean prompt in flight there, at least the KV the view reports in use."""
        mean = self.mean_context(engine.id, float(default_context))
        return max(kv_tokens(perf, engine), int(engine.num_running * mean))

    def remove_engine(self, engine: EngineId) -> None:
        self._per.pop(engine, None)
        for rid in [r for r, (e, _) in self._held.items() if e == engine]:
            del self._held[rid]

    def _count(self, engine: EngineId, requests: int, tokens: int) -> None:
        count, total = self._per.get(engine, (0, 0))
        count, total = count + requests, total + tokens
        if count > 0:
            self._per[engine] = (count, total)
        else:
            self._per.pop(engine, None)


class RoutedWork:
    """Prefill seconds routed to each engine, decayed with time constant ``window_s``."""

    def __init__(self, window_s: float = 10.0) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._work: dict[EngineId, tuple[float, float]] = {}  # decayed seconds, as of when

    def _at(self, engine: EngineId, now: float) -> float:
        work, at = self._work.get(engine, (0.0, now))
        return work * math.exp(-max(0.0, now - at) / self.window_s)

    def add(self, engine: EngineId, seconds: float, now: float) -> None:
        self._work[engine] = (self._at(engine, now) + seconds, now)

    def add_prefill(
        self, perf: PerfModel, engine: EngineId, prompt_tokens: int, hit_tokens: int, now: float
    ) -> None:
        """Count the prefill of a prompt routed to ``engine`` with ``hit_tokens`` cached there."""
        hit = max(0, min(hit_tokens, prompt_tokens))
        self.add(engine, perf.prefill_time(prompt_tokens - hit, hit), now)

    def duty(self, engine: EngineId, now: float) -> float:
        """The share of recent time ``engine`` spent on prefill the router sent it."""
        return self._at(engine, now) / self.window_s

    def remove_engine(self, engine: EngineId) -> None:
        self._work.pop(engine, None)

    def __contains__(self, engine: object) -> bool:
        return engine in self._work


def routed_tpot_s(
    perf: PerfModel,
    engine: EngineView,
    prompt_tokens: int,
    *,
    flight: InFlightContext,
    work: RoutedWork,
    now: float,
) -> float:
    """Predicted time per output token of a new ``prompt_tokens`` request on ``engine``: the
    batch one larger, attending to the context in flight there, a share of its steps (the
    prefill duty cycle routed there) carrying a prefill chunk."""
    ctx = flight.attended(perf, engine, prompt_tokens)
    return tpot_s(perf, engine, prompt_tokens, duty=work.duty(engine.id, now), ctx_tokens=ctx)
