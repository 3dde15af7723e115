"""EngineDriver: real-time stepping, finish reasons, aborts and shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.emulator.driver import (
    EngineDeadError,
    EngineDriver,
    GenerationHandle,
    RequestRejectedError,
    TokenDelta,
)
from gateway.emulator.tokenizer import natural_length, prompt_digest
from gateway.perfmodel.presets import load_preset

PERF = load_preset("llama3-8b-h100")


@pytest.fixture
async def driver() -> AsyncIterator[EngineDriver]:
    d = EngineDriver(PERF, time_scale=0.01)
    await d.start()
    yield d
    await d.stop()


async def test_ignore_eos_runs_to_max_tokens(driver: EngineDriver) -> None:
    handle = driver.submit([1, 5, 6, 7], max_tokens=40, ignore_eos=True)
    deltas = [d async for d in handle]
    assert sum(d.count for d in deltas) == 40 == handle.produced
    assert deltas[-1].finish_reason == "length"
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert [d.start for d in deltas] == [
        sum(x.count for x in deltas[:i]) for i in range(len(deltas))
    ]


async def test_natural_end_is_a_stop_unless_max_tokens_comes_first(driver: EngineDriver) -> None:
    ids = [1, 9, 9, 9]
    natural = natural_length(prompt_digest(ids), driver.seed)
    long = driver.submit(ids, max_tokens=1000)
    assert await long.wait() == "stop"
    assert long.produced == natural
    short = driver.submit(ids, max_tokens=natural - 1)
    assert await short.wait() == "length"
    assert short.produced == natural - 1


async def test_rejects_what_vllm_rejects(driver: EngineDriver) -> None:
    limit = PERF.max_model_len
    with pytest.raises(RequestRejectedError, match="maximum context length is"):
        driver.submit([1] * 100, max_tokens=limit)
    with pytest.raises(RequestRejectedError, match="input tokens"):
        driver.submit([1] * limit, max_tokens=1)
    with pytest.raises(RequestRejectedError, match="empty"):
        driver.submit([], max_tokens=1)
    with pytest.raises(RequestRejectedError, match="at least 1"):
        driver.submit([1], max_tokens=0)


async def test_kv_capacity_is_checked() -> None:
    d = EngineDriver(PERF.with_overrides(kv_capacity_blocks=4), time_scale=0.01)
    await d.start()
    try:
        with pytest.raises(RequestRejectedError, match="KV capacity"):
            d.submit([1] * 100, max_tokens=10, ignore_eos=True)
    finally:
        await d.stop()


async def test_repeated_prompt_hits_the_prefix_cache(driver: EngineDriver) -> None:
    ids = list(range(3, 3 + 200))
    first = driver.submit(ids, max_tokens=4)
    await first.wait()
    second = driver.submit(ids, max_tokens=4)
    await second.wait()
    assert first.cached_tokens == 0
    assert second.cached_tokens == 192  # whole 16-token blocks, one token recomputed


async def test_abort_frees_the_engine_request(driver: EngineDriver) -> None:
    handle = driver.submit([1, 2, 3], max_tokens=10_000, ignore_eos=True)
    seen, last = 0, None
    async for delta in handle:
        seen += delta.count
        last = delta
        if seen >= 3 and handle.finish_reason is None:
            assert driver.abort(handle.id)
    assert last is not None and last.finish_reason == "abort"
    assert handle.finish_reason == "abort"
    assert not driver.abort(handle.id)
    for _ in range(100):
        if driver.core.num_running == 0:
            break
        await asyncio.sleep(0.005)
    assert driver.core.num_running == 0
    assert driver.core.kv_usage == 0.0
    assert driver.in_flight == 0


async def test_a_reader_that_never_reads_blocks_nothing(driver: EngineDriver) -> None:
    stuck = driver.submit([1, 2, 3], max_tokens=300, ignore_eos=True)
    other = driver.submit([1, 2, 4], max_tokens=50, ignore_eos=True)
    assert await asyncio.wait_for(other.wait(), 5) == "length"
    assert await asyncio.wait_for(stuck.wait(), 5) == "length"
    assert [d async for d in stuck] == [TokenDelta(300, 0, "length")]


async def test_requests_are_batched_not_serialised() -> None:
    d = EngineDriver(PERF, time_scale=0.05)
    await d.start()
    try:
        solo = d.submit([1, 2], max_tokens=100, ignore_eos=True)
        await solo.wait()
        handles = [d.submit([1, 3, i], max_tokens=100, ignore_eos=True) for i in range(8)]
        await asyncio.gather(*(h.wait() for h in handles))
    finally:
        await d.stop()

    def span(h: GenerationHandle) -> float:
        assert h.req.finish_time is not None
        return h.req.finish_time - h.req.arrival

    # model time: one shared batch (eight times one request's span if serialised); a loop
    # stall can only lengthen a span, by far less than the 7 x it would take to pass serial
    assert max(span(h) for h in handles) < 1.5 * span(solo)


async def test_virtual_time_follows_the_model() -> None:
    """99 decode steps take the model's time, in virtual seconds. At time scale 1 (0.75 s of
    wall time) a loop stall re-anchors late steps to the wall clock, as on a busy GPU: it can
    only lengthen them, so the bound above is loose (a 0.3 s stall on a loaded CI machine) and
    the one below tight. (At 0.05 a 50 ms stall was a whole second of virtual time.)"""
    d = EngineDriver(PERF, time_scale=1.0)
    await d.start()
    try:
        h = d.submit([1, 2], max_tokens=100, ignore_eos=True)
        await h.wait()
    finally:
        await d.stop()
    first, end = h.req.first_token_time, h.req.finish_time
    assert first is not None and end is not None
    per_token = (end - first) / 99
    model = PERF.decode_step_time(1, 60)
    assert 0.95 * model <= per_token <= 1.4 * model


@pytest.mark.parametrize("scale", [0.2, 1.0])
async def test_engines_pace_to_the_wall_clock(scale: float) -> None:
    """A request of known model duration cannot finish in much less wall time than that
    duration x ``time_scale`` (one-sided: load on the machine can only make it later)."""
    d = EngineDriver(PERF, time_scale=scale)
    await d.start()
    loop = asyncio.get_running_loop()
    try:
        h = d.submit([1, 2], max_tokens=100, ignore_eos=True)
        sent = loop.time()
        await h.wait()
        wall = loop.time() - sent
    finally:
        await d.stop()
    model = PERF.prefill_time(2) + 99 * PERF.decode_step_time(1, 2)  # the shortest it can take
    assert wall >= 0.9 * model * scale, f"{wall:.3f} s of wall time for {model:.3f} s x {scale}"


async def test_stop_cancels_the_loop_and_fails_requests_in_flight() -> None:
    d = EngineDriver(PERF, time_scale=0.01)
    await d.start()
    handle = d.submit([1, 2, 3], max_tokens=100_000, ignore_eos=True)
    await asyncio.sleep(0.02)
    await d.stop()
    assert not d.healthy
    with pytest.raises(EngineDeadError):
        await handle.wait()
    with pytest.raises(EngineDeadError):
        d.submit([1, 2], max_tokens=2)


async def test_idle_driver_sleeps_until_work_arrives(driver: EngineDriver) -> None:
    steps = driver.core.steps
    await asyncio.sleep(0.05)
    assert driver.core.steps == steps
    await driver.submit([1, 2], max_tokens=3).wait()
    assert driver.core.steps > steps
