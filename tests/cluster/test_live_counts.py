"""The registry's view corrects a lagging scrape with the attempts that ended after it."""

from __future__ import annotations

from gateway.cluster.registry import EngineMetrics, EngineRegistry


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def setup() -> tuple[EngineRegistry, Clock]:
    clock = Clock()
    reg = EngineRegistry(clock=clock)
    reg.add("http://e0")
    reg.mark_success("http://e0", 0.0)
    return reg, clock


def counts(reg: EngineRegistry) -> tuple[int, int]:
    (e,) = reg.view({}).engines
    return e.num_running, e.num_waiting


def test_a_request_that_ended_after_the_scrape_no_longer_counts() -> None:
    reg, clock = setup()
    e = reg.get("http://e0")
    assert e is not None
    reg.begin_attempt(e.id, "a")
    reg.begin_attempt(e.id, "b")
    reg.begin_attempt(e.id, "c")
    clock.t = 1.0
    e.observe(EngineMetrics(running=2, waiting=1), clock.t)  # the scrape sees all three
    assert counts(reg) == (2, 1)
    clock.t = 1.5
    reg.end_attempt(e.id, "a")
    assert counts(reg) == (1, 1)  # running first
    reg.end_attempt(e.id, "a")  # idempotent
    assert counts(reg) == (1, 1)
    reg.end_attempt(e.id, "b")
    reg.end_attempt(e.id, "c")
    assert counts(reg) == (0, 0)  # then waiting, never below zero
    clock.t = 2.0
    e.observe(EngineMetrics(running=0, waiting=0), clock.t)
    assert counts(reg) == (0, 0) and e.left_since_scrape == 0


def test_a_request_that_began_after_the_scrape_does_not_discount_it() -> None:
    """Another client's request (or one this scrape did not see) keeps the scrape's count."""
    reg, clock = setup()
    e = reg.get("http://e0")
    assert e is not None
    e.observe(EngineMetrics(running=1), 1.0)  # someone else's request is running
    clock.t = 1.2
    reg.begin_attempt(e.id, "ours")
    clock.t = 1.4
    reg.end_attempt(e.id, "ours")  # ours began after the scrape: it is not in its count
    assert counts(reg) == (1, 0)


def test_a_new_scrape_starts_the_count_again() -> None:
    reg, clock = setup()
    e = reg.get("http://e0")
    assert e is not None
    reg.begin_attempt(e.id, "a")
    reg.begin_attempt(e.id, "b")
    e.observe(EngineMetrics(running=2), 0.5)
    clock.t = 0.7
    reg.end_attempt(e.id, "a")
    e.observe(EngineMetrics(running=1), 1.0)  # "b" still running, "a" gone from the scrape
    clock.t = 1.2
    assert counts(reg) == (1, 0)
    reg.end_attempt(e.id, "b")
    assert counts(reg) == (0, 0)


def usage(reg: EngineRegistry) -> float:
    (e,) = reg.view({}).engines
    return e.kv_usage


def test_kv_held_by_requests_that_ended_after_the_scrape_counts_as_free() -> None:
    """A scrape taken mid-request shows its blocks held; once the request ends they are
    free, or the engine last seen busy keeps looking fuller (its decode step slower to the
    cost model) and sequential clients pile onto the other one."""
    reg, clock = setup()
    e = reg.get("http://e0")
    assert e is not None
    reg.begin_attempt(e.id, "a")
    reg.begin_attempt(e.id, "b")
    clock.t = 1.0
    e.observe(EngineMetrics(running=2, kv_usage=0.4), clock.t)
    assert usage(reg) == 0.4
    clock.t = 1.5
    reg.end_attempt(e.id, "a")
    assert usage(reg) == 0.2  # half the running requests left: half the blocks
    reg.end_attempt(e.id, "b")
    assert usage(reg) == 0.0


def test_kv_held_with_nothing_running_is_kept() -> None:
    """Blocks held with no request running (a prefill engine's KV waiting for its decode
    engine to pull it) are not scaled away."""
    reg, clock = setup()
    e = reg.get("http://e0")
    assert e is not None
    reg.begin_attempt(e.id, "a")
    e.observe(EngineMetrics(running=0, kv_usage=0.3), 1.0)
    clock.t = 1.5
    reg.end_attempt(e.id, "a")
    assert usage(reg) == 0.3
