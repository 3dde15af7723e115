"""Gateway overhead: latency kvgate adds in front of an engine, at a fixed request rate.

Starts one emulated engine (near-zero engine time) and ``kvgate serve`` in front
of it, then sends the same open-loop load (fixed inter-arrival times, not
waiting for answers) first straight to the engine and then through the gateway.
Reports p50/p99 of both, the difference, and the gateway's CPU time per request.

Targets (issue #3, on the 2-core CI machine): <= 1 ms p50 and <= 5 ms p99 added at
200 requests/s.

    python benchmarks/bench_gateway_overhead.py [--rate 200] [--seconds 10] [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))
from procs import MODEL, Proc, start_emulator, start_gateway

TARGET_P50_MS = 1.0
TARGET_P99_MS = 5.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


class _Conn:
    """A minimal HTTP/1.1 keep-alive client, so the load generator costs little CPU."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.used = time.perf_counter()

    async def post(self, request: bytes) -> int:
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        if b"transfer-encoding: chunked" in lower:
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        else:
            i = lower.index(b"content-length:")
            length = int(lower[i + 15 : lower.index(b"\r\n", i)])
            await self.reader.readexactly(length)
        return status


async def load(url: str, rate: float, seconds: float, stream: bool) -> tuple[list[float], int]:
    body = json.dumps(
        {"model": MODEL, "prompt": "kvgate overhead probe " * 10, "max_tokens": 1, "stream": stream}
    ).encode()
    host, port = url.removeprefix("http://").split(":")
    request = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body
    idle: list[_Conn] = []
    lat: list[float] = []
    errors = 0

    async def one() -> None:
        nonlocal errors
        t0 = time.perf_counter()
        while idle and idle[0].used < time.perf_counter() - 2.0:  # servers close idle ones
            idle.pop(0).writer.close()
        conn = idle.pop() if idle else _Conn(*await asyncio.open_connection(host, int(port)))
        try:
            status = await conn.post(request)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            errors += 1
            print(f"request failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            conn.writer.close()
            return
        conn.used = time.perf_counter()
        idle.append(conn)
        if status != 200:
            errors += 1
            print(f"request answered {status}", file=sys.stderr)
            return
        lat.append(time.perf_counter() - t0)

    tasks = []
    start = time.perf_counter()
    for i in range(int(rate * seconds)):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    for conn in idle:
        conn.writer.close()
    return lat, errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--policy", default="cache_aware")
    args = ap.parse_args()
    logdir = Path("/tmp/kvgate-bench-overhead")
    logdir.mkdir(exist_ok=True)
    engine: Proc = start_emulator(logdir, 0, time_scale=0.0001)
    gateway: Proc | None = None
    try:
        gateway = start_gateway(logdir, [engine.url], policy=args.policy)
        asyncio.run(load(engine.url, args.rate, 2, args.stream))  # warm up both paths
        asyncio.run(load(gateway.url, args.rate, 2, args.stream))
        direct, e1 = asyncio.run(load(engine.url, args.rate, args.seconds, args.stream))
        cpu0 = cpu_seconds(gateway.popen.pid)
        via, e2 = asyncio.run(load(gateway.url, args.rate, args.seconds, args.stream))
        cpu = cpu_seconds(gateway.popen.pid) - cpu0
    finally:
        for p in (gateway, engine):
            if p is not None:
                p.stop()
    d50, d99 = pct(direct, 50) * 1e3, pct(direct, 99) * 1e3
    v50, v99 = pct(via, 50) * 1e3, pct(via, 99) * 1e3
    mode = "stream" if args.stream else "non-stream"
    print(f"{mode}, {args.rate:.0f} req/s for {args.seconds:.0f} s, policy {args.policy}")
    print(
        f"direct : p50 {d50:6.2f} ms  p99 {d99:6.2f} ms  mean {statistics.mean(direct) * 1e3:6.2f}"
        f" ms  errors {e1}"
    )
    print(
        f"gateway: p50 {v50:6.2f} ms  p99 {v99:6.2f} ms  mean {statistics.mean(via) * 1e3:6.2f}"
        f" ms  errors {e2}"
    )
    print(
        f"added  : p50 {v50 - d50:6.2f} ms (target <= {TARGET_P50_MS} ms, ratio "
        f"{(v50 - d50) / TARGET_P50_MS:.2f})  p99 {v99 - d99:6.2f} ms (target <= "
        f"{TARGET_P99_MS} ms, ratio {(v99 - d99) / TARGET_P99_MS:.2f})"
    )
    print(
        f"gateway CPU: {cpu / max(1, len(via)) * 1e3:.3f} ms per request "
        f"({cpu:.2f} s for {len(via)} requests)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
