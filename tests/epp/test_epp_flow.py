"""``kvgate epp`` runs flow control too: while the engines are saturated a request waits in
the routing service's gate, then is refused 429 (queue full) or 503 (timed out)."""

from __future__ import annotations

import asyncio

from harness import MODEL, FakeEnvoy, fleet, picker


async def test_saturated_engines_hold_then_refuse_picks() -> None:
    flow = {"max_ttft_s": 0.001, "queue_timeout_s": 0.5, "max_queued": 1}
    async with (
        fleet("both") as (transport, urls),
        picker(transport, [{"url": u} for u in urls], flow_control=flow) as server,
    ):
        envoy = FakeEnvoy(server, transport)
        gate = server.service.flow
        assert gate is not None
        # ~40k tokens: the performance model takes ~4 s to prefill them, so the engine stays
        # saturated (flow control drains a pending prefill at the model's rate)
        long = {"model": MODEL, "prompt": "blocker " * 20_000, "max_tokens": 1}
        first = await envoy.send("/v1/completions", long, respond=False)  # pending prefill
        assert first.destination
        waiting = asyncio.create_task(
            envoy.send("/v1/completions", {"model": MODEL, "prompt": "waits " * 50})
        )
        for _ in range(500):  # the second pick waits in the gate (not at the engine)
            if len(gate.controller.queue) or waiting.done():
                break
            await asyncio.sleep(0.01)
        assert len(gate.controller.queue) == 1
        full = await envoy.send("/v1/completions", {"model": MODEL, "prompt": "third " * 50})
        assert full.immediate_status == 429
        assert full.immediate_body["error"]["type"] == "rate_limit_error"
        late = await waiting
        assert late.immediate_status == 503 and not late.destination
        first.call.cancel()
        await envoy.aclose()
