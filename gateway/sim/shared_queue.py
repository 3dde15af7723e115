"""The shared-queue bound: N normal engines, one central work-conserving queue, one global KV.

The pooled bound (:mod:`gateway.sim.bound`) runs one engine N times as fast,
so a lone long prompt finishes N times sooner than any engine could: on
long-prompt traffic it is out of reach of every router. This bound keeps the
cluster's N engines at their normal speed and removes only what routing
decides:

* **one central FCFS queue** instead of a binding at arrival: a request is
  bound to an engine only when that engine can start it;
* **work conservation**: whenever an engine reaches a step boundary — or is
  idle — and has *room*, it takes requests from the head of the central queue
  before planning its step. Room for the head request means: a free sequence
  slot (``max_num_seqs``), token budget left in the next step after its
  running requests' decodes and prefill chunks (``max_num_batched_tokens``),
  and free KV blocks in the global pool for the request's first chunk.
  Engines free at the same instant take in order of least work (running
  requests, then uncached tokens pending). So a request waits in the central
  queue only while no engine could start it in its next step, and it leaves
  for the engine that can start it soonest;
* **one global KV cache** of N × ``kv_capacity_blocks``: every engine's
  :class:`~gateway.perfmodel.engine.EngineCore` works on the same
  :class:`~gateway.perfmodel.kvcache.BlockPool`, so any prefix computed
  anywhere is a hit everywhere (composition: the engines' own pools are
  replaced, the engine code is unchanged).

A request is never split across engines. This is what routing could do at
best without moving KV between engines; it is a reference *in the sense of
the model* (as the pooled bound), checked by tests, not a theorem: a router
may still beat it on a metric where FCFS is a poor order (tail latency
under overload, SLO attainment of short requests behind long ones). Requests
one engine could never hold are rejected, as the cluster rejects them.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Any, Unpack

from gateway.core.types import RequestInfo
from gateway.perfmodel.engine import EngineCore, EngineRequest, StepOutcome
from gateway.perfmodel.kvcache import BlockPool
from gateway.sim.bound import fraction_of_bound
from gateway.sim.early_stop import MissBudget
from gateway.sim.loop import ClusterSpec, RequestRecord, SimRun
from gateway.sim.metrics import summarize
from gateway.sim.runner import (
    CAPACITY_TARGET,
    CAPACITY_TOLERANCE,
    CapacityOptions,
    workload_capacity,
)
from gateway.sim.workloads import Workload

SCAN_LIMIT = 64
"""How far past requests waiting for an in-flight prefix an engine looks into the queue."""

SHARED_QUEUE_NAME = "shared_queue_bound"
"""The bound's key in ``results.json`` and its row label in reports."""


class SharedQueueSimulation:
    """One run of the shared-queue bound over ``workload`` on ``cluster``'s engines."""

    def __init__(
        self, cluster: ClusterSpec, workload: Workload, *, budget: MissBudget | None = None
    ) -> None:
        self.workload = workload
        self.budget = budget
        n = cluster.max_instances
        perf = cluster.perf
        self.pool = BlockPool(perf.kv_capacity_blocks * n)
        self.engines = [
            EngineCore(f"sq-{i}", perf, max_decode_run=cluster.max_decode_run) for i in range(n)
        ]
        for engine in self.engines:
            engine.pool = self.pool  # one global prefix cache
        self._probe = EngineCore("probe", perf)  # one engine's limits, for rejection
        self._queue: deque[RequestRecord] = deque()
        self._heap: list[tuple[float, int, int]] = []
        self._seq = 0
        self._prefilling: dict[str, tuple[EngineRequest, int]] = {}

    def run(self) -> SimRun:
        reqs = self.workload.requests
        records: list[RequestRecord] = []
        out = SimRun(policy=SHARED_QUEUE_NAME, records=records)
        heap = self._heap
        i, n = 0, len(reqs)
        while i < n or heap:
            next_arrival = reqs[i].arrival if i < n else math.inf
            if heap and heap[0][0] <= next_arrival:  # engine events first on ties
                t, _, idx = heapq.heappop(heap)
                out.events += 1
                self._apply(self.engines[idx].finish_step())
                if self.budget is not None:
                    self.budget.advance(t)
                self._dispatch(t, next_arrival, first=idx)
                continue
            src = reqs[i]
            i += 1
            out.events += 1
            record = self._record(src)
            records.append(record)
            if self.budget is not None:
                self.budget.advance(src.arrival)
                self.budget.arrived(record)
            if record.rejected is None:
                self._queue.append(record)
                self._dispatch(src.arrival, reqs[i].arrival if i < n else math.inf)
        out.preemptions = sum(e.preemptions for e in self.engines)
        out.engine_steps = sum(e.steps for e in self.engines)
        out.end_time = max((r.finish_time or 0.0 for r in records), default=0.0)
        return out

    # -- internals -------------------------------------------------------------
    def _record(self, src: Any) -> RequestRecord:
        info = RequestInfo(
            id=src.id,
            block_hashes=src.block_hashes,
            prompt_tokens=src.prompt_tokens,
            arrival=src.arrival,
            block_size=self.workload.block_size,
            slo=src.slo,
        )
        record = RequestRecord(source=src, info=info)
        record.rejected = self._probe.admissible(src.prompt_tokens, src.output_tokens)
        return record

    def _dispatch(self, now: float, horizon: float, first: int | None = None) -> None:
        """Let every engine at a step boundary take what it has room for, then step it."""
        free = [i for i, e in enumerate(self.engines) if not e.busy]
        free.sort(key=lambda i: (i != first, self._work(i), i))
        for idx in free:
            self._pull(idx, now)
        for idx in free:
            engine = self.engines[idx]
            if engine.has_work:
                # while requests wait centrally, step one step at a time: KV freed by any
                # engine may give this one room at its next boundary
                end = engine.start_step(now, now if self._queue else horizon)
                if end is not None:
                    self._seq += 1
                    heapq.heappush(self._heap, (end, self._seq, idx))

    def _work(self, idx: int) -> tuple[int, int]:
        engine = self.engines[idx]
        return (engine.num_running + engine.num_waiting, engine.pending_prefill_tokens)

    def _pull(self, idx: int, now: float) -> None:
        engine = self.engines[idx]
        queue = self._queue
        if engine.num_waiting or not queue:
            return  # a preempted request waits there first
        model = engine.model
        bs = model.block_size
        budget = model.max_num_batched_tokens - sum(
            min(r.total_tokens - r.num_computed, model.max_num_batched_tokens)
            for r in engine.running
        )
        slots = model.max_num_seqs - engine.num_running
        blocks = self.pool.available - self._growth()
        i = 0
        while i < min(len(queue), SCAN_LIMIT) and budget > 0 and slots > 0:
            record = queue[i]
            src = record.source
            limit = min(len(src.block_hashes), (src.prompt_tokens - 1) // bs)
            hit = self.pool.match(src.block_hashes, limit)
            uncached = src.prompt_tokens - hit * bs
            chunk = min(uncached, budget)
            need = model.blocks_for(src.prompt_tokens + src.output_tokens) - hit
            if need > blocks:
                break  # admitted only with KV for its whole life: no preemption
            here = self._finish_estimate(engine, uncached, now)
            if self._wait_for_prefix(
                src.block_hashes, hit=hit, limit=limit, uncached=uncached, here=here, now=now
            ):
                i += 1  # its prefix is being computed elsewhere: it waits, others pass it
                continue
            if not self._soonest(idx, here, uncached, now):
                break
            del queue[i]
            record.engine = engine.id
            record.queue_wait = now - src.arrival
            req = EngineRequest(
                id=src.id,
                prompt_tokens=src.prompt_tokens,
                block_hashes=src.block_hashes,
                output_tokens=src.output_tokens,
                arrival=src.arrival,
                payload=record,
            )
            engine.submit(req)
            self._prefilling[src.id] = (req, idx)
            budget -= chunk
            slots -= 1
            blocks -= need

    def _growth(self) -> int:
        """KV blocks the running requests of every engine will still allocate."""
        total = 0
        for engine in self.engines:
            blocks_for = engine.model.blocks_for
            for r in engine.running:
                total += max(0, blocks_for(r.prompt_tokens + r.output_tokens) - r.num_blocks)
        return total

    def _wait_for_prefix(
        self,
        hashes: tuple[int, ...],
        *,
        hit: int,
        limit: int,
        uncached: int,
        here: float,
        now: float,
    ) -> bool:
        """Whether a prefill in flight computes this prompt's next blocks, and waiting for it
        (then computing the rest) is estimated to finish sooner than computing them ``here``."""
        if hit >= limit:
            return False
        head = hashes[hit]
        for req, g in self._prefilling.values():
            other = req.block_hashes
            if len(other) <= hit or other[hit] != head:
                continue
            shared = _common_prefix(hashes, other, hit, limit)  # chained: equal up to there
            engine = self.engines[g]
            model = engine.model
            start = engine.step_end if engine.busy else now
            assert start is not None
            left = shared * model.block_size - req.num_computed
            if engine.busy and req in engine.running:  # its current step computes a chunk
                left -= model.max_num_batched_tokens
            ready = start + (model.prefill_time(left) if left > 0 else 0.0)
            rest = max(1, uncached - (shared - hit) * model.block_size)
            return ready + model.prefill_time(rest) < here
        return False

    def _soonest(self, idx: int, here: float, uncached: int, now: float) -> bool:
        """Whether engine ``idx`` (estimate ``here``) would finish this prefill no later than
        any other engine that has a free slot and nothing queued locally (estimated: its
        next boundary, then its pending prefill tokens and this prompt's, FCFS)."""
        for j, other in enumerate(self.engines):
            if j == idx or other.num_waiting or other.num_running >= other.model.max_num_seqs:
                continue
            if self._finish_estimate(other, uncached, now) < here:
                return False
        return True

    @staticmethod
    def _finish_estimate(engine: EngineCore, uncached: int, now: float) -> float:
        start = engine.step_end if engine.busy else now
        assert start is not None
        return start + engine.model.prefill_time(engine.pending_prefill_tokens + uncached)

    def _apply(self, step: StepOutcome) -> None:
        for req in step.first_tokens:
            self._prefilling.pop(req.id, None)
            record = req.payload
            assert isinstance(record, RequestRecord)
            record.first_token_time = req.client_first_token_time  # as the cluster sim
            record.cached_tokens = req.cached_tokens or 0
        for req in step.finished:
            record = req.payload
            assert isinstance(record, RequestRecord)
            record.finish_time = req.client_finish_time
            record.preemptions = req.preemptions
            if self.budget is not None:
                self.budget.finished(record)


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...], start: int, limit: int) -> int:
    """Length of the common prefix of chained hashes ``a`` and ``b`` (equal at ``start``),
    at most ``limit``: binary search, as equality at k implies equality before k."""
    lo, hi = start + 1, min(limit, len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def run_shared_queue(
    workload: Workload, cluster: ClusterSpec, *, budget: MissBudget | None = None
) -> SimRun:
    """Simulate ``workload`` under the shared-queue bound of ``cluster`` (unified engines).

    ``budget``: a capacity probe that stops once it certainly failed.
    """
    return SharedQueueSimulation(cluster, workload, budget=budget).run()


def shared_queue_capacity(
    workload: Workload,
    cluster: ClusterSpec,
    **search: Unpack[CapacityOptions],
) -> tuple[float, int]:
    """The bound's capacity, searched exactly as the policies' (``runner.search_rate``)."""
    return workload_capacity(
        workload, lambda wl, b: run_shared_queue(wl, cluster, budget=b), **search
    )


def shared_queue_summary(run: SimRun, cluster: ClusterSpec) -> dict[str, Any]:
    """The bound's entry of ``results.json``: the usual summary plus what it stands for."""
    out = summarize(run)
    n = cluster.max_instances
    out["engines"] = n
    out["construction"] = (
        f"{n} engines of normal speed fed from one central work-conserving FCFS queue, "
        f"with one global KV cache of {n}x the blocks"
    )
    return out


def attach_shared_queue(
    results: dict[str, Any],
    workload: Workload,
    cluster: ClusterSpec,
    *,
    capacity: bool = False,
    target: float = CAPACITY_TARGET,
    steps: int | None = None,
    tolerance: float = CAPACITY_TOLERANCE,
) -> SimRun:
    """Add ``shared_queue_bound`` and each policy's ``vs_shared_queue`` to a results document."""
    run = run_shared_queue(workload, cluster)
    bound = shared_queue_summary(run, cluster)
    if capacity:
        cap, probes = shared_queue_capacity(
            workload, cluster, target=target, steps=steps, tolerance=tolerance, first=run
        )
        bound["capacity_rps"] = cap
        bound["capacity_runs"] = probes
    results[SHARED_QUEUE_NAME] = bound
    for pol in results["policies"].values():
        pol["vs_shared_queue"] = fraction_of_bound(pol, bound)
    return run
