"""The emulator applies the engine model's frontend term and idle wake in real time."""

from __future__ import annotations

import asyncio

import pytest

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


async def test_readers_see_tokens_a_frontend_delay_after_the_engine_made_them() -> None:
    plain_first, plain_last, plain_tokens, plain_engine = await first_and_last({})
    first, last, tokens, engine = await first_and_last({"frontend_ms": 60.0})
    assert tokens == plain_tokens == 4  # nothing lost or reordered
    assert engine == pytest.approx(plain_engine, abs=0.005)  # the engine is as fast
    assert first - plain_first == pytest.approx(0.060, abs=0.025)
    assert last - plain_last == pytest.approx(0.060, abs=0.025)


async def test_an_idle_engine_wakes_slowly() -> None:
    plain_first, *_ = await first_and_last({})
    first, _, _, engine = await first_and_last({"idle_wake_ms": 80.0, "idle_after_s": 0.5})
    assert first - plain_first == pytest.approx(0.080, abs=0.025)  # idle since it started
    assert engine >= 0.080 + BASE.prefill_time(200) - 0.002
