"""Stopping a capacity probe as soon as it has certainly failed.

A capacity search only asks whether at least ``target`` of the requests met
their SLO. Once more than ``n - ceil(target * n)`` requests have certainly
missed it, the answer is "no" whatever happens next, so the rest of the
simulation — in an overloaded probe, the slowest part — is skipped. A request
has certainly missed when it was rejected, when its TTFT deadline (arrival +
``slo.ttft_s``) passed without a first token, or (both-target criterion) when it
finished with a TPOT above ``slo.tpot_s``. Stopped runs are never reported as
results; they only answer the probe, exactly as the full run would.
"""

from __future__ import annotations

import heapq
import math
from typing import Any

from gateway.perfmodel.engine import EngineCore, StepOutcome
from gateway.sim.loop import RequestRecord, SimRun, Simulation
from gateway.sim.workloads import WorkloadRequest


class ProbeFailed(Exception):  # noqa: N818 - a signal, not an error
    """Raised inside a simulation once its attainment can no longer reach the target."""


class MissBudget:
    """Counts requests that certainly missed their SLO; raises past the allowed number."""

    def __init__(self, n: int, target: float, *, ttft_only: bool = False) -> None:
        self.allowed = n - math.ceil(target * n - 1e-9)
        self.ttft_only = ttft_only
        self.misses = 0
        self._missed: set[str] = set()
        self._deadlines: list[tuple[float, int, RequestRecord]] = []
        self._seq = 0

    def miss(self, record: RequestRecord) -> None:
        """Count ``record`` as a miss (once)."""
        rid = record.source.id
        if rid in self._missed:
            return
        self._missed.add(rid)
        self.add_misses(1)

    def add_misses(self, count: int) -> None:
        """Count ``count`` misses of requests the run never sees (rejected up front)."""
        self.misses += count
        if self.misses > self.allowed:
            raise ProbeFailed(f"{self.misses} misses, {self.allowed} allowed")

    def arrived(self, record: RequestRecord) -> None:
        if record.rejected is not None:
            self.miss(record)
            return
        self._seq += 1
        deadline = record.source.arrival + record.info.slo.ttft_s
        heapq.heappush(self._deadlines, (deadline, self._seq, record))

    def advance(self, now: float) -> None:
        """Count every request whose TTFT deadline passed before ``now`` without a first token."""
        heap = self._deadlines
        while heap and heap[0][0] < now:
            deadline, _, record = heapq.heappop(heap)
            first = record.first_token_time
            if record.rejected is not None or first is None or first > deadline:
                self.miss(record)

    def finished(self, record: RequestRecord) -> None:
        if self.ttft_only:
            return
        tpot = record.tpot
        if tpot is not None and tpot > record.info.slo.tpot_s:
            self.miss(record)


class EarlyStopSimulation(Simulation):
    """A :class:`Simulation` that raises :class:`ProbeFailed` once ``budget`` is spent."""

    def __init__(self, *args: Any, budget: MissBudget, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.budget = budget

    def _arrive(self, src: WorkloadRequest, block_size: int, out: SimRun) -> RequestRecord:
        self.budget.advance(src.arrival)
        record = super()._arrive(src, block_size, out)
        self.budget.arrived(record)
        return record

    def _submit(self, record: RequestRecord, now: float, horizon: float) -> None:
        super()._submit(record, now, horizon)
        if record.rejected is not None:  # an engine turned it away
            self.budget.miss(record)

    def _apply(self, engine: EngineCore, step: StepOutcome, now: float) -> None:
        super()._apply(engine, step, now)
        budget = self.budget
        budget.advance(now)
        for req in step.finished:
            record = req.payload
            if isinstance(record, RequestRecord):
                budget.finished(record)
