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
