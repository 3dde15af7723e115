"""The engine performance model: how long a vLLM step takes, how much KV fits.

Prefill follows Preble's fitted form, per request chunk (milliseconds)::

    prefill(extend, ctx) = a + b*extend + c*ctx + d*extend*ctx

where ``extend`` is the number of new tokens computed and ``ctx`` the tokens
already in the KV cache before them. A decode step for a batch of ``bs``
sequences holding ``ctx_total`` context tokens in all takes::

    decode(bs, ctx_total) = e0 + e1*bs + e2*ctx_total

A mixed step (chunked prefill + decodes, as vLLM's V1 scheduler builds them)
pays the fixed cost once: ``max(a, e0)`` plus the variable parts of each.
The same model prices steps in the simulator and in the emulator.

Two costs sit outside the steps (both 0 in the datasheet presets; ``kvgate
calibrate`` measures them on a real engine). The *frontend*: a token the
engine produced reaches the client ``frontend_ms + frontend_per_stream_ms *
(streams - 1)`` later, where ``streams`` is how many requests got a token in
that step (the API server detokenizes and writes every stream's chunk). The
*idle wake*: the first step after the engine sat idle for ``idle_after_s`` or
longer starts ``idle_wake_ms`` late (vLLM's busy loops go to sleep).

LoRA adapters (``gateway/perfmodel/lora.py``): a batch holds at most ``max_loras``
distinct adapters (``--max-loras``, default 1 as in vLLM); the CPU cache holds
``max_cpu_loras`` (0: ``max_loras``, vLLM's default). A step whose batch brings an
adapter that is not cached takes ``lora_load_s`` longer per such adapter (read from
disk), plus ``lora_activate_s`` per adapter copied into a GPU slot. The defaults are
estimates, not measurements: a rank-16 adapter of all linear layers of an 8B model
(Llama-3-8B: r x 81,920 parameters a layer, 32 layers) is 84 MB in bf16; read and
parsed from local NVMe at ~2 GB/s that is ~50 ms, copied host to device at ~12 GB/s
~7 ms. Traffic without adapters pays nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class PerfModel:
    """One (model, GPU) performance profile. Times in the formulas are milliseconds."""

    name: str
    prefill_a: float
    prefill_b: float
    prefill_c: float = 0.0
    prefill_d: float = 0.0
    decode_e0: float = 10.0
    decode_e1: float = 0.0
    decode_e2: float = 0.0
    block_size: int = 16
    kv_capacity_blocks: int = 10_000
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 131_072
    kv_bytes_per_token: int = 131_072
    frontend_ms: float = 0.0
    frontend_per_stream_ms: float = 0.0
    idle_wake_ms: float = 0.0
    idle_after_s: float = 1.0
    max_loras: int = 1
    max_cpu_loras: int = 0
    lora_load_s: float = 0.05
    lora_activate_s: float = 0.007
    description: str = ""
    sources: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_capacity_blocks", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive in preset {self.name!r}")
        if self.max_loras <= 0:
            raise ValueError(f"max_loras must be positive in preset {self.name!r}")
        if self.max_cpu_loras and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras must be 0 or >= max_loras in preset {self.name!r}")
        for name in (
            "prefill_a",
            "prefill_b",
            "prefill_c",
            "prefill_d",
            "decode_e0",
            "decode_e1",
            "decode_e2",
            "frontend_ms",
            "frontend_per_stream_ms",
            "idle_wake_ms",
            "idle_after_s",
            "lora_load_s",
            "lora_activate_s",
        ):
            value = getattr(self, name)
            if value < 0 or not math.isfinite(value):
                raise ValueError(f"{name} must be finite and >= 0 in preset {self.name!r}")

    # -- formulas (seconds) -------------------------------------------------
    def prefill_time(self, extend: int, ctx: int = 0) -> float:
        """Seconds to prefill ``extend`` new tokens on top of ``ctx`` cached ones, alone."""
        if extend <= 0:
            return 0.0
        return (self.prefill_a + self._prefill_var(extend, ctx)) / 1000.0

    def decode_step_time(self, batch_size: int, ctx_total: int) -> float:
        """Seconds for one decode step of ``batch_size`` sequences."""
        if batch_size <= 0:
            return 0.0
        return (self.decode_e0 + self.decode_e1 * batch_size + self.decode_e2 * ctx_total) / 1000.0

    def step_time(
        self, chunks: Sequence[tuple[int, int]], decode_batch: int, decode_ctx: int
    ) -> float:
        """Seconds for one mixed step: prefill ``chunks`` of (extend, ctx) plus decodes."""
        if not chunks and decode_batch <= 0:
            return 0.0
        fixed = 0.0
        var = 0.0
        if chunks:
            fixed = self.prefill_a
            for extend, ctx in chunks:
                var += self._prefill_var(extend, ctx)
        if decode_batch > 0:
            fixed = max(fixed, self.decode_e0)
            var += self.decode_e1 * decode_batch + self.decode_e2 * decode_ctx
        return (fixed + var) / 1000.0

    def decode_run_time(self, batch_size: int, ctx_total: int, steps: int) -> float:
        """Seconds for ``steps`` consecutive decode steps of a fixed batch (context grows)."""
        if steps <= 0 or batch_size <= 0:
            return 0.0
        per = self.decode_e0 + self.decode_e1 * batch_size + self.decode_e2 * ctx_total
        growth = self.decode_e2 * batch_size * steps * (steps - 1) / 2.0
        return (per * steps + growth) / 1000.0

    def decode_steps_within(self, batch_size: int, ctx_total: int, budget_s: float) -> int:
        """The largest number of decode steps that fit in ``budget_s`` seconds (capped at 2^30)."""
        cap = 1 << 30
        if batch_size <= 0 or budget_s <= 0:
            return 0

        def fits(k: int) -> bool:
            return self.decode_run_time(batch_size, ctx_total, k) <= budget_s

        per = self.decode_e0 + self.decode_e1 * batch_size + self.decode_e2 * ctx_total
        grow = self.decode_e2 * batch_size
        budget = budget_s * 1000.0
        # per*k + grow*k*(k-1)/2 <= budget: qa k^2 + qb k - budget <= 0, solved stably
        qa, qb = grow / 2.0, per - grow / 2.0
        denom = qb + math.sqrt(qb * qb + 4.0 * qa * budget)
        root = 2.0 * budget / denom if denom > 0 else math.inf
        if math.isfinite(root) and root < cap:
            lo, hi = max(0, int(root) - 2), int(root) + 2
            if not fits(lo):
                lo = 0
        else:
            lo, hi = 0, cap
        if fits(hi):
            return hi
        while lo < hi - 1:  # invariant: fits(lo) and not fits(hi)
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def frontend_delay(self, streams: int) -> float:
        """Seconds from a step's end until its tokens reach clients (``streams`` got one)."""
        if not (self.frontend_ms or self.frontend_per_stream_ms):
            return 0.0
        return (self.frontend_ms + self.frontend_per_stream_ms * max(0, streams - 1)) / 1000.0

    def wake_delay(self, idle_s: float) -> float:
        """Seconds the first step after ``idle_s`` idle seconds starts late."""
        return self.idle_wake_ms / 1000.0 if idle_s >= self.idle_after_s else 0.0

    def seconds_per_prefill_token(self, ctx: int = 0) -> float:
        """Marginal prefill cost of one token at context ``ctx`` (for quick TTFT estimates)."""
        return (self.prefill_b + self.prefill_d * ctx) / 1000.0

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_capacity_blocks * self.block_size

    def with_overrides(self, **changes: Any) -> PerfModel:
        return replace(self, **changes)

    def _prefill_var(self, extend: int, ctx: int) -> float:
        return self.prefill_b * extend + self.prefill_c * ctx + self.prefill_d * extend * ctx
