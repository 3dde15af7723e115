"""Injected clocks: the only way pure code learns the time.

Policies receive ``now`` as an argument; drivers (the simulator, the gateway,
the emulator) own a :class:`Clock` and pass its reading down.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """A source of monotonic seconds."""

    def now(self) -> float: ...


class MonotonicClock:
    """Real time: ``time.monotonic()`` (never jumps backwards)."""

    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """Virtual time that only moves when told to (simulator, tests)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def set(self, t: float) -> None:
        if t < self._now:
            raise ValueError(f"clock cannot go backwards: {t} < {self._now}")
        self._now = t

    def advance(self, dt: float) -> None:
        self.set(self._now + dt)
