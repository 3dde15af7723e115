"""Prefill side of P/D: prompt KV held for a decode engine to pull (vLLM's NIXL lease).

When a prefill leg (``kv_transfer_params.do_remote_decode``) finishes, the
driver takes a reference on the request's cached prompt blocks and records a
:class:`Pin` under the id the client gets back as ``remote_request_id``. The
blocks stay held (they count in ``kv_cache_usage_perc`` and cannot be evicted)
until the decode engine reports them read (``POST /kvgate/kv_release``) or the
lease runs out, whichever comes first. The lease is in wall-clock seconds, like
vLLM's ``kv_lease_duration``. At most ``max_pins`` pins are kept; beyond that
the oldest is dropped as if expired, so memory stays bounded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.perfmodel.kvcache import BlockPool

DEFAULT_LEASE = 30.0
MAX_PINS = 65_536


@dataclass(frozen=True, slots=True)
class Pin:
    """One finished prefill whose KV waits for its decode engine."""

    id: str
    hashes: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int
    block_ids: tuple[int, ...]
    expires: float
    """Wall-clock time (``time.time()``) at which the blocks are freed unread."""


class KvPins:
    """The pins of one engine, in expiry order (the lease is the same for all)."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        *,
        lease: float = DEFAULT_LEASE,
        max_pins: int = MAX_PINS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not lease > 0:
            raise ValueError(f"the KV lease must be positive, got {lease}")
        self.pool = pool
        self.block_size = block_size
        self.lease = lease
        self.max_pins = max(1, max_pins)
        self.clock = clock
        self.expired = 0
        """Pins freed unread (lease over or evicted by ``max_pins``), for the metrics."""
        self._pins: dict[str, Pin] = {}
        self._next_block = 0

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, pin_id: object) -> bool:
        return pin_id in self._pins

    @property
    def blocks(self) -> int:
        """Block references the pins hold."""
        return sum(len(p.hashes) for p in self._pins.values())

    def get(self, pin_id: str) -> Pin | None:
        return self._pins.get(pin_id)

    def pin(
        self, pin_id: str, hashes: Sequence[int], *, prompt_tokens: int, cached_tokens: int
    ) -> Pin:
        """Hold the cached leading blocks of ``hashes`` under ``pin_id`` for one lease."""
        self.expire()
        old = self._pins.pop(pin_id, None)
        if old is not None:
            self.pool.release(old.hashes, 0)
        held = tuple(hashes[: self.pool.match(hashes)])
        self.pool.acquire(held)
        count = max(1, -(-prompt_tokens // self.block_size))  # full blocks and a partial tail
        first, cap = self._next_block, self.pool.capacity
        self._next_block = (first + count) % cap
        ids = tuple((first + i) % cap + 1 for i in range(count))
        pin = Pin(pin_id, held, prompt_tokens, cached_tokens, ids, self.clock() + self.lease)
        self._pins[pin_id] = pin
        while len(self._pins) > self.max_pins:
            self._drop(next(iter(self._pins)))
            self.expired += 1
        return pin

    def release(self, pin_id: str) -> bool:
        """The decode engine read the blocks: free them. False when unknown or expired."""
        self.expire()
        if pin_id not in self._pins:
            return False
        self._drop(pin_id)
        return True

    def expire(self, now: float | None = None) -> int:
        """Free every pin whose lease is over; returns how many."""
        now = self.clock() if now is None else now
        pins = self._pins
        n = 0
        while pins:
            first = next(iter(pins.values()))
            if first.expires > now:
                break
            self._drop(first.id)
            n += 1
        self.expired += n
        return n

    def clear(self) -> None:
        """Free every pin (the engine stops)."""
        for pin_id in list(self._pins):
            self._drop(pin_id)

    def _drop(self, pin_id: str) -> None:
        pin = self._pins.pop(pin_id)
        self.pool.release(pin.hashes, 0)

    async def run(self) -> None:
        """Expire pins in the background, a few times per lease (at most every second)."""
        tick = min(1.0, max(0.005, self.lease / 4))
        while True:
            await asyncio.sleep(tick)
            self.expire()
