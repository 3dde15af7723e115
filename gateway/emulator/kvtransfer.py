"""Decode side of P/D: pulling a prompt's KV from the prefill engine, and its metrics.

The pull is modelled, not performed: the decode leg waits ``tokens ×
kv_bytes_per_token / bandwidth`` virtual seconds (whole blocks not already in
the local prefix cache). Transfers share one link, so concurrent pulls queue
behind each other. Then the prefill engine is told the blocks were read
(``POST /kvgate/kv_release``, in the background; an engine pulling from itself
releases directly); a failed notice is counted, never fatal to the request,
and the prefill engine frees the blocks when its lease runs out anyway.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.core.blocks import hashes_from_tokens
from gateway.emulator.driver import EngineDriver
from gateway.emulator.kvpins import KvPins
from gateway.emulator.pd import RELEASE_PATH, DecodeLeg

log = logging.getLogger(__name__)
_LABELS = ("model_name", "engine")
_XFER = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
_BYTES = tuple(float(4**k) for k in range(10, 19))  # 1 MiB .. 64 GiB
_NOTIFY_TIMEOUT = 5.0


def load_tokens(driver: EngineDriver, token_ids: Sequence[int], remote_tokens: int) -> int:
    """Prompt tokens a decode leg loads now: the whole blocks of its first
    ``remote_tokens`` (at most prompt - 1) not already in the local prefix cache."""
    bs = driver.model.block_size
    n = len(token_ids)
    if remote_tokens <= 0 or n <= 1:
        return 0
    hashes = hashes_from_tokens(token_ids, bs)
    limit = min(len(hashes), (n - 1) // bs)
    remote = min(limit, min(remote_tokens, n - 1) // bs)
    return max(0, remote - driver.core.pool.match(hashes, limit)) * bs


class _Expired(Collector):
    """``vllm:nixl_num_kv_expired_reqs``: pins freed unread, read at scrape time."""

    def __init__(self, pins: KvPins, labels: list[str]) -> None:
        self.pins = pins
        self.labels = labels

    def collect(self) -> Iterable[Metric]:
        c = CounterMetricFamily(
            "vllm:nixl_num_kv_expired_reqs",
            "Number of requests whose KV blocks expired on the prefill side before the decode "
            "side read them.",
            labels=list(_LABELS),
        )
        c.add_metric(self.labels, self.pins.expired)
        yield c


class TransferMetrics:
    """The NIXL connector's series vLLM exports (the ones the emulator can mean)."""

    def __init__(
        self, registry: CollectorRegistry, pins: KvPins, *, model_name: str, engine: str
    ) -> None:
        lv = [model_name, engine]
        r = registry
        r.register(_Expired(pins, lv))
        self.xfer_time = Histogram(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            _LABELS,
            registry=r,
            buckets=_XFER,
        ).labels(*lv)
        self.bytes = Histogram(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            _LABELS,
            registry=r,
            buckets=_BYTES,
        ).labels(*lv)
        self.failed_notifications = Counter(
            "vllm:nixl_num_failed_notifications",
            "Number of failed NIXL KV Cache notifications.",
            _LABELS,
            registry=r,
        ).labels(*lv)
        self.late_notifications = Counter(
            "vllm:nixl_num_notifications_after_expiry",
            "Number of read notifications that arrived after the KV blocks expired.",
            _LABELS,
            registry=r,
        ).labels(*lv)


class KvTransfer:
    """Pulls prompt KV for decode legs at ``bandwidth_gbps`` GB/s (10^9 bytes per second)."""

    def __init__(
        self,
        driver: EngineDriver,
        metrics: TransferMetrics,
        *,
        engine_id: str,
        bandwidth_gbps: float,
    ) -> None:
        if not bandwidth_gbps > 0:
            raise ValueError(f"the KV bandwidth must be positive, got {bandwidth_gbps}")
        self.driver = driver
        self.metrics = metrics
        self.engine_id = engine_id
        self.bandwidth = bandwidth_gbps * 1e9
        self.in_flight = 0
        """Decode legs waiting for their KV (vLLM's WAITING_FOR_REMOTE_KVS)."""
        self._link_free = 0.0
        # made now: building a client takes tens of ms, which must not stall the engine loop
        self._client = httpx.AsyncClient(timeout=_NOTIFY_TIMEOUT, trust_env=False)
        self._notices: set[asyncio.Task[None]] = set()

    def transfer_time(self, tokens: int) -> float:
        """Virtual seconds to move ``tokens`` tokens of KV over an idle link."""
        return tokens * self.driver.model.kv_bytes_per_token / self.bandwidth

    async def pull(self, leg: DecodeLeg, token_ids: Sequence[int]) -> int:
        """Wait for the KV of ``token_ids`` to arrive; the prompt tokens it covers."""
        driver = self.driver
        remote = len(token_ids) if leg.num_tokens is None else min(len(token_ids), leg.num_tokens)
        tokens = load_tokens(driver, token_ids, remote)
        duration = self.transfer_time(tokens)
        end = max(driver.now(), self._link_free) + duration
        self._link_free = end
        self.in_flight += 1
        try:
            await driver.sleep_until(end)
        finally:
            self.in_flight -= 1
        if tokens:
            self.metrics.xfer_time.observe(duration)
            self.metrics.bytes.observe(tokens * driver.model.kv_bytes_per_token)
        self.notify(leg)
        return remote

    def notify(self, leg: DecodeLeg) -> None:
        """Tell the prefill engine its blocks for ``leg`` can go (best effort)."""
        if leg.request_id is None:  # vLLM <= 0.11 params: nothing to name
            return
        if leg.engine_id == self.engine_id:
            self.release(leg.request_id)
            return
        task = asyncio.create_task(self._send(leg, leg.request_id))
        self._notices.add(task)
        task.add_done_callback(self._notices.discard)

    def release(self, pin_id: str) -> bool:
        """Prefill side: a decode engine read ``pin_id``; False when unknown or expired."""
        released = self.driver.pins.release(pin_id)
        if not released:
            self.metrics.late_notifications.inc()
        return released

    async def _send(self, leg: DecodeLeg, pin_id: str) -> None:
        host = f"[{leg.host}]" if ":" in leg.host else leg.host
        url = f"http://{host}:{leg.port}{RELEASE_PATH}"
        body = {"remote_request_id": pin_id, "remote_engine_id": leg.engine_id}
        try:
            response = await self._client.post(url, json=body)
            ok = response.status_code == 200
        except httpx.HTTPError as exc:
            log.debug("KV release notice to %s failed: %r", url, exc)
            ok = False
        if not ok:
            self.metrics.failed_notifications.inc()

    async def close(self) -> None:
        """Drop pending notices and the HTTP client (the app stops)."""
        for task in list(self._notices):
            task.cancel()
        if self._notices:
            await asyncio.wait(self._notices)
        await self._client.aclose()
