"""The discrete-event simulator: a virtual clock, arrivals, policy decisions, engine steps.

One :class:`Simulation` runs one policy over one workload on a cluster of
:class:`~gateway.perfmodel.engine.EngineCore` instances. Events are arrivals
(from the workload, in order) and engine step ends (from a heap). Ties go to
engine events first, so a policy sees every step that ended by then. The run
is deterministic for a seed: nothing reads a real clock except the optional
``timer`` used to measure how long each routing decision takes.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from gateway.core.types import ClusterView, EngineRole, EngineView, RequestInfo
from gateway.flow import FlowController, FlowOutcome, FlowSettings, SaturationDetector
from gateway.flow.saturation import SaturationSettings
from gateway.perfmodel.engine import EngineCore, EngineRequest, StepOutcome
from gateway.perfmodel.model import PerfModel
from gateway.policies.base import Policy
from gateway.policies.dispatcher import Dispatcher
from gateway.policies.pd_rule import PDSettings
from gateway.policies.router_queues import QueueFullError
from gateway.policies.session_affinity import SessionAffinity, StickySettings
from gateway.sim.workloads import Workload, WorkloadRequest


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """The simulated cluster: ``instances`` identical engines of one perf model."""

    instances: int
    perf: PerfModel
    priority_groups: bool = False
    max_decode_run: int = 256
    scale_events: tuple[tuple[float, int], ...] = ()
    """(time, instances): from that time on, only that many engines take new requests."""
    prefill_instances: int = 0
    """P/D: the first this many engines are prefill-only, the rest decode-only (0: unified)."""
    kv_bandwidth_gbps: float = 25.0
    """P/D: KV transfer bandwidth between a prefill and a decode engine."""
    engine_ids: tuple[str, ...] = ()
    """Names of the engines (default ``sim-<i>``)."""
    scrape_interval_s: float = 0.0
    """Policies see engine-reported load (waiting, running, KV usage) as a gateway scraping
    every this many seconds would (0: exact, fresh at every decision)."""
    pd: PDSettings = field(default_factory=PDSettings)
    """P/D: the thresholds of the local-or-remote prefill rule (``PolicyContext.pd`` too)."""
    adapter_view: bool = True
    """With LoRA traffic, views carry each engine's adapters (of its running and waiting
    requests) and ``max_loras``, as the gateway's ``vllm:lora_requests_info`` scrape does;
    False hides them (every engine then looks like a free slot to the adapter filter)."""
    sessions: StickySettings | None = None
    """Session affinity for requests with a session, as the gateway's ``sessions`` (None: off)."""
    flow: FlowSettings | None = None
    """Flow control in front of the policy, as the gateway's ``flow_control`` (None: off)."""
    saturation: SaturationSettings = field(default_factory=SaturationSettings)
    """When flow control holds requests (with ``flow``)."""

    def __post_init__(self) -> None:
        if self.instances <= 0 or any(n <= 0 for _, n in self.scale_events):
            raise ValueError("instances must be positive")
        if self.prefill_instances and not 0 < self.prefill_instances < self.instances:
            raise ValueError("prefill_instances must leave at least one engine of each role")
        if self.kv_bandwidth_gbps <= 0:
            raise ValueError("kv_bandwidth_gbps must be positive")

    def role(self, index: int) -> EngineRole:
        if not self.prefill_instances:
            return EngineRole.BOTH
        return EngineRole.PREFILL if index < self.prefill_instances else EngineRole.DECODE

    @property
    def max_instances(self) -> int:
        return max([self.instances, *(n for _, n in self.scale_events)])

    def engine_id(self, index: int) -> str:
        """``engine_ids[index]`` (a live cluster's URLs, so hash-placed policies place the
        engines alike), else ``sim-<index>``."""
        return self.engine_ids[index] if index < len(self.engine_ids) else f"sim-{index}"


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request."""

    source: WorkloadRequest
    info: RequestInfo
    engine: str = ""
    rejected: str | None = None
    cached_tokens: int = 0
    expected_hit_tokens: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    preemptions: int = 0
    held: bool = False
    queue_wait: float = 0.0
    prefill_engine: str | None = None
    kv_transfer_s: float = 0.0
    pd_reason: str = ""
    flow_wait: float = 0.0
    """Seconds the request waited in flow control's queue."""
    refused_at: float | None = None
    """When flow control refused, shed or timed it out (``rejected`` says which)."""

    @property
    def ttft(self) -> float | None:
        t = self.first_token_time
        return None if t is None else t - self.source.arrival

    @property
    def e2e(self) -> float | None:
        t = self.finish_time
        return None if t is None else t - self.source.arrival

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (None for one-token outputs)."""
        if self.finish_time is None or self.first_token_time is None:
            return None
        n = self.source.output_tokens
        return None if n <= 1 else (self.finish_time - self.first_token_time) / (n - 1)


@dataclass(slots=True)
class SimRun:
    """The outcome of one simulation."""

    policy: str
    records: list[RequestRecord]
    load_cv: list[tuple[float, float]] = field(default_factory=list)
    decision_seconds: list[float] = field(default_factory=list)
    preemptions: int = 0
    migrations: int = 0
    engine_steps: int = 0
    events: int = 0
    lora_loads: int | None = None
    """Adapters the engines read from disk (None: a workload without LoRA traffic)."""
    end_time: float = 0.0


class Simulation:
    """Runs one policy over one workload on a simulated cluster."""

    def __init__(
        self,
        cluster: ClusterSpec,
        policy: Policy,
        workload: Workload,
        *,
        timer: Callable[[], float] | None = None,
    ) -> None:
        self.cluster = cluster
        self.workload = workload
        self.policy = policy
        sessions = SessionAffinity(cluster.sessions) if cluster.sessions is not None else None
        self.dispatcher = Dispatcher(
            policy, timer=timer, pd=cluster.pd, perf=cluster.perf, sessions=sessions
        )
        self.engines = [
            EngineCore(
                cluster.engine_id(i),
                cluster.perf,
                priority_groups=cluster.priority_groups,
                track_cache_events=policy.wants_cache_events,
                max_decode_run=cluster.max_decode_run,
            )
            for i in range(cluster.max_instances)
        ]
        self._active = cluster.instances
        self._scale = sorted(cluster.scale_events)
        self._index = {e.id: i for i, e in enumerate(self.engines)}
        self._versions = [0] * len(self.engines)
        self._heap: list[tuple[float, int, int, int]] = []
        self._transfers: list[tuple[float, int, RequestRecord]] = []
        self._seq = 0
        self._scrape: list[tuple[int, int, float]] = []
        self._next_scrape = -math.inf
        self._lora = any(r.lora for r in workload.requests)
        self.flow: FlowController | None = None
        if cluster.flow is not None:
            detector = SaturationDetector(cluster.saturation, cluster.perf)
            self.flow = FlowController(cluster.flow, detector)

    def run(self) -> SimRun:
        reqs = self.workload.requests
        block_size = self.workload.block_size
        records: list[RequestRecord] = []
        out = SimRun(policy=self.policy.name, records=records)
        heap = self._heap
        n = len(reqs)
        ai = 0
        transfers = self._transfers
        flow = self.flow
        while ai < n or heap or transfers or (flow is not None and len(flow.queue)):
            next_arrival = reqs[ai].arrival if ai < n else math.inf
            if flow is not None and len(flow.queue):
                deadline = flow.next_deadline()
                first = min(
                    next_arrival,
                    heap[0][0] if heap else math.inf,
                    transfers[0][0] if transfers else math.inf,
                )
                if deadline is not None and deadline < first:  # a wait times out first
                    out.events += 1
                    self._flow_pump(deadline, next_arrival)
                    continue
            if (
                transfers
                and transfers[0][0] <= next_arrival
                and (not heap or transfers[0][0] <= heap[0][0])
            ):
                t, _, record = heapq.heappop(transfers)
                out.events += 1
                self._submit(record, t, next_arrival)  # the KV arrived: decode it
                continue
            if heap and heap[0][0] <= next_arrival:
                t, _, idx, version = heapq.heappop(heap)
                if version != self._versions[idx]:
                    continue
                out.events += 1
                engine = self.engines[idx]
                self._apply(engine, engine.finish_step(), t)
                self._start(idx, t, next_arrival)
                if len(self.dispatcher.queues):
                    self._release(engine.id, t, next_arrival)
                if flow is not None and len(flow.queue):
                    self._flow_pump(t, next_arrival)
                continue
            src = reqs[ai]
            ai += 1
            out.events += 1
            while self._scale and self._scale[0][0] <= src.arrival:
                self._active = self._scale.pop(0)[1]
            horizon = reqs[ai].arrival if ai < n else math.inf
            record = self._arrive(src, block_size, out)
            records.append(record)
            if record.rejected is None and not record.held and not record.flow_wait < 0:
                self._submit(record, src.arrival, horizon)
            if len(self.dispatcher.queues):
                for target in self.dispatcher.rebalance(self._view(src.arrival), src.arrival):
                    self._release(target, src.arrival, horizon)
        out.decision_seconds = self.dispatcher.times.samples
        out.preemptions = sum(e.preemptions for e in self.engines)
        out.engine_steps = sum(e.steps for e in self.engines)
        out.migrations = self.dispatcher.migrated
        if self._lora:
            out.lora_loads = sum(e.adapters.loads for e in self.engines)
        out.end_time = max((r.finish_time or 0.0 for r in records), default=0.0)
        return out

    # -- events ----------------------------------------------------------------
    def _arrive(self, src: WorkloadRequest, block_size: int, out: SimRun) -> RequestRecord:
        now = src.arrival
        active = self.engines[: self._active]
        out.load_cv.append((now, load_cv(e.pending_prefill_tokens for e in active)))
        info = RequestInfo(
            id=src.id,
            block_hashes=src.block_hashes,
            prompt_tokens=src.prompt_tokens,
            arrival=now,
            block_size=block_size,
            slo=src.slo,
            lora=src.lora,
            session=src.session or "",
            tenant=src.tenant,
            priority=src.priority,
        )
        record = RequestRecord(source=src, info=info)
        if self.flow is not None and not self._flow_admit(record, now):
            return record
        self._route(record, now)
        return record

    def _flow_admit(self, record: RequestRecord, now: float) -> bool:
        """Flow control's answer: True to route now; else queued (``flow_wait`` -1 until
        released) or refused."""
        flow = self.flow
        assert flow is not None
        src = record.source
        item = flow.make_item(
            src.id,
            src.tenant,
            src.priority,
            src.prompt_tokens,
            now,
            handle=record,
            payload=record.info,
        )
        got = flow.submit(item, self._view(now), now)
        if got.shed is not None:
            self._refuse(got.shed.handle, "shed", now)
        if got.outcome is FlowOutcome.ADMITTED:
            return True
        if got.outcome is FlowOutcome.REFUSED:
            self._refuse(record, "queue_full", now)
        else:
            record.flow_wait = -1.0
        return False

    @staticmethod
    def _refuse(record: object, reason: str, now: float) -> None:
        assert isinstance(record, RequestRecord)
        record.rejected = reason
        record.refused_at = now
        record.flow_wait = now - record.source.arrival

    def _flow_pump(self, now: float, horizon: float) -> None:
        """Time out waits past their deadline; admit queued requests while the engines
        have room (one at a time: each is routed before the next check)."""
        flow = self.flow
        assert flow is not None
        for late in flow.expire(now):
            self._refuse(late.handle, "timeout", now)
        while (ready := flow.next_ready(self._view(now), now)) is not None:
            record = ready.handle
            assert isinstance(record, RequestRecord)
            record.flow_wait = now - record.source.arrival
            self._route(record, now)
            flow.started(ready.id)
            if record.rejected is None and not record.held:
                self._submit(record, now, horizon)

    def _route(self, record: RequestRecord, now: float) -> None:
        info = record.info
        try:
            decision = self.dispatcher.route(info, self._view(now), now, handle=record)
        except QueueFullError as exc:
            record.rejected = str(exc)
            return
        record.engine = decision.engine
        record.expected_hit_tokens = decision.expected_hit_tokens
        record.held = decision.hold
        record.prefill_engine = decision.prefill_engine
        record.pd_reason = decision.pd_reason

    def _submit(self, record: RequestRecord, now: float, horizon: float) -> None:
        """Send a routed (or released) request to its engine and wake the engine.

        A disaggregated request goes to its prefill engine first (one output token,
        like vLLM's prefill leg); after its KV transfer it comes back here for decode.
        """
        src = record.source
        prefill = record.prefill_engine is not None and record.kv_transfer_s == 0.0
        target = record.prefill_engine if prefill else record.engine
        assert target is not None
        idx = self._index[target]
        engine = self.engines[idx]
        reason = engine.admissible(src.prompt_tokens, 1 if prefill else src.output_tokens)
        if reason is not None:
            record.rejected = reason
            if record.prefill_engine is not None:
                self.dispatcher.prefill_done(record.info, record.prefill_engine, now, ok=False)
            self.dispatcher.finished(record.info, record.engine, now, ok=False)
            return
        engine.submit(
            EngineRequest(
                id=src.id + ("#prefill" if prefill else ""),
                prompt_tokens=src.prompt_tokens,
                block_hashes=src.block_hashes,
                output_tokens=1 if prefill else src.output_tokens,
                arrival=src.arrival,
                payload=_PrefillLeg(record) if prefill else record,
                remote_tokens=src.prompt_tokens if record.prefill_engine and not prefill else 0,
                lora=src.lora,
            )
        )
        if engine.busy:
            self._interrupt(idx, now)
        else:
            self._start(idx, now, horizon)

    def _release(self, engine_id: str, now: float, horizon: float) -> None:
        """Send held requests the policy lets go to ``engine_id``."""
        for item in self.dispatcher.release(engine_id, self._view(now), now):
            record = item.handle
            assert isinstance(record, RequestRecord)
            record.engine = item.engine
            record.expected_hit_tokens = item.hit_tokens
            record.queue_wait = now - record.source.arrival
            self._submit(record, now, horizon)

    def _apply(self, engine: EngineCore, step: StepOutcome, now: float) -> None:
        dispatcher = self.dispatcher
        for req in step.finished:
            if isinstance(req.payload, _PrefillLeg):  # prefill leg done: transfer the KV
                record = req.payload.record
                record.cached_tokens = req.cached_tokens or 0
                dispatcher.prefill_done(record.info, engine.id, now, ok=True)
                record.kv_transfer_s = max(
                    1e-9,
                    record.source.prompt_tokens
                    * self.cluster.perf.kv_bytes_per_token
                    / (self.cluster.kv_bandwidth_gbps * 1e9),
                )
                self._seq += 1
                heapq.heappush(self._transfers, (now + record.kv_transfer_s, self._seq, record))
        for req in step.first_tokens:
            if isinstance(req.payload, _PrefillLeg):
                continue
            record = _record(req)
            record.first_token_time = req.client_first_token_time
            if record.prefill_engine is None:
                record.cached_tokens = req.cached_tokens or 0
            dispatcher.first_token(record.info, engine.id, now)
        for req in step.finished:
            if isinstance(req.payload, _PrefillLeg):
                continue
            record = _record(req)
            record.finish_time = req.client_finish_time
            record.preemptions = req.preemptions
            done = replace(record.info, output_tokens=req.num_output)
            dispatcher.finished(done, engine.id, now, ok=True)
        if step.stored or step.removed:
            dispatcher.cache_event(engine.id, step.stored, step.removed)

    def _start(self, idx: int, now: float, horizon: float) -> None:
        end = self.engines[idx].start_step(now, horizon)
        if end is not None:
            self._push(idx, end)

    def _interrupt(self, idx: int, now: float) -> None:
        engine = self.engines[idx]
        before = engine.step_end
        end = engine.interrupt(now)
        if end is not None and end != before:
            self._push(idx, end)

    def _push(self, idx: int, end: float) -> None:
        self._versions[idx] += 1
        self._seq += 1
        heapq.heappush(self._heap, (end, self._seq, idx, self._versions[idx]))

    def _view(self, now: float) -> ClusterView:
        in_flight = self.dispatcher.in_flight
        queues = self.dispatcher.queues
        scraped = self._scraped(now)
        lora = self._lora and self.cluster.adapter_view
        return ClusterView(
            tuple(
                EngineView(
                    id=e.id,
                    role=self.cluster.role(i),
                    num_waiting=scraped[i][0],
                    num_running=scraped[i][1],
                    pending_prefill_tokens=e.pending_prefill_tokens,
                    kv_usage=scraped[i][2],
                    kv_capacity_blocks=e.pool.capacity,
                    in_flight=in_flight.get(e.id, 0),
                    router_queued=queues.count(e.id),
                    router_queued_tokens=queues.tokens(e.id),
                    lora_resident=self._adapters(e) if lora else frozenset(),
                    max_lora=e.model.max_loras if lora else 0,
                )
                for i, e in enumerate(self.engines[: self._active])
            )
        )

    @staticmethod
    def _adapters(engine: EngineCore) -> frozenset[str]:
        info = engine.lora_info
        return info.running | info.waiting

    def _scraped(self, now: float) -> list[tuple[int, int, float]]:
        """Each engine's (waiting, running, KV usage): exact, or as the gateway's scraper last
        read them (``scrape_interval_s``: refreshed at the first view of each interval)."""
        interval = self.cluster.scrape_interval_s
        if interval <= 0 or now >= self._next_scrape:
            self._scrape = [(e.num_waiting, e.num_running, e.kv_usage) for e in self.engines]
            if interval > 0:
                self._next_scrape = (math.floor(now / interval) + 1) * interval
        return self._scrape


@dataclass(slots=True)
class _PrefillLeg:
    """Marks the prefill-only part of a disaggregated request inside a prefill engine."""

    record: RequestRecord


def _record(req: EngineRequest) -> RequestRecord:
    record = req.payload
    assert isinstance(record, RequestRecord)
    return record


def load_cv(values: Iterable[float]) -> float:
    """Coefficient of variation (population std / mean); 0 when the mean is 0."""
    xs = list(values)
    if not xs:
        return 0.0
    mean = sum(xs) / len(xs)
    if mean <= 0:
        return 0.0
    var = sum((x - mean) ** 2 for x in xs) / len(xs)
    return float(math.sqrt(var) / mean)
