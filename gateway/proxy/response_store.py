"""Which engine stored each Responses object.

vLLM keeps a stored response (``store: true``, the default) in the memory of the
engine process that created it: a follow-up with ``previous_response_id`` and
``GET``/``DELETE /v1/responses/{id}``/``cancel`` work only there. kvgate reads the id
of every stored response it relays (the JSON's ``id``; in a stream, the first
``response.created`` event) and binds it to the engine in a bounded TTL table
(``responses.max_entries`` ids, ``responses.ttl_s`` after last use; oldest dropped
first). With replica sync the binding is published to the other replicas.

An id kvgate does not know (a restarted gateway, an id made behind another gateway)
is looked up on the engines serving the model: ``GET /v1/responses/{id}`` on each, all
at once, the first 200 wins (``responses.locate``). An id bound to an engine that has
left the fleet is an error that says so (404); one whose engine is down right now, a
503 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable

from gateway.cluster.registry import EngineRegistry, EngineState
from gateway.policies.affinity_table import AffinityTable
from gateway.proxy.errors import ApiError
from gateway.proxy.upstream import Upstream, UpstreamError

log = logging.getLogger("kvgate.proxy")

_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_\-]{1,200})"')
_SCAN_BYTES = 8192
"""Bytes of a stream's start searched for its id (``response.created`` comes first)."""

BindListener = Callable[[str, str, float], None]
"""(response id, engine id, seconds the binding lives): replica sync publishes it."""


def response_id_in(content: bytes) -> str | None:
    """The id of the Responses object whose JSON (or SSE stream) starts ``content``."""
    found = _RESPONSE_ID.search(content, 0, _SCAN_BYTES)
    return found.group(1).decode("ascii") if found else None


class ResponseStore:
    """response id -> engine id, bounded and expiring."""

    def __init__(
        self,
        registry: EngineRegistry,
        *,
        ttl_s: float,
        max_entries: int,
        clock: Callable[[], float],
        locate: bool = True,
    ) -> None:
        self.registry = registry
        self.table = AffinityTable(ttl_s=ttl_s, max_entries=max_entries)
        self.clock = clock
        self.locate_unknown = locate
        self.on_bind: BindListener | None = None

    def bind(self, response_id: str, engine_id: str) -> None:
        """``engine_id`` stored ``response_id`` (publish it to the peers)."""
        self.table.put(response_id, engine_id, self.clock())
        if self.on_bind is not None:
            self.on_bind(response_id, engine_id, self.table.ttl_s)

    def forget(self, response_id: str) -> None:
        self.table.pop(response_id)

    def owner(self, response_id: str) -> str | None:
        """The engine bound to ``response_id`` (the binding's life starts again), or None."""
        now = self.clock()
        engine = self.table.get(response_id, now)
        if engine is not None:
            self.table.touch(response_id, now)
        return engine

    def engine_for(self, response_id: str) -> EngineState | None:
        """The live engine holding ``response_id``, None when unknown; an ApiError when its
        engine left the fleet (404) or is out of routing now (503)."""
        engine_id = self.owner(response_id)
        if engine_id is None:
            return None
        engine = self.registry.get(engine_id)
        if engine is None or engine.retired:
            self.forget(response_id)
            raise ApiError(
                404,
                f"response {response_id!r} was stored on engine {engine_id}, which has left "
                "the fleet; its conversation state is gone (start a new one)",
                param="previous_response_id",
                error_type="not_found_error",
            )
        if not engine.admits:
            raise ApiError(
                503,
                f"response {response_id!r} is stored on engine {engine_id}, which is out of "
                "routing right now; retry later",
                headers={"Retry-After": str(self.registry.retry_after(self.clock()))},
            )
        return engine

    async def locate(
        self, upstream: Upstream, response_id: str, model: str | None, headers_for: HeadersFor
    ) -> EngineState | None:
        """Ask every routable engine (serving ``model``) for ``response_id``; bind and
        return the one that has it."""
        if not self.locate_unknown:
            return None
        engines = [e for e in self.registry.all() if e.admits and e.serves(model)]
        if not engines:
            return None

        async def probe(engine: EngineState) -> EngineState | None:
            url = f"{engine.url}/v1/responses/{response_id}"
            try:
                resp = await upstream.send(url, headers_for(engine), b"", method="GET")
                await resp.read()
            except UpstreamError:
                return None
            return engine if resp.status == 200 else None

        for found in await asyncio.gather(*(probe(e) for e in engines)):
            if found is not None:
                log.info("response %s found on %s", response_id, found.id)
                self.bind(response_id, found.id)
                return found
        return None


HeadersFor = Callable[[EngineState], list[tuple[bytes, bytes]]]
