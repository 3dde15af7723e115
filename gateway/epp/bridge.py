"""The native front end's other end (:class:`NativeFrontEnd`): ``kvgate epp --frontend native``.

``kvgate-epp-front`` (``native/epp/front.cc``, built by ``scripts/setup_native.sh``) serves
Envoy's ext_proc protocol and gRPC health in C++; this module runs it as a child process and
answers it over one Unix socket. Every decision and all accounting stay here, in the routing
service: the child only turns the verdicts into ext_proc messages and answers the messages
that need no decision itself, so each request costs the event loop two or three frames
instead of four to six gRPC messages through grpc.aio.

Frames, both ways: ``u32`` length of what follows, ``u8`` type, ``u64`` stream id, payload
(integers big-endian; header lists are ``u16`` count, then per header ``u16`` name length,
name, ``u32`` value length, value, in latin-1).

From the front end:

* ``L`` (stream 0): listening; payload ``u32`` port;
* ``Q``: a complete request; ``u8`` flags (1: body over ``--max-body``, none sent),
  ``u32`` JSON length, JSON ``{"h": headers (lowercase names), "s": subset hint list or
  null}``, then the body;
* ``P``: the response's progress; ``u8`` flags (1: status and served endpoint are new,
  2: first bytes, 4: end), ``u16`` status, ``u32`` server-sent events so far, ``u16`` served
  endpoint length and value, ``u32`` head length and the first bytes (with flag 2), then
  the last 4 KiB (with flag 4);
* ``C``: the stream closed before its response ended; payload as ``P`` (flags 0);
* ``A`` (stream 0): a readiness change is in effect.

To the front end: ``R`` (routed: header list to set, ``u16`` count of names to remove and
each as ``u16`` length and name, ``u32`` destination length and value), ``I`` (refused:
``u16`` status, header list, body), ``Y`` / ``N`` (stream 0: ready, not ready; the front end
answers ``A`` once its health service says so).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

from gateway.core.errors import ConfigError
from gateway.proxy.errors import ApiError

from .accounting import Ledger, Ticket
from .stream import StreamHandler, Verdict, refusal

log = logging.getLogger("kvgate.epp")

BINARY = "kvgate-epp-front"
_HEAD = struct.Struct("!IBQ")
_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_PROGRESS = struct.Struct("!BHIH")
TOO_LARGE = 1
HEADERS, FIRST, END = 1, 2, 4


def find_binary(given: Path | None = None) -> Path:
    """The front end's binary: ``given``, ``$KVGATE_EPP_FRONT``, on ``PATH``, or next to
    this Python (``scripts/setup_native.sh`` puts it in ``.venv/bin``)."""
    candidates = [given, os.environ.get("KVGATE_EPP_FRONT"), shutil.which(BINARY)]
    candidates.append(Path(sys.executable).parent / BINARY)
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    raise ConfigError(
        f"--frontend native: {BINARY} is not built (scripts/setup_native.sh builds it), or "
        "name it with KVGATE_EPP_FRONT"
    )


def frame(kind: bytes, sid: int, payload: bytes = b"") -> bytes:
    return _HEAD.pack(9 + len(payload), kind[0], sid) + payload


def header_list(headers: dict[str, str]) -> bytes:
    parts = [_U16.pack(len(headers))]
    for name, value in headers.items():
        k, v = name.encode("latin-1"), value.encode("latin-1")
        parts += [_U16.pack(len(k)), k, _U32.pack(len(v)), v]
    return b"".join(parts)


def encode_verdict(sid: int, v: Verdict) -> bytes:
    """The verdict as an ``R`` or ``I`` frame."""
    if v.status:
        return frame(b"I", sid, _U16.pack(v.status) + header_list(v.set_headers) + v.body)
    parts = [header_list(v.set_headers), _U16.pack(len(v.remove))]
    for name in v.remove:
        b = name.encode("latin-1")
        parts += [_U16.pack(len(b)), b]
    dest = v.destination.encode("latin-1")
    parts += [_U32.pack(len(dest)), dest]
    return frame(b"R", sid, b"".join(parts))


def parse_progress(payload: memoryview) -> tuple[int, int, int, str, bytes, bytes]:
    """A ``P`` or ``C`` payload: flags, status, events, served endpoint, head, tail."""
    flags, status, events, n = _PROGRESS.unpack_from(payload)
    at = _PROGRESS.size
    served = bytes(payload[at : at + n]).decode("latin-1")
    at += n
    (h,) = _U32.unpack_from(payload, at)
    at += 4
    head = bytes(payload[at : at + h])
    return flags, status, events, served, head, bytes(payload[at + h :])


class _Connection(asyncio.Protocol):
    def __init__(self, front: NativeFrontEnd) -> None:
        self.front = front
        self.buf = bytearray()

    def connection_made(self, transport: Any) -> None:
        self.front.connected(transport)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        at, size = 0, len(buf)
        view = memoryview(buf)
        try:
            while size - at >= 4:
                (length,) = _U32.unpack_from(buf, at)
                if size - at - 4 < length:
                    break
                kind, sid = buf[at + 4], int.from_bytes(buf[at + 5 : at + 13], "big")
                self.front.received(kind, sid, view[at + 13 : at + 4 + length])
                at += 4 + length
        finally:
            view.release()
        del buf[:at]

    def connection_lost(self, exc: BaseException | None) -> None:
        self.front.disconnected()


class NativeFrontEnd:
    """Runs ``kvgate-epp-front`` and serves its frames with the handler and the ledger."""

    def __init__(
        self,
        handler: StreamHandler,
        ledger: Ledger,
        binary: Path,
        *,
        listen: str,
        max_body: int,
        grace_s: float,
        tls: tuple[Path, Path] | None = None,
    ) -> None:
        self.handler = handler
        self.ledger = ledger
        self.binary = binary
        self.listen = listen
        self.max_body = max_body
        self.grace_s = grace_s
        self.tls = tls
        self.failed = asyncio.Event()
        """Set when the front end exits on its own (kvgate epp then stops)."""
        self.tickets: dict[int, Ticket] = {}
        """Open tickets by stream id (bounded by the streams Envoy has open)."""
        self.pending: dict[int, asyncio.Task[None]] = {}
        """Requests being decided (held ones wait here), by stream id."""
        self._transport: Any = None
        self._outbox: list[bytes] = []
        self._listening: asyncio.Future[int] | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._watch: asyncio.Task[None] | None = None
        self._acks: list[asyncio.Future[None]] = []
        self._dir = ""
        self._stopping = False

    async def start(self) -> int:
        """Start the front end; the port it listens on once it does."""
        loop = asyncio.get_running_loop()
        self._dir = tempfile.mkdtemp(prefix="kvgate-epp-")
        path = os.path.join(self._dir, "front.sock")
        server = await loop.create_unix_server(lambda: _Connection(self), path)
        self._listening = loop.create_future()
        cmd = [str(self.binary), "--listen", self.listen, "--socket", path]
        cmd += ["--max-body", str(self.max_body), "--grace", str(self.grace_s)]
        if self.tls is not None:
            cmd += ["--cert", str(self.tls[0]), "--key", str(self.tls[1])]
        self._proc = await asyncio.create_subprocess_exec(*cmd)
        exited = asyncio.ensure_future(self._proc.wait())
        try:
            done, _ = await asyncio.wait(
                {self._listening, exited}, timeout=60, return_when="FIRST_COMPLETED"
            )
        finally:
            server.close()  # one connection: the child's
        if self._listening not in done:
            exited.cancel()
            await self._kill()
            rc = self._proc.returncode
            raise ConfigError(f"the native front end could not listen on {self.listen} (exit {rc})")
        self._watch = loop.create_task(self._watch_exit(exited))
        return self._listening.result()

    async def _watch_exit(self, exited: asyncio.Future[int]) -> None:
        rc = await exited
        if not self._stopping:
            log.error("the native front end exited", extra={"returncode": rc})
            self.failed.set()

    async def ready(self, ready: bool) -> None:
        """Readiness on the front end's health service, once it has acknowledged it."""
        if self._transport is None or self._transport.is_closing():
            return
        ack = asyncio.get_running_loop().create_future()
        self._acks.append(ack)
        self._transport.write(frame(b"Y" if ready else b"N", 0))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ack, 5)

    async def stop(self) -> None:
        """Not ready, SIGTERM (the front end lets open streams finish for ``grace_s``), wait."""
        self._stopping = True
        await self.ready(False)
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self._proc.wait(), self.grace_s + 5)
            except TimeoutError:
                await self._kill()
        if self._watch is not None:
            self._watch.cancel()
        for task in list(self.pending.values()):
            task.cancel()
        if self._transport is not None:
            self._transport.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            await self._proc.wait()

    # -- frames --------------------------------------------------------------------------
    def connected(self, transport: Any) -> None:
        self._transport = transport

    def disconnected(self) -> None:
        for sid in list(self.tickets):
            self._close(sid, b"", 0)

    def received(self, kind: int, sid: int, payload: memoryview) -> None:
        if kind == 0x51:  # Q
            flags = payload[0]
            (n,) = _U32.unpack_from(payload, 1)
            meta = json.loads(bytes(payload[5 : 5 + n]))
            body = bytes(payload[5 + n :])
            task = asyncio.get_running_loop().create_task(self._decide(sid, flags, meta, body))
            self.pending[sid] = task
        elif kind == 0x50:  # P
            self._progress(sid, parse_progress(payload))
        elif kind == 0x43:  # C
            _, _, events, _, _, tail = parse_progress(payload)
            held = self.pending.pop(sid, None)
            if held is not None:
                held.cancel()  # Envoy gave up on a request still being decided (held)
            self._close(sid, tail, events)
        elif kind == 0x41:  # A
            while self._acks:
                ack = self._acks.pop(0)
                if not ack.done():
                    ack.set_result(None)
                    break
        elif kind == 0x4C and self._listening is not None:  # L
            (port,) = _U32.unpack_from(payload)
            if not self._listening.done():
                self._listening.set_result(port)

    async def _decide(self, sid: int, flags: int, meta: dict[str, Any], body: bytes) -> None:
        try:
            if flags & TOO_LARGE:
                verdict, ticket = self.handler.too_large(), None
            else:
                hint = meta.get("s")
                subset = frozenset(hint) if hint is not None else None
                verdict, ticket = await self.handler.verdict(meta["h"], body, subset)
        except asyncio.CancelledError:
            return
        except Exception:
            log.exception("deciding a request failed", extra={"stream": sid})
            verdict, ticket = (
                refusal(ApiError(500, "kvgate could not route the request"), None),
                None,
            )
        self.pending.pop(sid, None)
        if ticket is not None:
            self.tickets[sid] = ticket
        if self._transport is not None and not self._transport.is_closing():
            self._send(encode_verdict(sid, verdict))
        elif ticket is not None:
            self._close(sid, b"", 0)

    def _send(self, data: bytes) -> None:
        """Queue a frame; the frames decided in one turn of the loop go in one write (one
        syscall, one wake-up of the front end's reader)."""
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(data)

    def _flush(self) -> None:
        out, self._outbox = self._outbox, []
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(out[0] if len(out) == 1 else b"".join(out))

    def _progress(self, sid: int, progress: tuple[int, int, int, str, bytes, bytes]) -> None:
        flags, status, events, served, head, tail = progress
        ticket = self.tickets.get(sid)
        if ticket is None:
            return
        ledger = self.ledger
        if flags & HEADERS:
            ledger.served(ticket, served or None)
            ledger.response_headers(ticket, status)
        if flags & FIRST:
            ledger.response_bytes(ticket, head)
        if flags & END:
            del self.tickets[sid]
            ticket.events, ticket.tail = events, tail
            ledger.finished(ticket)

    def _close(self, sid: int, tail: bytes, events: int) -> None:
        ticket = self.tickets.pop(sid, None)
        if ticket is None or ticket.done:
            return
        if tail:
            ticket.events, ticket.tail = events, tail
        self.ledger.release(ticket, "stream_closed")
