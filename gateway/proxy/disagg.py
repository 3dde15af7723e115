"""The prefill leg of disaggregated serving, as vLLM's NIXL proxy runs it.

1. The prefill engine gets the client's body with ``kv_transfer_params =
   {"do_remote_decode": true, "do_remote_prefill": false, "remote_*": null}``,
   ``stream=false``, ``max_tokens=1`` (and ``max_completion_tokens=1`` when
   present), without ``stream_options`` and without ``min_tokens`` /
   ``min_completion_tokens`` (not supported there), and the same
   ``X-Request-Id`` as the decode leg.
2. Its reply's top-level ``kv_transfer_params`` go, unchanged, into the
   original body for the decode leg, which streams back to the client.

If the prefill leg fails (connection, timeout, 5xx, or a reply without
transfer parameters), the request falls back to a local prefill on its decode
engine: the client is served, and nothing is left half-done on the prefill
engine. A 4xx from the prefill engine is the client's error and is answered
as is.

Every routing decision is counted by its P/D reason
(``kvgate_pd_decisions_total{reason}``, :mod:`gateway.policies.pd_rule`), and
the request's log line names the engine that prefilled it (``prefill``: its
URL, or ``local``) and the reason (``pd_reason``; ``pd_fallback`` when a
remote leg failed and the decode engine prefilled instead).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.responses import Response

from gateway.core.types import Decision
from gateway.proxy.upstream import UpstreamError

if TYPE_CHECKING:
    from gateway.proxy.exchange import Exchange
    from gateway.proxy.forwarder import Forwarder

log = logging.getLogger("kvgate.proxy")

PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict[str, Any]) -> bytes:
    """The prefill leg's body: one token, no stream, transfer parameters asking for decode."""
    leg = {
        k: v
        for k, v in body.items()
        if k not in ("stream_options", "min_tokens", "min_completion_tokens")
    }
    leg["kv_transfer_params"] = dict(PREFILL_PARAMS)
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    return json.dumps(leg, separators=(",", ":")).encode()


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> bytes:
    """The decode leg's body: the client's, plus the prefill engine's transfer parameters."""
    return json.dumps({**body, "kv_transfer_params": params}, separators=(",", ":")).encode()


def note_pd_decision(fwd: Forwarder, ex: Exchange, decision: Decision, disagg: bool) -> None:
    """Count ``decision`` by its P/D reason and keep the reason for the request's log."""
    reason = (decision.pd_reason or "unknown") if disagg else "unified"
    ex.pd_reason = reason
    fwd.metrics.pd_decisions.labels(reason).inc()


def pd_log_fields(ex: Exchange) -> dict[str, Any]:
    """The P/D fields of a request's log line (none in a unified pool)."""
    if ex.pd_reason is None or ex.pd_reason == "unified":
        return {}
    fields: dict[str, Any] = {"prefill": ex.prefill_engine or "local", "pd_reason": ex.pd_reason}
    if ex.prefill_engine is None and ex.pd_reason.startswith("remote"):
        fields["pd_fallback"] = True
    return fields


@dataclass(slots=True)
class PrefillOutcome:
    params: dict[str, Any] | None = None
    response: Response | None = None  # an answer for the client (a 4xx from the prefill engine)


async def run_prefill(fwd: Forwarder, ex: Exchange, engine_id: str) -> PrefillOutcome:
    """Run the prefill leg on ``engine_id``; never raises for engine failures."""
    registry, dispatcher = fwd.registry, fwd.dispatcher
    engine = registry.get(engine_id)
    started = time.monotonic()
    ok = False
    try:
        if engine is None or ex.body is None:
            return PrefillOutcome()
        registry.add_pending(engine_id, ex.request_id + "#prefill", ex.info.prompt_tokens)
        registry.begin_attempt(engine_id, ex.request_id + "#prefill", lora=ex.info.lora)
        if ex.trace is not None:  # this leg's span context goes in its headers
            ex.trace.begin_leg("prefill", engine_id, ex.attempts + 1)
        try:
            resp = await fwd.upstream.send(
                engine.url + ex.path, fwd.headers_for(ex, engine), prefill_body(ex.body)
            )
            content = await resp.read()
        except UpstreamError as exc:
            fwd.prefill_failed(engine_id, str(exc), getattr(exc, "reason", "transport"))
            return PrefillOutcome()
        if 400 <= resp.status < 500:
            ctype = resp.header(b"content-type")
            return PrefillOutcome(
                response=Response(
                    content=content,
                    status_code=resp.status,
                    media_type=ctype.decode("latin-1") if ctype else "application/json",
                    headers={"x-request-id": ex.request_id},
                )
            )
        if resp.status >= 500:
            fwd.prefill_failed(
                engine_id, f"prefill engine answered {resp.status}", f"status_{resp.status}"
            )
            return PrefillOutcome()
        try:
            params = json.loads(content).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict):
            log.warning(
                "prefill engine %s returned no kv_transfer_params (is it configured "
                "with a KV connector?); prefilling on the decode engine",
                engine_id,
                extra={"request_id": ex.request_id},
            )
            return PrefillOutcome()
        ok = True
        return PrefillOutcome(params=params)
    finally:
        if ex.trace is not None:
            ex.trace.end_leg(error=None if ok else "prefill_failed")
        registry.clear_pending(engine_id, ex.request_id + "#prefill")
        registry.end_attempt(engine_id, ex.request_id + "#prefill")
        if ok:  # the prefill engine works (its breaker may be half-open)
            registry.mark_success(engine_id, fwd.clock())
        dispatcher.prefill_done(ex.info, engine_id, fwd.clock(), ok=ok)
        fwd.metrics.pd_legs.labels("remote" if ok else "fallback").inc()
        if ok:
            fwd.metrics.pd_prefill_seconds.observe(time.monotonic() - started)
        fwd.pump(engine_id)
