"""Session affinity: a session's turns go to the engine that holds its context, until
that engine is saturated ("sticky until saturated").

An agent or a conversation resends its whole history each turn; the engine that
served the last turn holds it in its prefix cache. A routing key sees this too,
but only while the prefix index agrees: once a hot shared prefix (a system prompt,
a tool list) has spread to several engines, or on a replica that never routed the
session, the policy may pick another engine and the history is prefilled again.
A session id (:mod:`gateway.proxy.sessions`) names the engine directly.

The rule, per request with a session (:meth:`SessionAffinity.narrow`):

* no live binding -> ``new`` (or ``expired`` when one lapsed): the policy decides
  over the whole view;
* bound engine gone, unhealthy or not eligible -> ``rebound_unavailable``: the policy
  decides;
* the prompt does not continue the session's last one -> ``unrelated``: the policy
  decides (nothing of it is held there: a ``user`` id sending unrelated prompts, a
  compacted history);
* bound engine *saturated* -> ``rebound_saturated``: the policy decides;
* otherwise -> ``bound``: the view is narrowed to the bound engine (plus the
  prefill pool in a disaggregated cluster, where the binding names the decode
  engine), so the policy still computes its expected hit and runs its hooks.

Either way the session is then bound to the engine the request was routed to
(:meth:`SessionAffinity.bind`, from the dispatcher's routed step), for ``ttl_s``
after its last turn, with :data:`CHECKPOINTS` (position, hash) pairs of that
prompt's blocks (at 1/4, 1/2, 3/4 and its end). The next prompt's *held* tokens
are the longest checkpointed prefix it shares with the last one (a binding from a
peer replica has none: the whole prompt is assumed held). The bound engine is
*saturated* when

* its requests (in flight plus held in its router queue) exceed
  ``max(min_in_flight, load_ratio x the pool's mean)`` (a decode batch much larger
  than the others'), or
* its prefill backlog (pending plus held tokens) exceeds the least backlogged
  engine's by more than ``max(min_pending_tokens, held)``: the request would wait
  longer here than prefilling what this engine holds would take elsewhere.

The pool is the healthy engines that serve decode. Defaults (1.2, 3 requests, 256
tokens) were measured in the simulator on the live benchmark's shape
(``benchmarks/quality/session_affinity.py``, docs/policies.md#session-affinity): the
busiest-engine share stays at or under 27.6 % (27.0-27.2 % without sessions) and
unique prompts route exactly as without sessions, while the hit rate rises (0.69 ->
0.88 with one session per hot prompt, 0.70 -> 0.74 on ``gen:agent``); a floor of 4
requests let the busiest share reach 32 %. The ratio bounds the bound engine's share of the
requests in flight by 1.2 / engines once the floor no longer binds (30 % of 4 engines)
under heavy load, where 1.5 allowed 37.5 %.

Memory: at most ``max_sessions`` bindings (an :class:`AffinityTable`), about
350 bytes each with a UUID session id and its checkpoints (measured): 100,000
sessions ~ 35 MB.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from gateway.core.types import ClusterView, EngineId, EngineRole, EngineView, RequestInfo
from gateway.policies.affinity_table import AffinityTable, Payload

__all__ = ["SessionAffinity", "SessionOutcome", "StickySettings"]


class SessionOutcome(StrEnum):
    """What affinity did for one request with a session (a bounded metric label)."""

    BOUND = "bound"
    REBOUND_SATURATED = "rebound_saturated"
    REBOUND_UNAVAILABLE = "rebound_unavailable"
    UNRELATED = "unrelated"
    NEW = "new"
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class StickySettings:
    """The knobs of session affinity (``sessions.*`` in the gateway's settings)."""

    ttl_s: float = 600.0
    max_sessions: int = 100_000
    load_ratio: float = 1.2
    min_in_flight: int = 3
    min_pending_tokens: int = 256


def requests_of(e: EngineView) -> int:
    """Requests on ``e`` as the router sees them: in flight plus held for it."""
    return e.in_flight + e.router_queued


def backlog_of(e: EngineView) -> int:
    """Prompt tokens waiting for prefill on ``e``: pending plus held for it."""
    return e.pending_prefill_tokens + e.router_queued_tokens


CHECKPOINTS = 4
"""Block positions of a session's last prompt kept with its binding (evenly spaced)."""


def checkpoints(req: RequestInfo) -> Payload:
    """(position, hash) pairs of ``req``'s blocks at 1/4, 1/2, 3/4 and the end, flattened."""
    n = len(req.block_hashes)
    spots = sorted(
        {(n * k + CHECKPOINTS - 1) // CHECKPOINTS - 1 for k in range(1, CHECKPOINTS + 1)}
    )
    return tuple(x for p in spots if p >= 0 for x in (p, req.block_hashes[p]))


def shared_tokens(req: RequestInfo, marks: Payload | None) -> int:
    """Prompt tokens of ``req`` the session's engine holds, as far as the last prompt's
    checkpoints tell (a lower bound, to a quarter of it); the whole prompt for a binding
    without checkpoints (one a peer replica made)."""
    if marks is None:
        return req.prompt_tokens
    hashes = req.block_hashes
    best = 0
    for i in range(0, len(marks) - 1, 2):
        pos = marks[i]
        if pos < len(hashes) and hashes[pos] == marks[i + 1]:
            best = pos + 1
    return best * req.block_size


class SessionAffinity:
    """Session -> engine bindings and the sticky-until-saturated rule (pure: ``now`` given)."""

    def __init__(
        self,
        settings: StickySettings | None = None,
        *,
        table: AffinityTable | None = None,
        on_bind: Callable[[str, EngineId, float], None] | None = None,
    ) -> None:
        self.settings = s = settings or StickySettings()
        self.table = table or AffinityTable(ttl_s=s.ttl_s, max_entries=s.max_sessions)
        self.on_bind = on_bind
        """Called with (session, engine, ttl_s) at each binding or refresh (replica sync)."""
        self.outcomes: dict[str, int] = {}
        """Requests with a session by :class:`SessionOutcome` value (bounded: five keys)."""

    def narrow(
        self, req: RequestInfo, view: ClusterView, now: float
    ) -> tuple[ClusterView, SessionOutcome | None]:
        """The view the policy decides on for ``req``, and what affinity did (None: no
        session)."""
        session = req.session
        if not session:
            return view, None
        table = self.table
        lapsed = table.expires(session)
        found = table.entry(session, now)
        if found is None:
            outcome = SessionOutcome.EXPIRED if lapsed is not None else SessionOutcome.NEW
            return view, self._count(outcome)
        bound, marks = found
        engine = view.get(bound)
        if engine is None or not engine.healthy or not engine.serves_decode:
            return view, self._count(SessionOutcome.REBOUND_UNAVAILABLE)
        held = shared_tokens(req, marks)
        if not held:  # the prompt does not continue the session's last one: nothing to keep
            return view, self._count(SessionOutcome.UNRELATED)
        if self.saturated(engine, view, held):
            return view, self._count(SessionOutcome.REBOUND_SATURATED)
        if view.disaggregated:  # the binding names the decode engine; prefill stays open
            kept = tuple(e for e in view if e.id == bound or e.role is EngineRole.PREFILL)
        else:
            kept = (engine,)
        return ClusterView(kept), self._count(SessionOutcome.BOUND)

    def saturated(self, engine: EngineView, view: ClusterView, held_tokens: int = 0) -> bool:
        """True when ``engine`` carries more than its share, or queues more prefill ahead of
        the request than the ``held_tokens`` it holds for it (see the module docstring)."""
        s = self.settings
        pool = [e for e in view if e.healthy and e.serves_decode]
        if not pool:
            return False
        requests = requests_of(engine)
        if requests > s.min_in_flight:
            mean = sum(requests_of(e) for e in pool) / len(pool)
            if requests > s.load_ratio * mean:
                return True
        extra = backlog_of(engine) - min(backlog_of(e) for e in pool)
        return extra > max(s.min_pending_tokens, held_tokens)

    def bind(self, req: RequestInfo, engine: EngineId, now: float) -> None:
        """``req`` was routed to ``engine``: its session stays there for ``ttl_s``."""
        session = req.session
        if not session:
            return
        self.table.put(session, engine, now, payload=checkpoints(req))
        if self.on_bind is not None:  # every turn: the peers' copies live on as ours does
            self.on_bind(session, engine, self.settings.ttl_s)

    def engine_removed(self, engine: EngineId) -> None:
        self.table.drop_engine(engine)

    def _count(self, outcome: SessionOutcome) -> SessionOutcome:
        self.outcomes[outcome.value] = self.outcomes.get(outcome.value, 0) + 1
        return outcome
