"""EngineDriver: runs an :class:`EngineCore` in real time on the asyncio loop.

One background task owns the core. While the core has work it plans a step,
sleeps until that step's end (virtual seconds × ``time_scale`` real seconds),
applies the step and hands the tokens it produced to each request's
:class:`GenerationHandle`. With no work it waits on an event that
:meth:`EngineDriver.submit` sets. Virtual time is ``(loop.time() - start) /
time_scale``; back-to-back steps are chained on the engine's own clock, which
may run ahead of it by ``_LEAD`` and fall behind by ``_LAG`` real seconds
(asyncio timers have about 1 ms resolution), so timer jitter neither stretches
nor shrinks the modelled step times. When the loop cannot keep up for longer
(tiny ``time_scale``, heavy load) steps start late, as on a busy GPU.

Handles (:mod:`gateway.emulator.handle`) never block the driver. The core
runs with ``max_decode_run=1``: one step per token, so new requests join the
batch at the next step boundary. For P/D, a request submitted with ``pin_id``
keeps its prompt KV pinned in :attr:`EngineDriver.pins` when it finishes, and
one with ``remote_tokens`` loads that much of its prompt instead of computing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Protocol

from gateway.core.blocks import hashes_from_tokens, partition_seed
from gateway.core.vllm_hash import LoraKey
from gateway.emulator.handle import (
    EngineDeadError,
    GenerationHandle,
    RequestRejectedError,
    TokenDelta,
)
from gateway.emulator.kv_publisher import KVEventPublisher
from gateway.emulator.kvpins import DEFAULT_LEASE, KvPins
from gateway.emulator.tokenizer import natural_length, prompt_digest
from gateway.perfmodel.engine import EngineCore, EngineRequest, StepOutcome
from gateway.perfmodel.model import PerfModel

__all__ = [
    "DriverObserver",
    "EngineDeadError",
    "EngineDriver",
    "GenerationHandle",
    "RequestRejectedError",
    "TokenDelta",
]

log = logging.getLogger(__name__)
_LEAD = 0.002
"""Real seconds the engine clock may run ahead of the wall clock before the driver sleeps."""
_LAG = 0.05
"""Real seconds the engine clock may fall behind the wall clock (timer jitter, a busy
loop) before the next step is re-anchored to the wall clock."""


class DriverObserver(Protocol):
    """Receives engine events (in virtual seconds); the Prometheus metrics implement it."""

    def on_scheduled(self, handle: GenerationHandle) -> None: ...
    def on_step(self, outcome: StepOutcome) -> None: ...
    def on_tokens(self, handle: GenerationHandle, count: int, gap: float | None) -> None: ...
    def on_finished(self, handle: GenerationHandle, reason: str, now: float) -> None: ...


class EngineDriver:
    """Steps one :class:`EngineCore` in real time; requests come in via :meth:`submit`."""

    def __init__(
        self,
        model: PerfModel,
        *,
        engine_id: str = "0",
        time_scale: float = 1.0,
        seed: int = 0,
        observer: DriverObserver | None = None,
        priority_groups: bool = False,
        kv_lease: float = DEFAULT_LEASE,
        kv_events: KVEventPublisher | None = None,
    ) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        self.model = model
        self.kv_events = kv_events
        """Publishes the prefix cache's stored and evicted blocks (vLLM's KV events)."""
        self.core = EngineCore(
            engine_id,
            model,
            max_decode_run=1,
            priority_groups=priority_groups,
            track_cache_events=kv_events is not None,
        )
        self.time_scale = time_scale
        self.seed = seed
        self.observer = observer
        self.pins = KvPins(self.core.pool, model.block_size, lease=kv_lease)
        self._handles: dict[str, GenerationHandle] = {}
        self._next_id = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._t0 = 0.0
        self._last_arrival = 0.0
        self.error: str | None = None

    # -- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        """Start the background task (virtual time starts at 0 now)."""
        if self._task is not None:
            raise RuntimeError("driver already started")
        self._t0 = asyncio.get_running_loop().time()
        self.error = None
        self._task = asyncio.create_task(self._run(), name=f"engine-driver-{self.core.id}")
        self._sweeper = asyncio.create_task(self.pins.run(), name=f"kv-pins-{self.core.id}")

    async def stop(self) -> None:
        """Cancel the background task and end every request still in flight."""
        for task in (self._task, self._sweeper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._sweeper = None
        self.pins.clear()
        for handle in list(self._handles.values()):
            handle.fail("the engine is shutting down")
        self._handles.clear()
        if self.error is None:
            self.error = "the engine is stopped"

    @property
    def healthy(self) -> bool:
        return self._task is not None and self.error is None

    @property
    def in_flight(self) -> int:
        return len(self._handles)

    def now(self) -> float:
        """Virtual seconds since :meth:`start`."""
        return (asyncio.get_running_loop().time() - self._t0) / self.time_scale

    async def sleep_until(self, when: float) -> None:
        """Sleep until virtual time ``when``."""
        delay = self._t0 + when * self.time_scale - asyncio.get_running_loop().time()
        await asyncio.sleep(max(0.0, delay))

    # -- requests --------------------------------------------------------------
    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise :class:`RequestRejectedError` when vLLM would refuse this length."""
        limit = self.model.max_model_len
        if prompt_tokens >= limit:
            raise RequestRejectedError(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {prompt_tokens} input tokens. Please reduce the length of the input."
            )
        if prompt_tokens + max_tokens > limit:
            raise RequestRejectedError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages "
                "or completion.",
                param="max_tokens",
            )

    def validate(
        self, token_ids: Sequence[int], *, max_tokens: int, ignore_eos: bool = False
    ) -> tuple[int, int, str]:
        """Check a request as :meth:`submit` does; its (digest, output tokens, finish reason)."""
        if self.error is not None or self._task is None:
            raise EngineDeadError(self.error or "the engine is not running")
        if not token_ids:
            raise RequestRejectedError("The prompt cannot be empty.", param="prompt")
        if max_tokens < 1:
            raise RequestRejectedError(
                f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens"
            )
        self.check(len(token_ids), max_tokens)
        digest = prompt_digest(token_ids)
        natural = natural_length(digest, self.seed)
        if ignore_eos or natural > max_tokens:
            output, reason = max_tokens, "length"
        else:
            output, reason = natural, "stop"
        why = self.core.admissible(len(token_ids), output)
        if why is not None:
            raise RequestRejectedError(f"The request cannot be served: {why}.")
        return digest, output, reason

    def submit(
        self,
        token_ids: Sequence[int],
        *,
        max_tokens: int,
        ignore_eos: bool = False,
        remote_tokens: int = 0,
        arrival: float | None = None,
        pin_id: str | None = None,
        lora: LoraKey | None = None,
        cache_salt: str | None = None,
        lora_id: int | None = None,
    ) -> GenerationHandle:
        """Queue a generation of at most ``max_tokens`` tokens for ``token_ids``.

        ``remote_tokens`` of the prompt arrive from a prefill engine (whole blocks
        are loaded); ``arrival`` (virtual, not later than now) backdates the request,
        e.g. to before its KV transfer; ``pin_id`` pins its prompt KV when it ends.
        ``lora`` (the adapter) and ``cache_salt`` select the request's prefix-cache
        partition, as in vLLM: blocks are shared only within one (adapter, salt).
        """
        digest, output, reason = self.validate(
            token_ids, max_tokens=max_tokens, ignore_eos=ignore_eos
        )
        self._next_id += 1
        now = self.now()
        name = lora.name if lora is not None else ""
        seed = partition_seed(0, lora=name, cache_salt=cache_salt or "")
        req = EngineRequest(
            id=f"req-{self._next_id}",
            prompt_tokens=len(token_ids),
            block_hashes=hashes_from_tokens(token_ids, self.model.block_size, seed),
            output_tokens=output,
            arrival=now if arrival is None else min(arrival, now),
            remote_tokens=max(0, remote_tokens),
            lora=name,
        )
        self._last_arrival = now
        handle = GenerationHandle(req, digest=digest, max_tokens=max_tokens, finish_reason=reason)
        handle.pin_id = pin_id
        req.payload = handle
        if self.kv_events is not None:
            self.kv_events.on_submit(
                req.id,
                token_ids,
                req.block_hashes,
                lora=lora,
                cache_salt=cache_salt,
                lora_id=lora_id,
            )
        self.core.submit(req)
        self._handles[req.id] = handle
        self._wake.set()
        return handle

    def abort(self, request_id: str) -> bool:
        """Drop a request whose client went away; frees its engine request."""
        handle = self._handles.pop(request_id, None)
        if handle is None:
            return False
        self.core.abort(request_id)
        if self.kv_events is not None:
            self.kv_events.on_done(request_id)
        handle.finish("abort")
        if self.observer is not None:
            self.observer.on_finished(handle, "abort", self.now())
        return True

    # -- the loop --------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: fail every request instead of hanging them
            log.exception("engine driver %s crashed", self.core.id)
            self.error = f"engine driver crashed: {exc!r}"
            for handle in list(self._handles.values()):
                handle.fail(self.error)
            self._handles.clear()

    async def _loop(self) -> None:
        core = self.core
        loop = asyncio.get_running_loop()
        scale = self.time_scale
        last_end = 0.0
        while True:
            if not core.has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            # Back-to-back steps: the next one starts where the last ended unless the wall
            # clock is more than _LAG ahead (idle or overloaded), and never before the
            # latest arrival. Timer jitter thus never stretches or shrinks the model's time.
            now = self.now()
            if now - last_end < _LAG / scale:
                now = last_end
            now = max(now, self._last_arrival)
            waiting = core.num_waiting
            end = core.start_step(now)
            if end is None:  # work that cannot run yet; retry soon rather than spin
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.01):
                        await self._wake.wait()
                continue
            if core.num_waiting != waiting:
                self._note_scheduled()
            # Timers have ~1 ms resolution: let the engine run up to _LEAD ahead of the
            # wall clock, then sleep the lead off.
            lead = self._t0 + end * scale - loop.time()
            await asyncio.sleep(lead if lead >= _LEAD else 0.0)
            last_end = end
            self._apply(core.finish_step())

    def _note_scheduled(self) -> None:
        observer = self.observer
        for req in self.core.running:
            handle = req.payload
            if isinstance(handle, GenerationHandle) and not handle.scheduled:
                handle.scheduled = True
                if observer is not None:
                    observer.on_scheduled(handle)

    def _apply(self, out: StepOutcome) -> None:
        observer = self.observer
        handles = self._handles
        end = out.end
        if observer is not None:
            observer.on_step(out)
        if self.kv_events is not None:
            self.kv_events.on_step(out.stored, out.removed)
        # the engine model's frontend term: tokens reach clients this much later
        delay = self.model.frontend_delay(len(out.tokens)) * self.time_scale
        for req, count in out.tokens:
            handle = handles.get(req.id)
            if handle is None:
                continue
            if not handle.scheduled:  # admitted and preempted in one step: note it now
                handle.scheduled = True
                if observer is not None:
                    observer.on_scheduled(handle)
            gap = None if handle.last_token_time is None else end - handle.last_token_time
            handle.push(count, end, delay)
            if observer is not None:
                observer.on_tokens(handle, count, gap)
        for req in out.finished:
            if self.kv_events is not None:
                self.kv_events.on_done(req.id)
            handle = handles.pop(req.id, None)
            if handle is None:
                continue
            if handle.pin_id is not None:  # before finish: readers find the pin
                self.pins.pin(
                    handle.pin_id,
                    req.block_hashes,
                    prompt_tokens=req.prompt_tokens,
                    cached_tokens=req.cached_tokens or 0,
                )
            handle.finish(handle.target_reason, delay)
            if observer is not None:
                observer.on_finished(handle, handle.target_reason, end)
