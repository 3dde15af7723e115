"""The end of a request's bookkeeping, shared by every front end (:class:`Settler`).

The HTTP proxy (:class:`~gateway.proxy.forwarder.Forwarder`) and the Envoy endpoint
picker (:mod:`gateway.epp.accounting`) close a request the same way: the engine's attempt
ends, the policy's completion hook (``Dispatcher.finished``) runs with the output length,
the router queue is pumped, the breaker hears of a success, the metrics count it, the
request log line is written and the recorder gets its record.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from gateway.cluster.registry import EngineRegistry
from gateway.config import Settings
from gateway.observability import GatewayMetrics
from gateway.policies.dispatcher import Dispatcher
from gateway.proxy.disagg import pd_log_fields
from gateway.proxy.exchange import Exchange
from gateway.proxy.recorder import Recorder

log = logging.getLogger("kvgate")


class Settler:
    """Settles one front end's requests; ``recorder`` may be set after construction."""

    def __init__(
        self,
        settings: Settings,
        registry: EngineRegistry,
        *,
        dispatcher: Dispatcher,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
        pump: Callable[[str], None],
        recorder: Recorder | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.clock = clock
        self.pump = pump
        self.recorder = recorder
        self.policy = dispatcher.policy.name

    def settle(
        self,
        ex: Exchange,
        engine_id: str,
        *,
        ok: bool,
        output: int | None,
        outcome: str,
        usage: bytes = b"",
        finish_policy: bool = True,
    ) -> None:
        """Close ``ex`` served by ``engine_id``. ``finish_policy`` False: the policy already
        heard of this request's end (a fallback engine served it after its primary failed)."""
        if ex.trace is not None:
            ex.trace.finished(ex, outcome)
        now = self.clock()
        self.registry.end_attempt(engine_id, ex.request_id)
        if finish_policy:
            info = ex.info if output is None else replace(ex.info, output_tokens=output)
            self.dispatcher.finished(info, engine_id, now, ok=ok)
        self.pump(engine_id)
        if ok:
            self.registry.mark_success(engine_id, now)
            self.metrics.e2e.labels(ex.route).observe(now - ex.started)
        self.metrics.requests.labels(ex.route, self.policy, outcome).inc()
        if self.settings.log_requests:
            log.info(
                "request done",
                extra={
                    "request_id": ex.request_id,
                    "route": ex.route,
                    "model": ex.model,
                    "engine": engine_id,
                    "outcome": outcome,
                    "attempts": ex.attempts,
                    "stream": ex.stream,
                    "prompt_tokens_est": ex.info.prompt_tokens,
                    "output_tokens": output,
                    "duration_s": round(now - ex.started, 6),
                    **pd_log_fields(ex),
                },
            )
        if self.recorder is not None:
            self.recorder.record(ex, ok=ok, outcome=outcome, output=output, usage=usage)
