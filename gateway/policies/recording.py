"""Decision recording and replay: evidence that a policy is a pure function of its inputs.

:class:`RecordingPolicy` wraps any policy and logs, in call order, every call the
dispatcher makes on it: each ``decide`` with its inputs (request, cluster view,
clock reading) and its answer, and every hook in between (``on_routed``,
``on_first_token``, ``on_finished``, cache events, membership, ``can_dispatch``,
``rebalance``, ...). :func:`replay` feeds the same calls, in the same order, to a
fresh policy built from the recorded :class:`PolicySpec` and reports every
answer that differs. Zero differences proves two things at once: the driver
(gateway or simulator) reaches the policy only through this seam, and the
policy's answers depend on nothing but what the seam hands it (no hidden clock,
no I/O, no process-dependent hashing).

Memory is bounded: each call is charged an estimate of what it keeps alive
(:data:`CALL_BYTES` per call, :data:`ENGINE_BYTES` per engine of a view,
:data:`INT_BYTES` per block hash or event id). When ``max_bytes`` is reached
recording stops and ``truncated`` is set; the log is then a *prefix* of the
run, which still replays exactly (a fresh policy replays from the start).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.core.types import ClusterView, Decision, EngineId, EngineView, Migration, RequestInfo
from gateway.perfmodel.model import PerfModel
from gateway.policies.base import Policy, PolicyContext
from gateway.policies.pd_rule import PDSettings
from gateway.policies.registry import create_policy
from gateway.policies.router_queues import QueuedRequest, RouterQueues

CALL_BYTES = 200
"""Estimated bytes a recorded call keeps alive besides its views and id lists."""
ENGINE_BYTES = 180
"""Estimated bytes per engine of a recorded :class:`ClusterView` (one EngineView)."""
INT_BYTES = 40
"""Estimated bytes per recorded block hash or KV event id (an int and its slot)."""
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """Everything needed to build the same policy again: name, options, context."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    block_size: int = 16
    kv_events: bool = False
    perf: PerfModel | None = None
    pd: PDSettings = field(default_factory=PDSettings)
    """The P/D rule's thresholds, so a disaggregated gateway's log replays the same rule."""

    @classmethod
    def of(cls, name: str, ctx: PolicyContext, options: Mapping[str, Any] | None) -> PolicySpec:
        return cls(
            name, dict(options or {}), ctx.seed, ctx.block_size, ctx.kv_events, ctx.perf, ctx.pd
        )

    def context(self) -> PolicyContext:
        return PolicyContext(
            seed=self.seed,
            block_size=self.block_size,
            perf=self.perf,
            kv_events=self.kv_events,
            pd=self.pd,
        )

    def build(self) -> Policy:
        """A fresh policy object, in the state the recorded one started in."""
        return create_policy(self.name, self.context(), self.options)


@dataclass(frozen=True, slots=True)
class QueueSnapshot:
    """The router queues as ``rebalance`` saw them (held requests, in arrival order)."""

    items: tuple[QueuedRequest, ...]
    max_total: int
    max_per_engine: int

    @classmethod
    def of(cls, queues: RouterQueues) -> QueueSnapshot:
        held = [_frozen_item(q) for e in queues.engines() for q in queues.items(e)]
        held.sort(key=lambda q: q.seq)
        return cls(tuple(held), queues.max_total, queues.max_per_engine)

    def rebuild(self) -> RouterQueues:
        """Queues with the same requests, hits, times, order and migration counts."""
        queues = RouterQueues(max_total=self.max_total, max_per_engine=self.max_per_engine)
        for q in self.items:
            item = queues.push(q.req, q.engine, q.hit_tokens, q.enqueued, candidates=q.candidates)
            item.migrations = q.migrations
        return queues


@dataclass(frozen=True, slots=True)
class Call:
    """One call on the policy: its method, its arguments (snapshots), and its answer."""

    method: str
    args: tuple[Any, ...]
    result: Any = None


ANSWERING = frozenset({"decide", "can_dispatch", "rebalance"})
"""Methods whose answers :func:`replay` compares; the others are hooks (``None``)."""


class RecordingPolicy:
    """A :class:`Policy` that forwards every call to ``inner`` and records it.

    ``name`` and the capability flags are the inner policy's, so drivers treat
    the wrapper exactly as they would treat the policy itself.
    """

    def __init__(
        self, inner: Policy, spec: PolicySpec, *, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.inner = inner
        self.spec = spec
        self.max_bytes = max_bytes
        self.calls: list[Call] = []
        self.bytes = 0
        self.truncated = False
        self.dropped = 0

    # -- the flags drivers read (the inner policy's; settable as the Policy protocol says) --
    @property
    def name(self) -> str:
        return self.inner.name

    @name.setter
    def name(self, value: str) -> None:
        self.inner.name = value

    @property
    def wants_cache_events(self) -> bool:
        return self.inner.wants_cache_events

    @wants_cache_events.setter
    def wants_cache_events(self, value: bool) -> None:
        self.inner.wants_cache_events = value

    @property
    def may_hold(self) -> bool:
        return self.inner.may_hold

    @may_hold.setter
    def may_hold(self, value: bool) -> None:
        self.inner.may_hold = value

    @property
    def pd_native(self) -> bool:
        return self.inner.pd_native

    @pd_native.setter
    def pd_native(self, value: bool) -> None:
        self.inner.pd_native = value

    # -- recording ---------------------------------------------------------------
    def _record(self, method: str, args: tuple[Any, ...], result: Any, ints: int = 0) -> None:
        if self.truncated:
            self.dropped += 1
            return
        views = sum(len(a) for a in args if isinstance(a, ClusterView))
        cost = CALL_BYTES + ENGINE_BYTES * views + INT_BYTES * ints
        if self.bytes + cost > self.max_bytes:
            self.truncated = True
            self.dropped += 1
            return
        self.bytes += cost
        self.calls.append(Call(method, args, result))

    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        decision = self.inner.decide(req, view, now)
        self._record("decide", (req, view, now), decision, ints=len(req.block_hashes))
        return decision

    def on_routed(self, req: RequestInfo, decision: Decision, now: float) -> None:
        self._record("on_routed", (req, decision, now), None)
        self.inner.on_routed(req, decision, now)

    def on_first_token(self, req: RequestInfo, engine: EngineId, now: float) -> None:
        self._record("on_first_token", (req, engine, now), None)
        self.inner.on_first_token(req, engine, now)

    def on_finished(self, req: RequestInfo, engine: EngineId, now: float, ok: bool) -> None:
        self._record("on_finished", (req, engine, now, ok), None)
        self.inner.on_finished(req, engine, now, ok)

    def on_prefill_done(self, req: RequestInfo, engine: EngineId, now: float, ok: bool) -> None:
        self._record("on_prefill_done", (req, engine, now, ok), None)
        self.inner.on_prefill_done(req, engine, now, ok)

    def on_cache_event(
        self, engine: EngineId, stored: Sequence[int], removed: Sequence[int]
    ) -> None:
        stored, removed = tuple(stored), tuple(removed)
        self._record("on_cache_event", (engine, stored, removed), None, len(stored) + len(removed))
        self.inner.on_cache_event(engine, stored, removed)

    def on_cache_reset(self, engine: EngineId) -> None:
        self._record("on_cache_reset", (engine,), None)
        self.inner.on_cache_reset(engine)

    def on_engine_removed(self, engine: EngineId) -> None:
        self._record("on_engine_removed", (engine,), None)
        self.inner.on_engine_removed(engine)

    def on_membership(self, engines: Sequence[EngineId]) -> None:
        engines = tuple(engines)
        self._record("on_membership", (engines,), None, len(engines))
        self.inner.on_membership(engines)

    def can_dispatch(self, engine: EngineView, pending_tokens: int, item: QueuedRequest) -> bool:
        answer = self.inner.can_dispatch(engine, pending_tokens, item)
        self._record("can_dispatch", (engine, pending_tokens, _frozen_item(item)), answer)
        return answer

    def rebalance(self, queues: RouterQueues, view: ClusterView, now: float) -> list[Migration]:
        snapshot = QueueSnapshot.of(queues)  # before the policy looks (it must not change it)
        moves = self.inner.rebalance(queues, view, now)
        held = sum(len(q.req.block_hashes) for q in snapshot.items)
        self._record("rebalance", (snapshot, view, now), tuple(moves), ints=held)
        return moves


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A replayed call whose answer differs from the recorded one."""

    index: int
    method: str
    recorded: Any
    replayed: Any


def replay(calls: Sequence[Call], policy: Policy) -> list[Mismatch]:
    """Feed ``calls`` to ``policy`` (fresh, built from the recorded spec) in order.

    Returns the calls whose answers differ (empty: the replay is identical).
    """
    out: list[Mismatch] = []
    for i, call in enumerate(calls):
        a = call.args
        answer: Any = None
        m = call.method
        if m == "decide":
            answer = policy.decide(a[0], a[1], a[2])
        elif m == "can_dispatch":
            answer = policy.can_dispatch(a[0], a[1], replace(a[2]))
        elif m == "rebalance":
            answer = tuple(policy.rebalance(a[0].rebuild(), a[1], a[2]))
        elif m == "on_cache_event":
            policy.on_cache_event(a[0], list(a[1]), list(a[2]))
        elif m in _HOOKS:
            getattr(policy, m)(*a)
        else:
            raise ValueError(f"call {i}: unknown method {m!r}")
        if m in ANSWERING and answer != call.result:
            out.append(Mismatch(i, m, call.result, answer))
    return out


_HOOKS = frozenset(
    {
        "on_routed",
        "on_first_token",
        "on_finished",
        "on_prefill_done",
        "on_cache_reset",
        "on_engine_removed",
        "on_membership",
    }
)


def _frozen_item(item: QueuedRequest) -> QueuedRequest:
    """A copy of a held request without the driver's handle (snapshots never change)."""
    return QueuedRequest(
        item.req,
        item.engine,
        item.hit_tokens,
        item.enqueued,
        item.seq,
        item.candidates,
        None,
        item.migrations,
    )
