"""Traffic recording: one prompt-free Mooncake-format JSON line per request.

The request path only parses the engine's ``usage`` and puts a small entry on
a bounded queue; a full queue drops the entry and counts it
(``kvgate_record_dropped_total``), never waits. A writer thread salts the block
hashes, formats the lines and appends them to ``PATH``, rotated by size.

Hash ids are the request's chained routing-key hashes passed through BLAKE2b
keyed with a secret derived from the salt and cut to 63 bits: equal prefixes
keep equal leading ids within a recording (and across recordings with the same
salt), but without the salt nobody can compute the id of a known prompt. A
request's session id is written the same way (``session``: 16 hex digits of the
keyed hash), so a replay keeps which requests formed one session. No prompt or
output text is ever written. See docs/gateway.md#recording-traffic.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter

if TYPE_CHECKING:
    from gateway.proxy.exchange import Exchange

log = logging.getLogger("kvgate.record")

_PROMPT_TOKENS = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
"""Prompt tokens in an engine's usage: chat and completions' ``prompt_tokens``, Responses'
and Messages' ``input_tokens`` (Messages adds the cache reads it leaves out)."""
_CACHE_READ = re.compile(rb'"cache_read_input_tokens"\s*:\s*(\d+)')
_COMPLETION_TOKENS = b'"completion_tokens"'
_OUTPUT_TOKENS = b'"output_tokens"'
_PAUSE_S = 0.05  # the writer wakes at most this often: fewer thread switches and writes
_MEMO = 1 << 17


def salt_key(salt: str | bytes | None) -> bytes:
    """The 32-byte BLAKE2b key of ``salt``; a random one when ``salt`` is None."""
    if salt is None:
        return secrets.token_bytes(32)
    raw = salt.encode("utf-8") if isinstance(salt, str) else salt
    return hashlib.blake2b(raw, digest_size=32, person=b"kvgate-record").digest()


class Salter:
    """Maps routing-key hashes to opaque 63-bit ids with a keyed hash (memoised)."""

    def __init__(self, key: bytes) -> None:
        self._base = hashlib.blake2b(digest_size=8, key=key)
        self._memo: dict[int, int] = {}

    def __call__(self, value: int) -> int:
        found = self._memo.get(value)
        if found is not None:
            return found
        h = self._base.copy()
        h.update((value & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little"))
        out = int.from_bytes(h.digest(), "little") >> 1
        if len(self._memo) >= _MEMO:
            self._memo.clear()
        self._memo[value] = out
        return out

    def text(self, value: str) -> str:
        """An opaque 16-hex-digit id of a client identifier (a session id)."""
        h = self._base.copy()
        h.update(b"text\0" + value.encode("utf-8", "replace"))
        return h.hexdigest()


@dataclass(frozen=True, slots=True)
class Entry:
    """What the request path hands to the writer (no text; hashes still unsalted)."""

    arrival: float  # the recorder's clock (monotonic seconds)
    hashes: tuple[int, ...]
    block_size: int
    estimate: int  # prompt tokens estimated by the routing key
    prompt: int | None  # prompt tokens from the engine's usage
    output: int | None  # completion tokens the forwarder counted
    output_usage: bool  # ``output`` came from the engine's usage
    max_tokens: int | None
    model: str | None
    slo_class: str
    route: str
    engine: str | None
    prefill_engine: str | None
    ok: bool
    outcome: str
    session: str = ""  # the client's session id, unsalted ("" when none)
    tenant: str = ""  # flow control's tenant (already a hash of an API key, or a header value)
    priority: int = 0  # flow control's priority (vLLM's field)


def make_entry(
    ex: Exchange, *, ok: bool, outcome: str, output: int | None, usage: bytes = b""
) -> Entry:
    """The entry of a finished (or rejected) exchange; ``usage`` holds the engine's usage."""
    found = _PROMPT_TOKENS.findall(usage) if usage else None
    prompt = int(found[-1]) if found else None
    if prompt is not None and ex.route == "messages":
        reads = _CACHE_READ.findall(usage)
        prompt += int(reads[-1]) if reads else 0
    info = ex.info
    return Entry(
        arrival=ex.started,
        hashes=info.block_hashes,
        block_size=info.block_size,
        estimate=info.prompt_tokens,
        prompt=prompt,
        output=output,
        output_usage=output is not None
        and (_COMPLETION_TOKENS in usage or _OUTPUT_TOKENS in usage),
        max_tokens=info.max_tokens,
        model=ex.model,
        slo_class=info.slo.name,
        route=ex.route,
        engine=ex.engine,
        prefill_engine=ex.prefill_engine,
        ok=ok,
        outcome=outcome,
        session=info.session,
        tenant=info.tenant,
        priority=info.priority,
    )


def format_entry(entry: Entry, salter: Salter, t0: float, start_ms: int) -> str:
    """One JSON line (Mooncake's four fields first, then kvgate's); ASCII only."""
    if entry.prompt is not None and entry.prompt > 0:
        n_in, in_src = entry.prompt, "usage"
    else:
        n_in, in_src = entry.estimate, "estimate"
    if entry.output is not None:
        n_out, out_src = entry.output, "usage" if entry.output_usage else "estimate"
    elif entry.max_tokens is not None and entry.max_tokens > 0:
        n_out, out_src = entry.max_tokens, "max_tokens"
    else:
        n_out, out_src = 1, "unknown"
    line: dict[str, Any] = {
        "timestamp": max(0, int((entry.arrival - t0) * 1000)),
        "input_length": max(1, n_in),
        "output_length": max(1, n_out),
        "hash_ids": [salter(h) for h in entry.hashes],
        "block_size": entry.block_size,
        "input_source": in_src,
        "output_source": out_src,
        "model": entry.model,
        "slo_class": entry.slo_class,
        "route": entry.route,
        "engine": entry.engine,
        "ok": entry.ok,
        "outcome": entry.outcome,
        "recording_start": start_ms,
    }
    if entry.prefill_engine is not None:
        line["prefill_engine"] = entry.prefill_engine
    if entry.session:
        line["session"] = salter.text(entry.session)
    if entry.tenant:
        line["tenant"] = salter.text(entry.tenant)
    if entry.priority:
        line["priority"] = entry.priority
    return json.dumps(line, separators=(",", ":")) + "\n"


class RotatingFile:
    """Appends bytes to ``path``; past ``max_bytes`` it becomes ``path.1`` (``.1`` becomes
    ``.2`` ...; ``backups`` files are kept, none with 0: the file starts over)."""

    def __init__(self, path: Path, max_bytes: int, backups: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fh: IO[bytes] = path.open("ab")
        self.size = self.fh.tell()

    def backup(self, n: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{n}")

    def write(self, data: bytes) -> None:
        if self.size and self.size + len(data) > self.max_bytes:
            self.rotate()
        self.fh.write(data)
        self.size += len(data)

    def rotate(self) -> None:
        self.fh.close()
        try:
            if self.backups:
                for n in range(self.backups - 1, 0, -1):
                    if self.backup(n).exists():
                        os.replace(self.backup(n), self.backup(n + 1))
                os.replace(self.path, self.backup(1))
            else:
                self.path.unlink(missing_ok=True)
        finally:  # a failed rename keeps appending to the same file
            self.fh = self.path.open("ab")
            self.size = self.fh.tell()


class Recorder:
    """Records requests to a rotating JSONL file from a background thread."""

    def __init__(
        self,
        path: str | Path,
        *,
        max_bytes: int = 100 * 1024 * 1024,
        backups: int = 5,
        salt: str | bytes | None = None,
        queue_size: int = 10_000,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self._salter = Salter(salt_key(salt))
        self._queue: queue.Queue[Entry | None] = queue.Queue(maxsize=queue_size)
        self.t0 = clock()
        self.start_ms = int(wall() * 1000)
        registry = registry if registry is not None else CollectorRegistry()
        self._dropped = Counter(
            "kvgate_record_dropped",
            "Request records dropped: the writer's queue was full, or writing failed",
            registry=registry,
        )
        self._written = Counter(
            "kvgate_record_written", "Request records written", registry=registry
        )
        self.dropped_full = 0  # counted on the request path
        self.dropped_io = 0  # counted by the writer
        self.written = 0
        self._file: RotatingFile | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._warned = False

    def start(self) -> None:
        """Open the file (errors surface here, at startup) and start the writer."""
        self._file = RotatingFile(self.path, self.max_bytes, self.backups)
        self._thread = threading.Thread(target=self._run, name="kvgate-recorder", daemon=True)
        self._thread.start()

    def record(
        self, ex: Exchange, *, ok: bool, outcome: str, output: int | None, usage: bytes = b""
    ) -> None:
        """Queue the record of one request; never blocks (drops and counts when full)."""
        if self._closed:
            return
        self.put(make_entry(ex, ok=ok, outcome=outcome, output=output, usage=usage))

    def put(self, entry: Entry) -> None:
        try:
            self._queue.put_nowait(entry)
        except queue.Full:
            self.dropped_full += 1
            self._dropped.inc()

    @property
    def dropped(self) -> int:
        """Records lost so far (queue full, or the file could not be written)."""
        return self.dropped_full + self.dropped_io

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, flush and close (blocks up to ``timeout_s``)."""
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:  # pragma: no cover - the writer is stuck
            log.error("recorder: writer did not drain its queue; records lost")
            return
        thread.join(timeout_s)

    def _run(self) -> None:
        stop = False
        while not stop:
            batch = [self._queue.get()]
            while True:  # everything queued so far, in one go
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            self._write([e for e in batch if e is not None])
            if not stop:
                time.sleep(_PAUSE_S)
        if self._file is not None:
            self._file.fh.close()

    def _write(self, entries: list[Entry]) -> None:
        assert self._file is not None
        done = 0
        try:
            for entry in entries:
                line = format_entry(entry, self._salter, self.t0, self.start_ms)
                self._file.write(line.encode("ascii"))
                done += 1
            self._file.fh.flush()
        except Exception as exc:  # never let the writer die: count the loss, warn once
            lost = len(entries) - done
            self.dropped_io += lost
            self._dropped.inc(lost)
            if not self._warned:
                self._warned = True
                log.error("recorder: cannot write %s (%s); dropping records", self.path, exc)
        self.written += done
        self._written.inc(done)
