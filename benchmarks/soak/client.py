"""The soak benchmark's load client: one request's outcome (ok, failed or lost, and why) over
a minimal HTTP/1.1 keep-alive client that costs the load generator little CPU."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any


# -- one request ---------------------------------------------------------------------
@dataclass(slots=True)
class Result:
    sent: float
    outcome: str  # ok | failed | lost
    reason: str = ""
    ttft: float | None = None
    stream: bool = False


class _Conn:
    """One HTTP/1.1 keep-alive connection; a minimal client costs the load generator little
    CPU (an httpx client saturates its event loop first on a 2-core machine)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.used = time.monotonic()

    async def request(self, data: bytes, t0: float) -> tuple[int, bytes, float, bool]:
        """(status, body, seconds to the first body byte, keep-alive)."""
        self.writer.write(data)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        keep = b"connection: close" not in lower
        parts: list[bytes] = []
        first: float | None = None
        if b"transfer-encoding: chunked" in lower:
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                chunk = await self.reader.readexactly(size + 2)
                if first is None:
                    first = time.monotonic() - t0
                if size == 0:
                    break
                parts.append(chunk[:-2])
        else:
            i = lower.find(b"content-length:")
            length = int(lower[i + 15 : lower.index(b"\r\n", i)]) if i >= 0 else 0
            parts.append(await self.reader.readexactly(length))
            first = time.monotonic() - t0
        return status, b"".join(parts), first or 0.0, keep


class RawClient:
    def __init__(self, url: str) -> None:
        self.host, port = url.removeprefix("http://").split(":")
        self.port = int(port)
        self.idle: list[_Conn] = []

    def build(self, path: str, body: dict[str, Any]) -> bytes:
        payload = json.dumps(body).encode()
        return (
            f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
        ).encode() + payload

    async def post(self, data: bytes, t0: float) -> tuple[int, bytes, float]:
        while self.idle and self.idle[0].used < time.monotonic() - 4.0:  # server idles out at 5
            self.idle.pop(0).writer.close()
        if self.idle:
            conn = self.idle.pop()
        else:
            conn = _Conn(*await asyncio.open_connection(self.host, self.port))
        try:
            status, body, first, keep = await conn.request(data, t0)
        except BaseException:
            conn.writer.close()
            raise
        if keep:
            conn.used = time.monotonic()
            self.idle.append(conn)
        else:
            conn.writer.close()
        return status, body, first

    def close(self) -> None:
        for conn in self.idle:
            conn.writer.close()
        self.idle.clear()


async def one(
    client: RawClient, path: str, body: dict[str, Any], stream: bool, timeout_s: float
) -> Result:
    t0 = time.monotonic()
    res = Result(sent=t0, outcome="lost", reason="pending", stream=stream)
    try:
        status, content, first = await asyncio.wait_for(
            client.post(client.build(path, body), t0), timeout_s
        )
    except TimeoutError:
        return _set(res, "lost", "timeout")  # no answer and no error within the timeout
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        return _set(res, "failed", f"transport_{type(exc).__name__}")
    if status != 200:
        return _set(res, "failed", f"http_{status}")
    res.ttft = first
    if not stream:
        return _set(res, "ok") if b'"choices"' in content else _set(res, "failed", "no_choices")
    if b'data: {"error"' in content:
        return _set(res, "failed", "stream_error_event")
    if not content.rstrip().endswith(b"data: [DONE]"):
        return _set(res, "lost", "stream_ended_silently")
    return _set(res, "ok")


def _set(res: Result, outcome: str, reason: str = "") -> Result:
    res.outcome, res.reason = outcome, reason
    return res
