"""The emulator applies the engine model's frontend term and idle wake in real time."""

from __future__ import annotations

import asyncio

from gateway.emulator.driver import EngineDriver
from gateway.perfmodel.presets import load_preset

BASE = load_preset("llama3-8b-h100")
PROMPT = list(range(10, 210))  # 200 tokens


async def first_and_last(model_overrides: dict[str, float]) -> tuple[float, float, int, float]:
    """Real seconds from submit to the first and the last delta a reader sees, the tokens it
    saw, and the engine's own first-token time (virtual = real seconds at scale 1)."""
    driver = EngineDriver(BASE.with_overrides(**model_overrides), time_scale=1.0)
    await driver.start()
    try:
        loop = asyncio.get_running_loop()
        handle = driver.submit(PROMPT, max_tokens=4, ignore_eos=True)
        sent = loop.time()
        seen: list[float] = []
        tokens = 0
        async for delta in handle:
            seen.append(loop.time() - sent)
            tokens += delta.count
        engine_first = handle.req.first_token_time
        assert engine_first is not None
        return seen[0], seen[-1], tokens, engine_first - handle.req.arrival
    finally:
        await driver.stop()


FRONTEND_MS = 400.0
"""Long against the engine's first token (prefill 11.5 ms), so a loop stall that re-anchors
virtual time does not fail the upper bound on it (with 60 ms, a 50 ms stall would have)."""


async def test_readers_see_tokens_a_frontend_delay_after_the_engine_made_them() -> None:
    *_, plain_tokens, _ = await first_and_last({})
    first, last, tokens, engine = await first_and_last({"frontend_ms": FRONTEND_MS})
    assert tokens == plain_tokens == 4  # nothing lost or reordered
    # One-sided (load can only delay): the engine is not slowed by the frontend term (its
    # first token, in virtual seconds, comes well before it: a loop stall of up to ~0.4 s
    # re-anchoring virtual time still passes), and the reader sees the first and the last
    # token at least the frontend delay after the engine made them.
    delay = FRONTEND_MS / 1000
    assert BASE.prefill_time(200) - 0.002 <= engine < delay <= first
    assert first >= engine + delay - 0.002
    assert last >= engine + delay + 3 * BASE.decode_step_time(1, 200) - 0.002


async def test_an_idle_engine_wakes_slowly() -> None:
    first, _, _, engine = await first_and_last({"idle_wake_ms": 80.0, "idle_after_s": 0.5})
    # idle since it started: the first step starts 80 ms late, in virtual and in wall time
    assert engine >= 0.080 + BASE.prefill_time(200) - 0.002
    assert first >= 0.080 + BASE.prefill_time(200) - 0.002
