"""EngineCore driven by a tiny event loop, plus PerfModel formulas, queues and presets."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.core.blocks import hashes_from_tokens
from gateway.core.errors import ConfigError
from gateway.perfmodel.engine import EngineCore, EngineRequest, StepOutcome
from gateway.perfmodel.model import PerfModel
from gateway.perfmodel.presets import (
    DEFAULT_PRESET,
    available_presets,
    load_preset,
    preset_from_dict,
)
from gateway.perfmodel.queues import PRIORITY_GROUPS, priority_group
from tests.perfmodel.test_frontend_and_wake import run as run_to_idle

INF = float("inf")
ENGINE = settings(max_examples=40, deadline=None)


def make_model(**overrides: object) -> PerfModel:
    base: dict[str, object] = {
        "name": "tiny",
        "prefill_a": 1.0,
        "prefill_b": 0.05,
        "prefill_c": 0.002,
        "prefill_d": 0.0001,
        "decode_e0": 2.0,
        "decode_e1": 0.1,
        "decode_e2": 0.003,
        "block_size": 4,
        "kv_capacity_blocks": 40,
        "max_num_batched_tokens": 32,
        "max_num_seqs": 4,
        "max_model_len": 4096,
    }
    base.update(overrides)
    return PerfModel(**base)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Spec:
    rid: str
    at: float
    tokens: tuple[int, ...]
    output: int


def build_requests(specs: list[Spec], block_size: int) -> list[tuple[float, EngineRequest]]:
    return [
        (
            s.at,
            EngineRequest(
                id=s.rid,
                prompt_tokens=len(s.tokens),
                block_hashes=hashes_from_tokens(s.tokens, block_size),
                output_tokens=s.output,
                arrival=s.at,
            ),
        )
        for s in specs
    ]


@st.composite
def workloads(draw: st.DrawFn, max_requests: int = 10) -> tuple[PerfModel, list[Spec]]:
    """A small model plus requests built from a few shared prefixes."""
    bs = draw(st.sampled_from([4, 16]), label="block_size")
    n_prefixes = draw(st.integers(1, 3))
    prefixes = [
        tuple(draw(st.lists(st.integers(0, 50), min_size=bs, max_size=5 * bs)))
        for _ in range(n_prefixes)
    ]
    n = draw(st.integers(1, max_requests), label="requests")
    specs = []
    for i in range(n):
        prefix = prefixes[draw(st.integers(0, n_prefixes - 1))]
        keep = draw(st.just(len(prefix)) | st.integers(0, len(prefix)), label="keep")
        suffix = draw(st.lists(st.integers(100, 120), max_size=2 * bs))
        tokens = prefix[:keep] + tuple(suffix)
        if not tokens:
            tokens = (999,)
        at = draw(st.floats(0.0, 0.15, allow_nan=False), label="at")
        out = draw(st.integers(1, 50), label="output")
        specs.append(Spec(f"r{i}", at, tokens, out))
    largest = max(-(-(len(s.tokens) + s.output) // bs) for s in specs)
    capacity = draw(st.integers(largest, largest + 12), label="kv_blocks")
    model = make_model(
        block_size=bs,
        kv_capacity_blocks=capacity,
        max_num_batched_tokens=draw(st.sampled_from([8, 16, 32, 64])),
        max_num_seqs=draw(st.integers(1, 6)),
    )
    return model, specs


# --------------------------------------------------------------------------- driver


@dataclass
class Trace:
    outcomes: list[StepOutcome] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)
    first: dict[str, int] = field(default_factory=dict)
    finished: dict[str, int] = field(default_factory=dict)
    interrupts: list[tuple[float, float]] = field(default_factory=list)  # (now, new end)
    run_ctx: dict[float, tuple[int, int]] = field(default_factory=dict)  # end -> (batch, ctx)


def check_pool(engine: EngineCore) -> None:
    pool = engine.pool
    assert pool.used + pool.evictable <= pool.capacity
    assert pool.free >= 0
    assert pool.available == pool.capacity - pool.used


def drive(
    engine: EngineCore,
    submits: list[tuple[float, EngineRequest]],
    *,
    horizon: bool = True,
    interrupt: bool = False,
    aborts: dict[float, list[str]] | None = None,
    max_events: int = 100_000,
) -> Trace:
    """Run ``engine`` until all work is done.

    Events at equal times: a step ending at t finishes first, then requests
    arriving at t are submitted, then the next step is planned. With
    ``horizon`` each step is planned with the next arrival as its horizon; with
    ``interrupt`` a request arriving mid-step cuts the current run short.
    """
    trace = Trace()
    pending = sorted(submits, key=lambda p: p[0])
    abort_times = sorted((aborts or {}).items())
    now = 0.0
    end: float | None = None
    for _ in range(max_events):
        next_sub = pending[0][0] if pending else INF
        next_abort = abort_times[0][0] if abort_times else INF
        if end is not None and min(next_sub, next_abort) >= end:
            assert end >= now
            now = end
            out = engine.finish_step()
            end = None
            record(engine, trace, out)
            continue
        if next_abort <= next_sub and next_abort < INF and (end is not None or next_abort <= now):
            now = max(now, next_abort)
            for rid in abort_times.pop(0)[1]:
                engine.abort(rid)
            continue
        if pending and (end is not None or next_sub <= now):
            now = max(now, next_sub)
            engine.submit(pending.pop(0)[1])
            if end is not None and interrupt:
                new_end = engine.interrupt(now)
                assert new_end is not None and new_end <= end
                trace.interrupts.append((now, new_end))
                end = new_end
            continue
        if end is None and engine.has_work:
            h = (pending[0][0] if pending else INF) if horizon else INF
            end = engine.start_step(now, horizon=h)
            if end is not None:
                assert end >= now
                assert engine.busy and engine.step_end == end
                continue
        if not pending and not abort_times:
            assert not engine.busy
            assert not engine.has_work, "engine idle with work left"
            return trace
        now = max(now, min(next_sub, next_abort))
    raise AssertionError("event loop did not terminate")


def record(engine: EngineCore, trace: Trace, out: StepOutcome) -> None:
    check_pool(engine)
    assert out.end >= out.start
    if trace.outcomes:
        assert out.start >= trace.outcomes[-1].end
    assert out.steps >= 1
    trace.outcomes.append(out)
    if out.tokens and not out.prefill_tokens:
        # A pure decode step or run: recover its batch and starting context.
        batch = len(out.tokens)
        assert all(n == out.steps for _, n in out.tokens)
        assert out.decode_tokens == batch * out.steps
        ctx = sum(r.num_computed for r, _ in out.tokens) - batch * out.steps
        trace.run_ctx[out.end] = (batch, ctx)
    for req, n in out.tokens:
        assert n >= 1
        trace.tokens[req.id] = trace.tokens.get(req.id, 0) + n
    for req in out.first_tokens:
        trace.first[req.id] = trace.first.get(req.id, 0) + 1
        assert req.first_token_time == out.end
    for req in out.finished:
        trace.finished[req.id] = trace.finished.get(req.id, 0) + 1
        assert req.finish_time == out.end
    # Every block a running request holds is accounted for, and nothing else is held
    # (hashed blocks may be shared between requests: count them once).
    held = {h for r in engine.running for h in r.held}
    assert engine.pool.used == len(held) + sum(r.anon for r in engine.running)


def run(
    model: PerfModel, specs: list[Spec], **kwargs: object
) -> tuple[EngineCore, list[EngineRequest], Trace]:
    engine_kwargs = {k: kwargs.pop(k) for k in ("priority_groups", "max_decode_run") if k in kwargs}
    engine = EngineCore("e0", model, **engine_kwargs)  # type: ignore[arg-type]
    submits = build_requests(specs, model.block_size)
    trace = drive(engine, submits, **kwargs)  # type: ignore[arg-type]
    return engine, [r for _, r in submits], trace


def check_completed(
    model: PerfModel, engine: EngineCore, reqs: list[EngineRequest], trace: Trace
) -> None:
    bs = model.block_size
    assert engine.pending_prefix_blocks == 0  # every request's blocks left the pending set
    for r in reqs:
        assert trace.finished.get(r.id) == 1, r.id
        assert trace.first.get(r.id) == 1, r.id
        assert trace.tokens.get(r.id) == r.output_tokens, r.id
        assert r.num_output == r.output_tokens
        assert r.first_token_time is not None and r.finish_time is not None
        assert r.first_scheduled is not None
        assert r.arrival <= r.first_scheduled <= r.first_token_time <= r.finish_time
        if r.output_tokens == 1:
            assert r.finish_time == r.first_token_time
        assert r.cached_tokens is not None
        assert r.cached_tokens % bs == 0
        assert 0 <= r.cached_tokens <= ((r.prompt_tokens - 1) // bs) * bs
    assert engine.pool.used == 0
    assert not engine.has_work and not engine.busy
    if engine.preemptions == 0:
        # With preemption this leaks (see test_pending_prefill_tokens_after_preemption).
        assert engine.pending_prefill_tokens == 0
    assert engine.steps == sum(o.steps for o in trace.outcomes)
    assert engine.preemptions == sum(len(o.preempted) for o in trace.outcomes)
    assert engine.preemptions == sum(r.preemptions for r in reqs)


def summary(reqs: list[EngineRequest]) -> list[tuple[object, ...]]:
    return [
        (r.id, r.cached_tokens, r.first_scheduled, r.first_token_time, r.finish_time, r.preemptions)
        for r in reqs
    ]


# --------------------------------------------------------------------------- properties


@ENGINE
@given(w=workloads())
def test_every_request_completes_exactly(w: tuple[PerfModel, list[Spec]]) -> None:
    model, specs = w
    engine, reqs, trace = run(model, specs)
    check_completed(model, engine, reqs, trace)


@ENGINE
@given(w=workloads())
def test_ttft_never_below_own_uncached_prefill(w: tuple[PerfModel, list[Spec]]) -> None:
    model, specs = w
    _, reqs, _ = run(model, specs)
    for r in reqs:
        assert r.first_token_time is not None and r.cached_tokens is not None
        ttft = r.first_token_time - r.arrival
        floor = model.prefill_time(r.prompt_tokens - r.cached_tokens, r.cached_tokens)
        assert ttft >= floor * (1 - 1e-12), (r.id, ttft, floor, r.preemptions)


@ENGINE
@given(w=workloads())
def test_deterministic(w: tuple[PerfModel, list[Spec]]) -> None:
    model, specs = w
    e1, r1, t1 = run(model, specs)
    e2, r2, t2 = run(model, specs)
    assert summary(r1) == summary(r2)
    assert e1.steps == e2.steps and e1.preemptions == e2.preemptions
    assert [(o.start, o.end, o.steps) for o in t1.outcomes] == [
        (o.start, o.end, o.steps) for o in t2.outcomes
    ]


def _assert_same_times(a: list[EngineRequest], b: list[EngineRequest]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.cached_tokens == y.cached_tokens, x.id
        assert x.preemptions == y.preemptions, x.id
        assert x.first_token_time == pytest.approx(y.first_token_time, rel=1e-9, abs=1e-12), x.id
        assert x.finish_time == pytest.approx(y.finish_time, rel=1e-9, abs=1e-12), x.id


@ENGINE
@given(w=workloads())
def test_decode_runs_match_single_steps(w: tuple[PerfModel, list[Spec]]) -> None:
    """A run of k identical decode steps is priced in closed form: same times as k steps."""
    model, specs = w
    e1, single, _ = run(model, specs, max_decode_run=1)
    e256, runs, _trace = run(model, specs, max_decode_run=256)
    _assert_same_times(single, runs)
    assert e1.steps == e256.steps
    assert e1.preemptions == e256.preemptions
    assert all(o.steps == 1 for o in run(model, specs, max_decode_run=1)[2].outcomes)


def test_decode_runs_actually_batch_steps() -> None:
    model = make_model()
    specs = [Spec("a", 0.0, tuple(range(10)), 40), Spec("b", 0.0, tuple(range(50, 57)), 30)]
    e1, single, t1 = run(model, specs, max_decode_run=1)
    e2, runs, t2 = run(model, specs, max_decode_run=256)
    assert len(t2.outcomes) < len(t1.outcomes) // 4
    assert max(o.steps for o in t2.outcomes) >= 20
    _assert_same_times(single, runs)
    assert e1.steps == e2.steps


@ENGINE
@given(w=workloads())
def test_interrupted_runs_complete_and_cut_at_a_step_boundary(
    w: tuple[PerfModel, list[Spec]],
) -> None:
    """Long runs (no horizon) cut by each arrival: still exact, cuts on step boundaries."""
    model, specs = w
    engine, reqs, trace = run(model, specs, horizon=False, interrupt=True)
    check_completed(model, engine, reqs, trace)
    by_end = {o.end: o for o in trace.outcomes}
    for now, new_end in trace.interrupts:
        assert new_end >= now - 1e-12
        check_cut(model, by_end[new_end], now, trace.run_ctx)


def check_cut(
    model: PerfModel, out: StepOutcome, now: float, run_ctx: dict[float, tuple[int, int]]
) -> None:
    """``out`` ends at the first decode-step boundary at or after ``now``."""
    assert out.start <= now <= out.end + 1e-12
    if out.prefill_tokens or not out.tokens:
        return
    batch, ctx = run_ctx[out.end]
    k = out.steps
    assert out.end == pytest.approx(out.start + model.decode_run_time(batch, ctx, k), rel=1e-12)
    if k > 1:
        assert out.start + model.decode_run_time(batch, ctx, k - 1) < now


_EVICT_CASE = (
    make_model(kv_capacity_blocks=11),
    [
        Spec("a", 0.0, tuple(range(9)), 1),
        Spec("d", 0.0, (500,), 40),
        Spec("a2", 0.02, tuple(range(9)), 1),
    ],
)


@ENGINE
@given(w=workloads())
@example(w=_EVICT_CASE)
def test_interrupted_runs_match_single_steps(w: tuple[PerfModel, list[Spec]]) -> None:
    """A run cut at the first boundary after an arrival admits it when single steps would."""
    model, specs = w
    _, single, _ = run(model, specs, max_decode_run=1)
    _, cut, _ = run(model, specs, max_decode_run=256, horizon=False, interrupt=True)
    _assert_same_times(single, cut)


@pytest.mark.parametrize(
    "max_decode_run",
    [1, 256],
)
def test_interrupted_run_keeps_prefix_cache(max_decode_run: int) -> None:
    model = make_model(kv_capacity_blocks=11)
    engine = EngineCore("e0", model, max_decode_run=max_decode_run, track_cache_events=True)
    prefix = hashes_from_tokens(range(9), 4)
    engine.submit(EngineRequest("a", 9, prefix, 1, 0.0))  # leaves 2 cached blocks behind
    engine.submit(EngineRequest("d", 1, (), 40, 0.0))  # then decodes alone for a long time
    t = engine.start_step(0.0)
    assert t is not None
    engine.finish_step()
    assert engine.pool.match(prefix) == 2
    assert engine.start_step(t) is not None
    end = engine.interrupt(t + 1e-6)  # an arrival just after the step began
    out = engine.finish_step()
    assert out.steps == 1 and out.end == end
    # One decode step needs no eviction: 8 blocks were free.
    assert out.removed == []
    assert engine.pool.match(prefix) == 2


@ENGINE
@given(w=workloads(), seed=st.integers(0, 2**32 - 1))
def test_interrupt_every_step_at_random_time(w: tuple[PerfModel, list[Spec]], seed: int) -> None:
    """Cut every planned step at a random instant; the engine must stay exact."""
    model, specs = w
    rng = random.Random(seed)
    engine = EngineCore("e0", model, max_decode_run=256)
    at_zero = [Spec(sp.rid, 0.0, sp.tokens, sp.output) for sp in specs]
    submits = build_requests(at_zero, model.block_size)
    for _, r in submits:
        engine.submit(r)
    trace = Trace()
    now = 0.0
    for _ in range(100_000):
        end = engine.start_step(now)
        if end is None:
            break
        t = now + rng.random() * (end - now)
        used_before = engine.pool.used
        new_end = engine.interrupt(t)
        assert new_end is not None and new_end <= end
        assert new_end >= t - 1e-12  # interrupt() allows 1e-12 s of rounding
        assert engine.step_end == new_end
        assert engine.pool.used <= used_before  # blocks of cut steps come back
        assert engine.interrupt(new_end) == new_end  # at the end already: no change
        out = engine.finish_step()
        assert out.end == new_end
        record(engine, trace, out)
        check_cut(model, out, t, trace.run_ctx)
        if new_end < end:
            assert out.prefill_tokens == 0  # only decode runs are cut
        now = out.end
    check_completed(model, engine, [r for _, r in submits], trace)


_PG_CASE = (
    make_model(kv_capacity_blocks=9, max_num_batched_tokens=8, max_num_seqs=2),
    [
        Spec("r0", 0.0625, (0, 0, 0, 0, 100), 1),
        Spec("r1", 0.0, (999,), 1),
        Spec("r2", 0.0, (0, 0, 0, 0), 27),
        Spec("r3", 0.0, (999,), 19),
        Spec("r4", 0.0, (999,), 1),
    ],
)


@ENGINE
@given(w=workloads())
@example(w=_PG_CASE)
def test_decode_runs_match_single_steps_with_priority_groups(
    w: tuple[PerfModel, list[Spec]],
) -> None:
    model, specs = w
    _, single, _ = run(model, specs, max_decode_run=1, priority_groups=True)
    _, runs, _ = run(model, specs, max_decode_run=256, priority_groups=True)
    for x, y in zip(single, runs, strict=True):
        assert x.first_scheduled == pytest.approx(y.first_scheduled, rel=1e-9, abs=1e-12), x.id
    _assert_same_times(single, runs)


@ENGINE
@given(w=workloads())
def test_priority_groups_complete_everything(w: tuple[PerfModel, list[Spec]]) -> None:
    model, specs = w
    engine, reqs, trace = run(model, specs, priority_groups=True)
    check_completed(model, engine, reqs, trace)
    engine, reqs, trace = run(model, specs, priority_groups=True, interrupt=True, horizon=False)
    check_completed(model, engine, reqs, trace)


@ENGINE
@given(w=workloads(), seed=st.integers(0, 2**32 - 1))
def test_aborts_free_blocks(w: tuple[PerfModel, list[Spec]], seed: int) -> None:
    model, specs = w
    rng = random.Random(seed)
    aborted = {s.rid for s in specs if rng.random() < 0.4}
    aborts: dict[float, list[str]] = {}
    for rid in sorted(aborted):
        aborts.setdefault(rng.uniform(0.0, 0.3), []).append(rid)
    engine, reqs, trace = run(model, specs, aborts=aborts)
    assert engine.pool.used == 0
    assert not engine.has_work
    assert engine.pending_prefix_blocks == 0
    if engine.preemptions == 0:
        assert engine.pending_prefill_tokens == 0
    for r in reqs:
        if r.id not in aborted:
            assert trace.finished.get(r.id) == 1
            assert trace.tokens.get(r.id) == r.output_tokens
        else:
            assert trace.finished.get(r.id, 0) <= 1
            assert trace.tokens.get(r.id, 0) <= r.output_tokens
        assert engine.abort(r.id) is False  # gone from the engine


def test_pending_prefill_counts_a_prefix_queued_ahead_once() -> None:
    """A request queued behind another with the same prefix will hit it: its pending prefill
    is its own tail, and the prefix leaves the pending set once it is computed."""
    model = make_model(max_num_seqs=1)
    engine = EngineCore("e0", model)
    doc = list(range(40))
    a = EngineRequest("a", 44, hashes_from_tokens([*doc, 1, 2, 3, 4], 4), 2, 0.0)
    b = EngineRequest("b", 44, hashes_from_tokens([*doc, 5, 6, 7, 8], 4), 2, 0.0)
    engine.submit(a)
    engine.submit(b)
    assert engine.pending_prefill_tokens == 44 + 4  # b computes only its own last block
    assert engine.pending_prefix_blocks == 10  # the shared full blocks (the last is computed)
    # aborting a before it runs: b's estimate is not revised, a's blocks leave the set
    assert engine.abort("a") is True
    assert engine.pending_prefill_tokens == 4 and engine.pending_prefix_blocks == 10
    t = run_to_idle(engine, 0.0)
    assert engine.pending_prefill_tokens == 0 and engine.pending_prefix_blocks == 0
    c = EngineRequest("c", 44, hashes_from_tokens([*doc, 9, 9, 9, 9], 4), 2, t)
    engine.submit(c)  # the prefix is cached now
    assert engine.pending_prefill_tokens == 4


def test_abort_waiting_and_running() -> None:
    model = make_model(max_num_seqs=1)
    engine = EngineCore("e0", model)
    a = EngineRequest("a", 20, hashes_from_tokens(range(20), 4), 10, 0.0)
    b = EngineRequest("b", 12, hashes_from_tokens(range(100, 112), 4), 5, 0.0)
    engine.submit(a)
    engine.submit(b)
    assert engine.pending_prefill_tokens == 32
    end = engine.start_step(0.0)
    assert end is not None and engine.num_running == 1 and engine.num_waiting == 1
    assert engine.pool.used > 0
    # b waits (one sequence slot): aborting it drops it at once.
    assert engine.abort("b") is True
    assert engine.num_waiting == 0
    assert engine.abort("nope") is False
    # a is mid-step: it leaves at the step's end, without tokens.
    assert engine.abort("a") is True
    out = engine.finish_step()
    assert out.aborted == [a] and out.tokens == [] and out.finished == []
    assert engine.pool.used == 0 and not engine.has_work
    assert engine.pending_prefill_tokens == 0
    assert a.first_token_time is None and b.first_token_time is None


def test_abort_running_between_steps() -> None:
    model = make_model()
    engine = EngineCore("e0", model)
    r = EngineRequest("a", 9, hashes_from_tokens(range(9), 4), 10, 0.0)
    engine.submit(r)
    end = engine.start_step(0.0)
    assert end is not None
    engine.finish_step()
    assert r.first_token_time == end and engine.pool.used > 0
    assert engine.abort("a") is True
    assert engine.pool.used == 0 and not engine.has_work
    assert engine.start_step(end) is None


def test_admissible_and_submit_reject_impossible_requests() -> None:
    model = make_model(kv_capacity_blocks=100, max_model_len=64)
    engine = EngineCore("e0", model)
    assert engine.admissible(10, 10) is None
    assert engine.admissible(0, 5) is not None
    assert engine.admissible(5, 0) is not None
    assert "max_model_len" in (engine.admissible(60, 5) or "")
    assert engine.admissible(60, 4) is None
    small = EngineCore("e1", make_model(kv_capacity_blocks=5, max_model_len=64))
    assert "KV capacity" in (small.admissible(18, 3) or "")  # 21 tokens = 6 blocks > 5
    assert small.admissible(17, 3) is None  # 20 tokens = 5 blocks
    with pytest.raises(ValueError, match="max_model_len"):
        engine.submit(EngineRequest("x", 60, (), 5, 0.0))
    with pytest.raises(ValueError):
        small.submit(EngineRequest("y", 18, (), 3, 0.0))
    with pytest.raises(ValueError):
        engine.submit(EngineRequest("z", 0, (), 3, 0.0))
    assert not engine.has_work and not small.has_work
    engine.submit(EngineRequest("ok", 10, (), 3, 0.0))
    with pytest.raises(ValueError, match="already"):
        engine.submit(EngineRequest("ok", 10, (), 3, 0.0))
    assert engine.num_waiting == 1


def test_prefix_hit_on_second_request() -> None:
    model = make_model(block_size=4)
    tokens = tuple(range(23))
    specs = [Spec("a", 0.0, tokens, 2), Spec("b", 1.0, tokens, 2), Spec("c", 2.0, tokens[:20], 2)]
    engine, reqs, trace = run(model, specs)
    check_completed(model, engine, reqs, trace)
    a, b, c = reqs
    assert a.cached_tokens == 0
    assert b.cached_tokens == 20  # all 5 full blocks
    assert c.cached_tokens == 16  # exactly 5 blocks: the last token is recomputed
    assert b.first_token_time is not None
    assert b.first_token_time - b.arrival == pytest.approx(model.prefill_time(3, 20))


def test_preemption_happens_and_outputs_stay_exact() -> None:
    model = make_model(kv_capacity_blocks=12, max_num_seqs=8, max_num_batched_tokens=64)
    specs = [Spec(f"r{i}", 0.0, tuple(range(i * 100, i * 100 + 12)), 30) for i in range(4)]
    engine, reqs, trace = run(model, specs)
    check_completed(model, engine, reqs, trace)
    assert engine.preemptions > 0


def test_pending_prefill_tokens_after_preemption() -> None:
    model = make_model(kv_capacity_blocks=4, max_num_batched_tokens=8, max_num_seqs=2)
    engine = EngineCore("e0", model, max_decode_run=1)
    a = EngineRequest("a", 1, (), 9, 0.0)
    b = EngineRequest("b", 1, (), 9, 0.0)
    engine.submit(a)
    engine.submit(b)
    run_to_idle(engine, 0.0)
    # b was preempted after 8 outputs and recomputed 9 tokens in chunks of 8 + 1.
    assert b.preemptions == 1
    assert a.num_output == b.num_output == 9
    assert engine.pending_prefill_tokens == 0


def test_step_already_planned_and_no_step_errors() -> None:
    engine = EngineCore("e0", make_model())
    with pytest.raises(RuntimeError):
        engine.finish_step()
    assert engine.start_step(0.0) is None
    assert engine.interrupt(0.0) is None
    engine.submit(EngineRequest("a", 5, (), 2, 0.0))
    assert engine.start_step(0.0) is not None
    with pytest.raises(RuntimeError):
        engine.start_step(0.0)


# --------------------------------------------------------------------------- Preble groups


@pytest.mark.parametrize(
    ("ratio", "group"),
    [(0.0, 0), (0.05, 0), (0.1, 0), (0.15, 1), (0.2, 1), (0.3, 2), (0.95, 9), (1.0, 9)],
)
def test_priority_group_mapping(ratio: float, group: int) -> None:
    assert priority_group(ratio) == group


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5000), data=st.data())
def test_priority_group_exact_for_rational_hit_ratios(n: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(0, n))
    expected = min(max(-(-PRIORITY_GROUPS * k // n) - 1, 0), PRIORITY_GROUPS - 1)
    assert priority_group(k / n) == expected


# --------------------------------------------------------------------------- PerfModel


def test_prefill_and_step_time_formulas() -> None:
    m = make_model(
        prefill_a=3.0,
        prefill_b=0.1,
        prefill_c=0.01,
        prefill_d=0.001,
        decode_e0=5.0,
        decode_e1=0.2,
        decode_e2=0.02,
    )
    assert m.prefill_time(0, 100) == 0.0
    assert m.prefill_time(100, 50) == pytest.approx((3.0 + 10.0 + 0.5 + 5.0) / 1000)
    assert m.prefill_time(100) == pytest.approx((3.0 + 10.0) / 1000)
    assert m.decode_step_time(0, 10) == 0.0
    assert m.decode_step_time(4, 100) == pytest.approx((5.0 + 0.8 + 2.0) / 1000)
    assert m.step_time([], 0, 0) == 0.0
    # Decodes only, prefill only, and mixed: the fixed cost is paid once, the larger one.
    assert m.step_time([], 4, 100) == pytest.approx(m.decode_step_time(4, 100))
    assert m.step_time([(100, 50)], 0, 0) == pytest.approx(m.prefill_time(100, 50))
    mixed = m.step_time([(100, 50), (10, 0)], 4, 100)
    assert mixed == pytest.approx((5.0 + (10.0 + 0.5 + 5.0) + 1.0 + 0.8 + 2.0) / 1000)
    m2 = m.with_overrides(prefill_a=9.0)
    assert m2.step_time([(10, 0)], 1, 0) == pytest.approx((9.0 + 1.0 + 0.2) / 1000)
    assert m.block_size == 4
    assert m.blocks_for(0) == 0 and m.blocks_for(1) == 1 and m.blocks_for(4) == 1
    assert m.blocks_for(5) == 2
    assert m.kv_capacity_tokens == m.kv_capacity_blocks * m.block_size
    assert m.seconds_per_prefill_token(10) == pytest.approx((0.1 + 0.01) / 1000)


def test_perfmodel_validation() -> None:
    with pytest.raises(ValueError):
        make_model(block_size=0)
    with pytest.raises(ValueError):
        make_model(kv_capacity_blocks=0)
    with pytest.raises(ValueError):
        make_model(prefill_b=-0.1)
    with pytest.raises(ValueError):
        make_model(decode_e2=float("nan"))
    with pytest.raises(ValueError):
        make_model(decode_e0=float("inf"))


# Zero, or a realistic magnitude (subnormal coefficients are covered separately below).
coef = st.just(0.0) | st.floats(1e-3, 20.0)
small_coef = st.just(0.0) | st.floats(1e-9, 0.05)
STEPS_CAP = 1 << 30


@settings(max_examples=200, deadline=None)
@given(
    e0=coef,
    e1=small_coef,
    e2=small_coef,
    batch=st.integers(1, 64),
    ctx=st.integers(0, 50_000),
    steps=st.integers(0, 300),
)
def test_decode_run_time_is_sum_of_steps(
    e0: float, e1: float, e2: float, batch: int, ctx: int, steps: int
) -> None:
    m = make_model(decode_e0=e0, decode_e1=e1, decode_e2=e2)
    total = math.fsum(m.decode_step_time(batch, ctx + i * batch) for i in range(steps))
    single = math.fsum(m.step_time([], batch, ctx + i * batch) for i in range(steps))
    assert m.decode_run_time(batch, ctx, steps) == pytest.approx(total, rel=1e-9, abs=1e-15)
    assert single == pytest.approx(total, rel=1e-12, abs=1e-15)
    assert m.decode_run_time(0, ctx, steps) == 0.0


@settings(max_examples=300, deadline=None)
@given(
    e0=coef,
    e1=small_coef,
    e2=small_coef,
    batch=st.integers(1, 64),
    ctx=st.integers(0, 50_000),
    budget=st.just(0.0) | st.floats(-1.0, 0.0) | st.floats(1e-6, 5.0),
)
def test_decode_steps_within_is_max_fitting_k(
    e0: float, e1: float, e2: float, batch: int, ctx: int, budget: float
) -> None:
    m = make_model(decode_e0=e0, decode_e1=e1, decode_e2=e2)
    k = m.decode_steps_within(batch, ctx, budget)
    assert m.decode_steps_within(0, ctx, budget) == 0
    if budget <= 0:
        assert k == 0
        return
    if e0 + e1 * batch + e2 * ctx == 0 and e2 == 0:
        assert k == STEPS_CAP  # free steps: as many as allowed
        return
    assert 0 <= k <= STEPS_CAP
    assert m.decode_run_time(batch, ctx, k) <= budget
    if k < STEPS_CAP:
        assert m.decode_run_time(batch, ctx, k + 1) > budget


def test_decode_steps_within_examples() -> None:
    m = make_model(decode_e0=10.0, decode_e1=0.0, decode_e2=0.0)
    assert m.decode_steps_within(1, 0, 0.1) == 10  # exactly 10 steps of 10 ms
    assert m.decode_steps_within(1, 0, 0.0999) == 9
    assert m.decode_steps_within(1, 0, 0.0) == 0
    g = make_model(decode_e0=1.0, decode_e1=0.0, decode_e2=0.5)
    # steps cost 1+0.5*ctx with ctx = 2, 3, 4, ... -> 2, 2.5, 3, 3.5 ms
    assert g.decode_steps_within(1, 2, 0.0075) == 3
    assert g.decode_steps_within(1, 2, 0.0074) == 2


@pytest.mark.parametrize(
    ("e1", "e2", "ctx", "budget", "expected"),
    [
        (0.0, 1.0, 0, 1e-245, 1),  # 1st step free, 2nd costs 1 ms
        (1.1125369292536007e-308, 0.0, 0, 1.0, STEPS_CAP),  # nearly free steps
    ],
)
def test_decode_steps_within_degenerate(
    e1: float, e2: float, ctx: int, budget: float, expected: int
) -> None:
    m = make_model(decode_e0=0.0, decode_e1=e1, decode_e2=e2)
    assert m.decode_steps_within(1, ctx, budget) == expected


# --------------------------------------------------------------------------- presets


def test_every_builtin_preset_loads() -> None:
    names = available_presets()
    assert names == sorted(names)
    assert DEFAULT_PRESET in names
    assert {"llama3-8b-h100", "mistral-7b-a6000"} <= set(names)
    for name in names:
        m = load_preset(name)
        assert isinstance(m, PerfModel)
        assert m.name == name
        assert m.block_size > 0 and m.kv_capacity_blocks > 0
        assert m.prefill_time(512) > 0 and m.decode_step_time(8, 4096) > 0
        assert m.max_num_batched_tokens > 0 and m.max_num_seqs > 0
        assert isinstance(m.sources, tuple)


def test_unknown_preset_names_it() -> None:
    with pytest.raises(ConfigError, match="no-such-preset"):
        load_preset("no-such-preset")
    with pytest.raises(ConfigError, match=r"missing\.yaml"):
        load_preset("/nonexistent/missing.yaml")


def test_preset_file_from_yaml(tmp_path) -> None:
    path = tmp_path / "my-gpu.yaml"
    path.write_text(
        "prefill_a: 2.5\nprefill_b: 0.1\ndecode_e0: 8\nblock_size: 32\n"
        "kv_capacity_blocks: 123\nsources:\n  - a\n  - b\n",
        encoding="utf-8",
    )
    m = load_preset(str(path))
    assert m.name == "my-gpu"  # defaults to the file's stem
    assert (m.prefill_a, m.prefill_b, m.decode_e0) == (2.5, 0.1, 8)
    assert (m.block_size, m.kv_capacity_blocks) == (32, 123)
    assert m.sources == ("a", "b")
    jpath = tmp_path / "j.json"
    jpath.write_text('{"name": "jj", "prefill_a": 1, "prefill_b": 0.5}', encoding="utf-8")
    assert load_preset(str(jpath)).name == "jj"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("prefill_a: 1\nprefill_b: 0.1\nwarp_speed: 9\n", "warp_speed"),
        ("- just\n- a list\n", "mapping"),
        ("prefill_a: [1,\n", "YAML"),
        ("prefill_a: 1\nprefill_b: 0.1\nblock_size: 0\n", "block_size"),
        ("prefill_b: 0.1\n", "prefill_a"),
    ],
)
def test_bad_preset_files_raise_config_error(tmp_path, text: str, needle: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=needle) as info:
        load_preset(str(path))
    assert "bad.yaml" in str(info.value)


def test_preset_from_dict_unknown_field() -> None:
    with pytest.raises(ConfigError, match="unknown field"):
        preset_from_dict({"prefill_a": 1, "prefill_b": 1, "oops": 2}, source="x")
