"""Soak: kvgate at ~80 % of its capacity for a long time, with a trickle of engine faults.

Starts ``--engines`` emulated engines (``kvgate emulate``) and ``kvgate serve`` in front of
them on 127.0.0.1, measures the setup's capacity (or takes ``--rate``), then sends an
open-loop Poisson load at ``--load`` (0.8) of it for ``--seconds`` (600): chat and
completions, streamed and not, prompts that share a few hot prefixes and unique ones.
Every ``--fault-every`` seconds one engine fails, alternately killed (SIGKILL, restarted on
its port ``--down`` seconds later) and drained through the admin API (DELETE, then POST
back). Reports per minute: requests sent / ok / failed / lost, TTFT p50 and p99 (streams:
first event; others: the whole answer), and the gateway's RSS (``/proc/PID/status``).

Outcomes: ``ok`` (200 and a complete answer: JSON with choices, or a stream ending in
``[DONE]`` with no error event); ``failed`` (the client was told: a 4xx/5xx, an error
event in the stream, a broken connection); ``lost`` (no answer and no error: a client
timeout, a stream that ends without ``[DONE]`` or error, or still pending at the end).
Target: lost = 0 and a flat RSS.

    python -m benchmarks.soak.faults [--seconds 600] [--rate R | --load 0.8] [--out FILE]
        [--policy cache_aware] [--policy-option max_tree_blocks=20000]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx  # the admin calls of the fault injector only

from benchmarks.common import benchmark_parser, cpu_seconds, pct, rss_kib
from benchmarks.soak.client import RawClient, Result, one
from tests.e2e.procs import MODEL, Proc, free_port, start_emulator, start_gateway

_WORDS = ("cache", "prefix", "block", "engine", "route", "token", "batch", "queue", "decode")


# -- the workload --------------------------------------------------------------------
class Workload:
    """Mixed requests: chat or completion, stream or not, shared prefix or unique prompt."""

    def __init__(
        self,
        seed: int,
        *,
        prefixes: int = 8,
        prefix_chars: int = 2000,
        shared: float = 0.7,
        chat: float = 0.5,
        stream: float = 0.5,
    ) -> None:
        self.rng = random.Random(seed)
        self.prefixes = [self._text(prefix_chars, f"system prompt {i}") for i in range(prefixes)]
        self.weights = [1.0 / (i + 1) for i in range(prefixes)]  # a few hot, most cold
        self.shared, self.chat, self.stream = shared, chat, stream

    def _text(self, chars: int, head: str) -> str:
        words = [head]
        while sum(len(w) + 1 for w in words) < chars:
            words.append(self.rng.choice(_WORDS))
        return " ".join(words)

    def next(self) -> tuple[str, dict[str, Any], bool]:
        rng = self.rng
        if rng.random() < self.shared:
            head = rng.choices(self.prefixes, self.weights)[0]
            tail = self._text(rng.randint(20, 400), f"question {uuid.uuid4().hex[:8]}")
        else:  # unique from the first character: no shared prefix at all
            head = self._text(rng.randint(200, 3000), uuid.uuid4().hex)
            tail = ""
        stream = rng.random() < self.stream
        body: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": rng.randint(2, 24),
            "stream": stream,
        }
        if rng.random() < self.chat:
            body["messages"] = [
                {"role": "system", "content": head},
                {"role": "user", "content": tail or "go"},
            ]
            return "/v1/chat/completions", body, stream
        body["prompt"] = head + "\n" + tail
        return "/v1/completions", body, stream


async def loop_lag(
    samples: list[tuple[float, float, int]], in_flight: Callable[[], int], every: float = 0.1
) -> None:
    """How late the load generator's event loop wakes up (its own saturation), and how many
    requests are outstanding."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while True:
        before = loop.time()
        await asyncio.sleep(every)
        samples.append((before - t0, loop.time() - before - every, in_flight()))


async def run_load(
    url: str,
    rate: float,
    seconds: float,
    workload: Workload,
    *,
    seed: int,
    timeout_s: float,
    max_in_flight: int = 2000,
    lag: list[tuple[float, float, int]] | None = None,
) -> tuple[list[Result], int]:
    """Poisson arrivals at ``rate`` for ``seconds``; (results, requests not sent: cap)."""
    rng = random.Random(seed)
    results: list[Result] = []
    skipped = 0
    client = RawClient(url)
    tasks: set[asyncio.Task[Result]] = set()
    lag_task = asyncio.create_task(loop_lag(lag if lag is not None else [], lambda: len(tasks)))
    sent_at: dict[asyncio.Task[Result], float] = {}

    def done(task: asyncio.Task[Result]) -> None:
        tasks.discard(task)
        at = sent_at.pop(task)
        if task.cancelled():  # still pending after the client timeout and a grace
            results.append(Result(sent=at, outcome="lost", reason="pending_at_end"))
        else:
            results.append(task.result())

    start_t = time.monotonic()
    t = start_t
    while True:
        t += rng.expovariate(rate)
        if t - start_t >= seconds:
            break
        delay = t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(tasks) >= max_in_flight:
            skipped += 1
            continue
        path, body, stream = workload.next()
        task = asyncio.create_task(one(client, path, body, stream, timeout_s))
        tasks.add(task)
        sent_at[task] = time.monotonic()
        task.add_done_callback(done)
    if tasks:
        await asyncio.wait(set(tasks), timeout=timeout_s + 10)
    for task in list(tasks):
        task.cancel()
    await asyncio.sleep(0)  # let the cancellations land
    lag_task.cancel()
    client.close()
    return results, skipped


# -- capacity ------------------------------------------------------------------------
def measure_capacity(url: str, seconds: float, seed: int) -> tuple[float, list[dict[str, Any]]]:
    """Highest offered rate the setup serves: >= 95 % answered ok at that rate, p99 of
    TTFT under 0.5 s. Rates grow by x1.5 from 20 requests/s."""
    rate, best, rows = 20.0, 0.0, []
    while rate <= 2000:
        results, _ = asyncio.run(
            run_load(url, rate, seconds, Workload(seed), seed=seed, timeout_s=30)
        )
        ok = [r for r in results if r.outcome == "ok"]
        p99 = pct([r.ttft for r in ok if r.ttft is not None], 99)
        served = len(ok) / seconds
        row = {"offered": rate, "ok_per_s": round(served, 1), "ttft_p99_s": round(p99, 3)}
        rows.append(row)
        print(f"  capacity probe: {row}", flush=True)
        if served < 0.95 * rate or not p99 < 0.5:
            break
        best = rate
        rate *= 1.5
    return best, rows


# -- faults --------------------------------------------------------------------------
@dataclass
class Fleet:
    logdir: Path
    time_scale: float
    engines: list[Proc] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    restarts: int = 0

    def start(self, index: int) -> Proc:
        proc = start_emulator(
            self.logdir,
            index,
            time_scale=self.time_scale,
            port=self.ports[index],
            name=f"engine{index}-{self.restarts}",
            timeout=60,
        )
        self.restarts += 1
        return proc


async def inject_faults(
    fleet: Fleet, gateway: str, every: float, down: float, seconds: float, log: list[dict[str, Any]]
) -> None:
    """Alternately kill-and-restart one engine and drain-and-readd another."""
    start_t = time.monotonic()
    n = 0
    async with httpx.AsyncClient(base_url=gateway, timeout=30, trust_env=False) as admin:
        while time.monotonic() - start_t + every + down < seconds:
            await asyncio.sleep(every)
            index = n % len(fleet.engines)
            url = fleet.engines[index].url
            at = round(time.monotonic() - start_t, 1)
            if n % 2 == 0:
                fleet.engines[index].kill()
                log.append({"t_s": at, "fault": "kill", "engine": url})
                await asyncio.sleep(down)
                fleet.engines[index] = await asyncio.to_thread(fleet.start, index)
            else:
                r = await admin.delete("/admin/engines", params={"url": url})
                log.append({"t_s": at, "fault": "drain", "engine": url, "status": r.status_code})
                await asyncio.sleep(down)
                await admin.post("/admin/engines", json={"url": url})
            n += 1


async def sample_rss(
    pid: int,
    every: float,
    samples: list[tuple[float, int, float]],
    fleet: Fleet,
    cpu: dict[str, float],
) -> None:
    t0 = time.monotonic()
    engines0 = 0.0
    while True:
        samples.append((time.monotonic() - t0, rss_kib(pid), cpu_seconds(pid)))
        engines = sum(cpu_seconds(e.popen.pid) for e in fleet.engines)
        cpu["engines_s"] = cpu.get("engines_s", 0.0) + max(0.0, engines - engines0)
        engines0 = engines
        await asyncio.sleep(every)


async def soak(
    args: argparse.Namespace, fleet: Fleet, gateway: Proc, rate: float
) -> dict[str, Any]:
    samples: list[tuple[float, int, float]] = []
    faults: list[dict[str, Any]] = []
    lag: list[tuple[float, float, int]] = []
    cpu: dict[str, float] = {}
    self0 = time.process_time()
    sampler = asyncio.create_task(sample_rss(gateway.popen.pid, 5.0, samples, fleet, cpu))
    injector = asyncio.create_task(
        inject_faults(fleet, gateway.url, args.fault_every, args.down, args.seconds, faults)
    )
    t0 = time.monotonic()
    results, skipped = await run_load(
        gateway.url,
        rate,
        args.seconds,
        Workload(args.seed),
        seed=args.seed,
        timeout_s=args.timeout,
        lag=lag,
    )
    injector.cancel()
    sampler.cancel()
    samples.append((time.monotonic() - t0, rss_kib(gateway.popen.pid), 0.0))
    summary = summarize(results, skipped, samples, faults, t0, args.seconds, rate, lag)
    summary["cpu_s"] = {
        "gateway": summary.pop("gateway_cpu_s"),
        "engines": round(cpu.get("engines_s", 0.0), 1),
        "load_generator": round(time.process_time() - self0, 1),
    }
    return summary


def summarize(
    results: list[Result],
    skipped: int,
    samples: list[tuple[float, int, float]],
    faults: list[dict[str, Any]],
    t0: float,
    seconds: float,
    rate: float,
    lag: list[tuple[float, float, int]],
) -> dict[str, Any]:
    minutes: dict[int, list[Result]] = defaultdict(list)
    for r in results:
        minutes[int((r.sent - t0) // 60)].append(r)
    rss_by_min: dict[int, list[int]] = defaultdict(list)
    for t, kib, _ in samples:
        rss_by_min[int(t // 60)].append(kib)
    lag_by_min: dict[int, list[float]] = defaultdict(list)
    flight_by_min: dict[int, int] = defaultdict(int)
    for t, late, flying in lag:
        lag_by_min[int(t // 60)].append(late)
        flight_by_min[int(t // 60)] = max(flight_by_min[int(t // 60)], flying)
    cpu_by_min: dict[int, float] = {}
    for (t_a, _, c_a), (t_b, _, c_b) in itertools.pairwise(samples):
        if c_a and c_b and t_b > t_a:
            m = int(t_a // 60)
            cpu_by_min[m] = cpu_by_min.get(m, 0.0) + (c_b - c_a)
    rows = []
    for m in sorted(set(minutes) | set(rss_by_min)):
        rs = minutes.get(m, [])
        ttft = [r.ttft for r in rs if r.outcome == "ok" and r.ttft is not None and r.stream]
        lat = [r.ttft for r in rs if r.outcome == "ok" and r.ttft is not None and not r.stream]
        c = Counter(r.outcome for r in rs)
        rows.append(
            {
                "minute": m,
                "sent": len(rs),
                "ok": c["ok"],
                "failed": c["failed"],
                "lost": c["lost"],
                "stream_ttft_p50_ms": round(pct(ttft, 50) * 1e3, 1),
                "stream_ttft_p99_ms": round(pct(ttft, 99) * 1e3, 1),
                "unary_p50_ms": round(pct(lat, 50) * 1e3, 1),
                "unary_p99_ms": round(pct(lat, 99) * 1e3, 1),
                "gateway_rss_mib": round(max(rss_by_min.get(m, [0])) / 1024, 1),
                "loadgen_lag_p99_ms": round(pct(lag_by_min.get(m, []), 99) * 1e3, 1),
                "max_in_flight": flight_by_min.get(m, 0),
                "gateway_cpu_pct": round(cpu_by_min.get(m, 0.0) / 60 * 100, 1),
            }
        )
    c = Counter(r.outcome for r in results)
    reasons = Counter(f"{r.outcome}:{r.reason}" for r in results if r.outcome != "ok")
    rss = [kib for _, kib, _ in samples if kib]
    cpu = [s for _, _, s in samples if s]
    return {
        "offered_rate": round(rate, 1),
        "seconds": seconds,
        "sent": len(results),
        "not_sent_in_flight_cap": skipped,
        "ok": c["ok"],
        "failed": c["failed"],
        "lost": c["lost"],
        "error_rate": round((c["failed"] + c["lost"]) / max(1, len(results)), 5),
        "reasons": dict(reasons.most_common()),
        "faults": faults,
        "gateway_rss_mib": {
            "first": round(rss[0] / 1024, 1) if rss else None,
            "min": round(min(rss) / 1024, 1) if rss else None,
            "max": round(max(rss) / 1024, 1) if rss else None,
            "last": round(rss[-1] / 1024, 1) if rss else None,
        },
        "gateway_cpu_s": round(cpu[-1] - cpu[0], 1) if len(cpu) > 1 else None,
        "per_minute": rows,
    }


def report(summary: dict[str, Any]) -> str:
    lines = [
        f"offered {summary['offered_rate']} req/s for {summary['seconds']:.0f} s: "
        f"sent {summary['sent']}, ok {summary['ok']}, failed {summary['failed']}, "
        f"lost {summary['lost']} (error rate {summary['error_rate'] * 100:.3f} %)",
        f"reasons: {summary['reasons']}",
        f"faults: {len(summary['faults'])} ({', '.join(f['fault'] for f in summary['faults'])})",
        f"gateway RSS MiB: {summary['gateway_rss_mib']}; CPU seconds: {summary['cpu_s']}",
        "",
        "| min | sent | ok | failed | lost | stream TTFT p50 / p99 ms | unary p50 / p99 ms "
        "| gateway RSS MiB | gateway CPU % | max in flight | load-gen lag p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["per_minute"]:
        lines.append(
            f"| {r['minute']} | {r['sent']} | {r['ok']} | {r['failed']} | {r['lost']} | "
            f"{r['stream_ttft_p50_ms']} / {r['stream_ttft_p99_ms']} | "
            f"{r['unary_p50_ms']} / {r['unary_p99_ms']} | {r['gateway_rss_mib']} | "
            f"{r['gateway_cpu_pct']} | {r['max_in_flight']} | {r['loadgen_lag_p99_ms']} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = benchmark_parser(__doc__, "benchmarks.soak.faults")
    ap.add_argument("--seconds", type=float, default=600.0, help="soak duration (600)")
    ap.add_argument("--rate", type=float, help="requests/s; default: --load x measured capacity")
    ap.add_argument("--load", type=float, default=0.8, help="share of capacity (0.8)")
    ap.add_argument("--probe-seconds", type=float, default=8.0, help="per capacity probe (8)")
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--time-scale", type=float, default=0.02, help="emulator time scale")
    ap.add_argument("--policy", default="cache_aware")
    ap.add_argument(
        "--policy-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a knob of the policy, e.g. max_tree_blocks=20000 (reach the bound early)",
    )
    ap.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults")
    ap.add_argument("--down", type=float, default=5.0, help="seconds an engine stays out")
    ap.add_argument(
        "--timeout", type=float, default=60.0, help="client timeout per request (total)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the summary as JSON here")
    args = ap.parse_args()
    logdir = Path("/tmp/kvgate-soak")
    logdir.mkdir(exist_ok=True)
    fleet = Fleet(logdir, args.time_scale, ports=[free_port() for _ in range(args.engines)])
    gateway: Proc | None = None
    load0 = os.getloadavg()
    try:
        fleet.engines = [fleet.start(i) for i in range(args.engines)]
        extra = [a for o in args.policy_option for a in ("--policy-option", o)]
        gateway = start_gateway(
            logdir, [e.url for e in fleet.engines], policy=args.policy, extra=extra
        )
        probes: list[dict[str, Any]] = []
        rate = args.rate
        if rate is None:
            print("measuring capacity ...", flush=True)
            capacity, probes = measure_capacity(gateway.url, args.probe_seconds, args.seed + 1)
            rate = max(1.0, args.load * capacity)
            print(f"capacity ~{capacity:.0f} req/s; soaking at {rate:.0f} req/s", flush=True)
        summary = asyncio.run(soak(args, fleet, gateway, rate))
        summary["capacity_probes"] = probes
        summary["policy"] = args.policy
        summary["policy_options"] = args.policy_option
        summary["engines"] = args.engines
        summary["time_scale"] = args.time_scale
        summary["loadavg_before"] = [round(x, 2) for x in load0]
        summary["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        summary["cpus"] = os.cpu_count()
    finally:
        for p in [gateway, *fleet.engines]:
            if p is not None:
                p.stop()
    print(report(summary))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1))
    return 0 if summary["lost"] == 0 else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
