"""The dispatcher: the one place requests meet a policy, in the simulator and the gateway.

It checks there is a healthy engine, asks the policy, validates the answer,
keeps the router's in-flight count per engine, times each decision with an
injected timer, and forwards lifecycle events to the policy's hooks.

Requests a policy asks to *hold* wait in :class:`RouterQueues` until the
driver calls :meth:`Dispatcher.release` for their engine (after that engine's
state changed) and the policy lets them go; :meth:`Dispatcher.rebalance` lets
the policy move held requests between queues. The driver owns the waiting
(an event in the simulator, a future in the gateway) through ``handle``.

In a disaggregated cluster a single-pool policy runs in *pair mode*: it is asked
for a decode engine, then :class:`~gateway.policies.pd_rule.PDRule` says whether
the prefill runs there (local) or on the prefill pool, and only then is the policy
asked for a prefill engine; a remote leg without reuse on the policy's decode engine moves
to a decode engine idle by the router's own count (:meth:`PDRule.balance_decode`), so
cold prompts do not pile on one decode engine between scrapes. ``pd_native`` policies
apply the same rule themselves
(from ``PolicyContext.pd``). Every disaggregated decision carries its
``pd_reason``; :attr:`Dispatcher.pd_reasons` counts them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from gateway.core.errors import NoEngineError
from gateway.core.types import ClusterView, Decision, EngineId, EngineRole, RequestInfo
from gateway.perfmodel.model import PerfModel
from gateway.perfmodel.presets import DEFAULT_PRESET, load_preset
from gateway.policies.base import Policy
from gateway.policies.lora_affinity import narrow_to_adapter
from gateway.policies.pd_rule import PDReason, PDRule, PDSettings
from gateway.policies.router_queues import QueuedRequest, QueueFullError, RouterQueues
from gateway.policies.session_affinity import SessionAffinity

__all__ = ["DecisionTimes", "Dispatcher", "PDSettings", "PolicyError", "QueueFullError"]


class PolicyError(RuntimeError):
    """A policy returned a decision that names no usable engine (a bug in the policy)."""


@dataclass(slots=True)
class DecisionTimes:
    """Decision durations in seconds, bounded: keeps the first ``limit`` samples."""

    limit: int = 1_000_000
    samples: list[float] = field(default_factory=list)

    def add(self, seconds: float) -> None:
        if len(self.samples) < self.limit:
            self.samples.append(seconds)


class Dispatcher:
    """Routes requests through a policy and keeps router-side accounting."""

    def __init__(
        self,
        policy: Policy,
        *,
        timer: Callable[[], float] | None = None,
        timing_limit: int = 1_000_000,
        queues: RouterQueues | None = None,
        pd: PDSettings | None = None,
        perf: PerfModel | None = None,
        sessions: SessionAffinity | None = None,
    ) -> None:
        self.policy = policy
        self.sessions = sessions
        """Session affinity (sticky until saturated); None: sessions are ignored."""
        self.pd = pd or PDSettings()
        self.pd_rule = PDRule(self.pd, perf or load_preset(DEFAULT_PRESET))
        self.pd_reasons: dict[str, int] = {}
        """Disaggregated decisions by ``pd_reason`` (bounded: the PDReason values)."""
        self._timer = timer
        self.times = DecisionTimes(limit=timing_limit)
        self.in_flight: dict[EngineId, int] = {}
        self.queues = queues if queues is not None else RouterQueues()
        self.routed = 0
        self.migrated = 0
        self._members: tuple[EngineId, ...] = ()
        self._decode_legs = 0
        self._last_leg: dict[EngineId, int] = {}
        """Per decode engine, the number of its latest remote decode leg (bounded: engines)."""

    def route(
        self, req: RequestInfo, view: ClusterView, now: float, *, handle: object = None
    ) -> Decision:
        """Pick an engine for ``req``: in flight there, or held in its queue (``hold``).

        Raises :class:`NoEngineError` without a healthy engine and
        :class:`QueueFullError` when a held request finds the queues full.
        """
        if not any(e.healthy for e in view.engines):
            raise NoEngineError("no healthy engine is available")
        members = view.ids
        if members != self._members:
            self._members = members
            self.policy.on_membership(members)
        timer = self._timer
        start = timer() if timer is not None else 0.0
        view = narrow_to_adapter(req, view)  # a LoRA request: resident > free slot > evict
        if self.sessions is not None:  # a session's bound engine, unless saturated
            view = self.sessions.narrow(req, view, now)[0]
        pair = view.disaggregated and not self.policy.pd_native
        if pair:
            decision, prefill, decode = self._decide_pair(req, view, now)
        else:
            decision, prefill, decode = self.policy.decide(req, view, now), None, None
            if view.disaggregated and not decision.pd_reason:  # a pd_native policy's own rule
                own = PDReason.REMOTE_PRICED if decision.prefill_engine else PDReason.LOCAL_PRICED
                decision = replace(decision, pd_reason=own.value)
        if timer is not None:
            self.times.add(timer() - start)
        self._validate(decision, view)
        if decision.pd_reason:
            self.pd_reasons[decision.pd_reason] = self.pd_reasons.get(decision.pd_reason, 0) + 1
        if decision.prefill_engine is not None:
            self.in_flight[decision.prefill_engine] = (
                self.in_flight.get(decision.prefill_engine, 0) + 1
            )
        if decode is not None:  # two sub-decisions: the policy sees each as routed
            if prefill is not None:
                self.policy.on_routed(req, prefill, now)
            self.policy.on_routed(req, decode, now)
            self.in_flight[decision.engine] = self.in_flight.get(decision.engine, 0) + 1
        elif decision.hold:
            self.queues.push(
                req,
                decision.engine,
                decision.expected_hit_tokens,
                now,
                candidates=decision.candidates,
                handle=handle,
            )
            self.policy.on_routed(req, decision, now)
        else:
            self.policy.on_routed(req, decision, now)
            self.in_flight[decision.engine] = self.in_flight.get(decision.engine, 0) + 1
        if self.sessions is not None:
            self.sessions.bind(req, decision.engine, now)
        self.routed += 1
        return decision

    def _decide_pair(
        self, req: RequestInfo, view: ClusterView, now: float
    ) -> tuple[Decision, Decision | None, Decision]:
        """Ask a single-pool policy for a decode engine, apply the P/D rule, then (when
        remote) ask it for a prefill engine among the others.

        Returns the combined decision and the two sub-decisions (prefill may be None).
        """
        decode = replace(self.policy.decide(req, view.pool(EngineRole.DECODE), now), hold=False)
        target = view.get(decode.engine)
        if target is None:  # not an engine: _validate names the policy's bug
            return decode, None, decode
        prefills = ClusterView(
            tuple(e for e in view.pool(EngineRole.PREFILL) if e.id != decode.engine)
        )
        choice = self.pd_rule.decide(req, target, decode.expected_hit_tokens, prefills.healthy())
        if choice.remote and not self.pd_rule.reuse_pays(req, decode.expected_hit_tokens):
            decodes = view.pool(EngineRole.DECODE).healthy()
            moved = self.pd_rule.balance_decode(target, decodes, self._last_leg)
            if moved.id != target.id:  # an idle decode engine: no pile-up between scrapes
                target = moved
                decode = replace(decode, engine=moved.id, expected_hit_tokens=0)
                decode = replace(decode, reason=decode.reason + ":idle_decode")
                prefills = ClusterView(
                    tuple(e for e in view.pool(EngineRole.PREFILL) if e.id != moved.id)
                )
                choice = self.pd_rule.decide(req, target, 0, prefills.healthy())
        if not choice.remote:
            return replace(decode, pd_reason=choice.reason.value), None, decode
        self._decode_legs += 1
        self._last_leg[decode.engine] = self._decode_legs
        prefill = self.policy.decide(req, prefills, now)
        combined = replace(
            decode,
            prefill_engine=prefill.engine,
            expected_hit_tokens=prefill.expected_hit_tokens,
            reason=f"{prefill.reason}>{decode.reason}",
            pd_reason=choice.reason.value,
        )
        return combined, replace(prefill, hold=False), decode

    def prefill_done(self, req: RequestInfo, engine: EngineId, now: float, ok: bool) -> None:
        """The prefill leg of a disaggregated request left ``engine``."""
        self._leave(engine)
        self.policy.on_prefill_done(req, engine, now, ok)

    def release(self, engine: EngineId, view: ClusterView, now: float) -> list[QueuedRequest]:
        """Held requests of ``engine`` the policy lets go now; they are in flight from here."""
        target = view.get(engine)
        if target is None or not target.healthy:
            return []
        pending = target.pending_prefill_tokens
        out: list[QueuedRequest] = []
        while True:
            item = self.queues.peek(engine)
            if item is None or not self.policy.can_dispatch(target, pending, item):
                break
            self.queues.pop(engine)
            pending += item.uncached_tokens
            self.in_flight[engine] = self.in_flight.get(engine, 0) + 1
            out.append(item)
        return out

    def rebalance(self, view: ClusterView, now: float) -> list[EngineId]:
        """Apply the policy's moves of held requests; returns the engines that gained some."""
        if not len(self.queues):
            return []
        targets: list[EngineId] = []
        for m in self.policy.rebalance(self.queues, view, now):
            target = view.get(m.target)
            item = self.queues.get(m.request_id)
            if target is None or not target.healthy or item is None or item.engine != m.source:
                continue
            if self.queues.count(m.target) >= self.queues.max_per_engine:
                continue
            self.queues.move(m.request_id, m.target, m.hit_tokens)
            self.migrated += 1
            if m.target not in targets:
                targets.append(m.target)
        return targets

    def cancel(self, request_id: str, now: float) -> QueuedRequest | None:
        """Drop a held request (client gone, or it waited too long)."""
        item = self.queues.remove(request_id)
        if item is not None:
            self.policy.on_finished(item.req, item.engine, now, False)
        return item

    def first_token(self, req: RequestInfo, engine: EngineId, now: float) -> None:
        self.policy.on_first_token(req, engine, now)

    def finished(self, req: RequestInfo, engine: EngineId, now: float, ok: bool) -> None:
        """The request left ``engine`` (completed when ``ok``, failed or cancelled otherwise)."""
        self._leave(engine)
        self.policy.on_finished(req, engine, now, ok)

    def _leave(self, engine: EngineId) -> None:
        count = self.in_flight.get(engine, 0)
        if count <= 1:
            self.in_flight.pop(engine, None)
        else:
            self.in_flight[engine] = count - 1

    def cache_event(self, engine: EngineId, stored: Sequence[int], removed: Sequence[int]) -> None:
        if self.policy.wants_cache_events and (stored or removed):
            self.policy.on_cache_event(engine, stored, removed)

    def cache_reset(self, engine: EngineId) -> None:
        """``engine`` cleared its prefix cache (or its KV events were lost)."""
        if self.policy.wants_cache_events:
            self.policy.on_cache_reset(engine)

    def engine_removed(self, engine: EngineId) -> None:
        self.in_flight.pop(engine, None)
        self._last_leg.pop(engine, None)
        if self.sessions is not None:
            self.sessions.engine_removed(engine)
        self.policy.on_engine_removed(engine)

    @staticmethod
    def _validate(decision: Decision, view: ClusterView) -> None:
        for engine_id in (decision.engine, decision.prefill_engine):
            if engine_id is None:
                continue
            engine = view.get(engine_id)
            if engine is None or not engine.healthy:
                raise PolicyError(f"policy chose {engine_id!r}, which is not a healthy engine")
