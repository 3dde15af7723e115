"""Release requests held in the router queues (:class:`QueuePump`).

A policy may hold a request in an engine's router queue instead of routing it at once
(``Decision.hold``); the front end awaits the request's ``handle`` (an
``asyncio.Future``). The pump asks the dispatcher which held requests may go now (after an
engine finished one, and on a timer, since engine state also changes through scrapes and
other clients) and resolves their futures. One pump serves every front end of a routing
service, so a request held by the HTTP proxy and one held by the endpoint picker wait in
the same queues.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gateway.cluster.registry import EngineRegistry
from gateway.core.types import ClusterView
from gateway.policies.dispatcher import Dispatcher

log = logging.getLogger("kvgate.proxy")


class QueuePump:
    """Wakes held requests whose engine (or any engine, after a rebalance) can take them."""

    def __init__(
        self, registry: EngineRegistry, dispatcher: Dispatcher, clock: Callable[[], float]
    ) -> None:
        self.registry = registry
        self.dispatcher = dispatcher
        self.clock = clock

    def view(self) -> ClusterView:
        return self.registry.view(self.dispatcher.in_flight, queues=self.dispatcher.queues)

    def pump(self, engine: str | None = None) -> None:
        """Release held requests (of ``engine``, or of every queue) the policy lets go."""
        queues = self.dispatcher.queues
        if not len(queues):
            return
        now = self.clock()
        view = self.view()
        if engine is None:
            for target in self.dispatcher.rebalance(view, now):
                self._wake(target, view, now)
            for name in queues.engines():
                self._wake(name, view, now)
        else:
            self._wake(engine, view, now)

    def _wake(self, engine: str, view: ClusterView, now: float) -> None:
        for item in self.dispatcher.release(engine, view, now):
            future = item.handle
            if isinstance(future, asyncio.Future) and not future.done():
                future.set_result(item)

    async def run(self, interval_s: float, tick: Callable[[], None] | None = None) -> None:
        """Every ``interval_s`` seconds, call ``tick`` (a front end's pump, which may wake
        more than the router queues), by default :meth:`pump`: rebalance and release."""
        call = tick or self.pump
        while True:
            await asyncio.sleep(interval_s)
            try:
                call()
            except Exception:  # pragma: no cover - never let the pump die
                log.exception("router queue pump failed")
