"""The in-flight context (per engine: requests the router sent and their prompt tokens) and
the TPOT estimate that uses it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.core.types import EngineView
from gateway.perfmodel.presets import load_preset
from gateway.policies.inflight import InFlightContext
from gateway.policies.ttft_estimate import kv_tokens, tpot_s

PERF = load_preset("mistral-7b-a6000")


def test_attended_context_counts_a_shared_prefix_once_per_sequence() -> None:
    flight = InFlightContext()
    for i in range(10):
        flight.add(f"r{i}", "e0", 8_000)
    e0 = EngineView(id="e0", num_running=10, kv_usage=0.05, kv_capacity_blocks=10_000)
    assert kv_tokens(PERF, e0) == 8_000  # the prefix, held once
    assert flight.attended(PERF, e0, 100) == 80_000  # ...attended by each of 10 sequences
    # nothing in flight: running sequences are assumed as long as the new prompt
    e1 = EngineView(id="e1", num_running=4)
    assert flight.attended(PERF, e1, 3_000) == 12_000


def test_finish_repeats_and_unknown_ids_are_harmless() -> None:
    flight = InFlightContext()
    flight.add("a", "e0", 100)
    flight.add("a", "e0", 100)  # a retry of the same id
    assert flight.requests("e0") == 1
    flight.finish("a")
    flight.finish("a")
    flight.finish("nope")
    assert (len(flight), flight.requests("e0"), flight.mean_context("e0", 7.0)) == (0, 0, 7.0)


def test_memory_is_bounded_oldest_first() -> None:
    flight = InFlightContext(max_requests=3)
    for i in range(5):
        flight.add(f"r{i}", "e0", 10 * (i + 1))
    assert len(flight) == 3 and flight.requests("e0") == 3
    assert flight.mean_context("e0", 0.0) == 40.0  # r2..r4: 30, 40, 50


def test_remove_engine_forgets_its_requests() -> None:
    flight = InFlightContext()
    flight.add("a", "e0", 10)
    flight.add("b", "e1", 20)
    flight.remove_engine("e0")
    assert (len(flight), flight.requests("e0"), flight.requests("e1")) == (1, 0, 1)


@given(
    st.lists(st.tuples(st.booleans(), st.integers(0, 9), st.integers(1, 3), st.integers(1, 500)))
)
def test_counts_match_what_is_held(ops: list[tuple[bool, int, int, int]]) -> None:
    flight = InFlightContext(max_requests=6)
    held: dict[str, tuple[str, int]] = {}
    for add, rid, engine, tokens in ops:
        r, e = f"r{rid}", f"e{engine}"
        if add:
            flight.add(r, e, tokens)
            held.setdefault(r, (e, tokens))
            while len(held) > 6:
                del held[next(iter(held))]
        else:
            flight.finish(r)
            held.pop(r, None)
    assert len(flight) == len(held)
    for engine in ("e1", "e2", "e3"):
        mine = [t for e, t in held.values() if e == engine]
        assert flight.requests(engine) == len(mine)
        assert flight.mean_context(engine, -1.0) == (sum(mine) / len(mine) if mine else -1.0)


def test_tpot_grows_with_attended_context_and_the_prefill_duty_cycle() -> None:
    e = EngineView(id="e0", num_running=40, kv_usage=0.02, kv_capacity_blocks=14_000)
    by_usage = tpot_s(PERF, e, 8_000)
    attended = tpot_s(PERF, e, 8_000, ctx_tokens=40 * 8_000)
    assert attended > 2 * by_usage
    assert attended == PERF.decode_step_time(41, 41 * 8_000)
    busy = tpot_s(PERF, e, 8_000, duty=0.5, ctx_tokens=40 * 8_000)
    full = PERF.step_time([(PERF.max_num_batched_tokens - 41, 0)], 41, 41 * 8_000)
    assert busy == 0.5 * attended + 0.5 * full
    assert tpot_s(PERF, e, 8_000, duty=7.0, ctx_tokens=0) == tpot_s(
        PERF, e, 8_000, duty=1.0, ctx_tokens=0
    )  # the duty cycle is clamped to [0, 1]
