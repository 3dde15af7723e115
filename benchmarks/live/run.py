"""One run of the live routing benchmark (router × workload on fresh engines), its setup, and the
KV-size self-check of the emulators."""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import REPO_ROOT
from benchmarks.live.client import ReplayResult, drive, warm_up
from benchmarks.live.cluster import MODEL, EngineSpec, fleet, scrape, start_engines
from benchmarks.live.workloads import (
    CHARS_PER_TOKEN,
    SharedPrefixShape,
    TraceRequests,
    no_reuse_capacity,
    rescaled,
    shared_prefix_requests,
    trace_requests,
    unique_requests,
)
from gateway.bench.loadgen import ReplayRequest
from gateway.perfmodel.model import PerfModel
from gateway.perfmodel.presets import load_preset
from gateway.sim.metrics import percentile


@dataclass
class Setup:
    """Everything fixed across the runs: engine specs, capacities, rates, the requests."""

    args: argparse.Namespace
    shape: SharedPrefixShape
    small: PerfModel
    capacity: float
    """No-reuse capacity of one small-KV engine for workload A/B requests (req/s, model time)."""
    rate: float
    requests: dict[str, list[ReplayRequest]] = field(default_factory=dict)
    chat: TraceRequests | None = None
    chat_perf: PerfModel | None = None
    chat_capacity: float = 0.0
    chat_rate: float = 0.0

    @classmethod
    def build(cls, args: argparse.Namespace, shape: SharedPrefixShape) -> Setup:
        small = load_preset(args.preset).with_overrides(kv_capacity_blocks=args.kv_blocks)
        cap = no_reuse_capacity(small, [(shape.prompt_tokens, shape.output_tokens)] * 256)
        rate = args.load * args.engines * cap
        s = cls(args, shape, small, cap, rate)
        s.requests["shared"] = shared_prefix_requests(shape, args.shared_requests, rate, args.seed)
        s.requests["unique"] = unique_requests(shape, args.unique_requests, rate, args.seed)
        if "chat" in args.workloads:
            trace = trace_requests(
                args.chat_spec, args.chat_requests, args.seed, max_output=args.chat_max_output
            )
            perf = load_preset(args.preset)
            if args.chat_kv_blocks:
                perf = perf.with_overrides(kv_capacity_blocks=args.chat_kv_blocks)
            too_big = [
                p + o for p, o in trace.sizes if perf.blocks_for(p + o) > perf.kv_capacity_blocks
            ]
            if too_big:
                raise ValueError(
                    f"{len(too_big)} chat requests (largest {max(too_big)} tokens) exceed the "
                    f"{perf.kv_capacity_blocks}-block KV of an engine: raise --chat-kv-blocks"
                )
            s.chat, s.chat_perf = trace, perf
            s.chat_capacity = no_reuse_capacity(perf, trace.sizes)
            s.chat_rate = args.load * args.engines * s.chat_capacity
            target = (len(trace.requests) - 1) / s.chat_rate
            factor = target / trace.duration if trace.duration > 0 else 1.0
            s.requests["chat"] = rescaled(trace.requests, factor)
        return s

    def time_scale(self, workload: str) -> float:
        """Real seconds per model second of the engines of ``workload``."""
        return float(self.args.chat_time_scale if workload == "chat" else self.args.time_scale)

    def engine_spec(self, workload: str) -> EngineSpec:
        kv = self.args.kv_blocks if workload != "chat" else self.args.chat_kv_blocks
        return EngineSpec(self.args.preset, self.time_scale(workload), kv)

    def wall_estimate(self, workload: str) -> float:
        """Seconds one run of ``workload`` takes: its arrivals, the tail, process start-up."""
        reqs = self.requests[workload]
        return float(reqs[-1].arrival * self.time_scale(workload) + 10.0)

    def expected_blocks(self, workload: str) -> int:
        perf = self.chat_perf if workload == "chat" and self.chat_perf else self.small
        return int(perf.kv_capacity_blocks)

    def summary(self) -> dict[str, Any]:
        a = self.args
        out: dict[str, Any] = {
            "preset": a.preset,
            "engines": a.engines,
            "kv_blocks": a.kv_blocks,
            "time_scale": a.time_scale,
            "chat_time_scale": a.chat_time_scale,
            "load": a.load,
            "prompt_tokens": self.shape.prompt_tokens,
            "output_tokens": self.shape.output_tokens,
            "capacity_per_engine": self.capacity,
            "rate": self.rate,
            "loadavg": os.getloadavg(),
            "code": code_version(),
        }
        if self.chat is not None:
            prompts = [p for p, _ in self.chat.sizes]
            out |= {
                "chat_spec": self.chat.spec,
                "chat_requests": len(prompts),
                "chat_mean_prompt": sum(prompts) / len(prompts),
                "chat_mean_output": sum(o for _, o in self.chat.sizes) / len(prompts),
                "chat_kv_blocks": self.expected_blocks("chat"),
                "chat_capacity_per_engine": self.chat_capacity,
                "chat_rate": self.chat_rate,
            }
        return out

    def describe(self) -> None:
        a, s = self.args, self.summary()
        ts = a.time_scale
        print(f"code: {s['code']}")
        print(
            f"live routing: {a.engines} emulated engines, preset {a.preset}, "
            f"time scale {ts:g} (wall s per model s); load average {_loadavg()}"
        )
        print(
            f"  A/B requests: {s['prompt_tokens']} prompt tokens (A: {self.shape.prefixes} "
            f"prefixes of {self.shape.system_tokens} + {self.shape.question_tokens} unique, "
            f"Zipf {self.shape.zipf:g}), {s['output_tokens']} output tokens"
        )
        print(
            f"  no-reuse capacity (engine model, {a.kv_blocks} KV blocks): "
            f"{self.capacity:.2f} req/s per engine -> x{a.engines} x{a.load:g} = "
            f"{self.rate:.2f} req/s model time ({self.rate / ts:.2f} req/s wall)"
        )
        for name in ("shared", "unique", "chat"):
            reqs = self.requests.get(name)
            if reqs and name in a.workloads:
                span = reqs[-1].arrival
                print(
                    f"  {name}: {len(reqs)} requests over {span:.1f} model s "
                    f"({(len(reqs) - 1) / span:.2f} req/s; {span * self.time_scale(name):.0f} "
                    f"s wall at time scale {self.time_scale(name):g})"
                )
        if self.chat is not None:
            print(
                f"  chat: {s['chat_spec']}, mean prompt {s['chat_mean_prompt']:.0f} / output "
                f"{s['chat_mean_output']:.0f} tokens, {s['chat_kv_blocks']} KV blocks/engine, "
                f"no-reuse capacity {self.chat_capacity:.3f} req/s per engine -> "
                f"{self.chat_rate:.3f} req/s"
            )


def code_version() -> str:
    """The commit measured, and the uncommitted files under gateway/ (others edit live)."""
    root = REPO_ROOT
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "gateway"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
    changed = sorted(line[3:] for line in dirty if line.strip())
    return f"{head}" + (f" + uncommitted {', '.join(changed)}" if changed else "")


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


@dataclass
class Row:
    """What one (router, workload) run measured. Latencies in model milliseconds."""

    rep: int
    router: str
    workload: str
    sent: int
    errors: int
    error_kinds: dict[str, int]
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    e2e_p50_ms: float | None
    shares: list[float]
    hit_rate: float
    preemptions: int
    engine_ttft_mean_ms: float | None
    """The engines' own mean TTFT (their histograms; model ms): queueing + prefill only."""
    ttft_mean_ms: float | None
    wall_s: float
    load1: float
    cpu_s: tuple[float, float, float]
    """CPU seconds of (this client, the router, all engines) during the run."""
    hot_prefix: dict[str, int] = field(default_factory=dict)
    """``shared``: requests of the hottest system prompt per engine (kvgate routers only)."""

    @property
    def overhead_ms(self) -> float | None:
        """Client mean TTFT minus the engines' own: router, HTTP, client and loop delays."""
        if self.ttft_mean_ms is None or self.engine_ttft_mean_ms is None:
            return None
        return self.ttft_mean_ms - self.engine_ttft_mean_ms

    @property
    def busiest(self) -> float:
        return max(self.shares) if self.shares else 0.0

    def line(self) -> str:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:,.0f}"

        shares = "/".join(f"{x:.0%}" for x in self.shares)
        return (
            f"[{self.rep + 1}] {self.router:>16} {self.workload:<6} TTFT p50/p99 "
            f"{ms(self.ttft_p50_ms)}/{ms(self.ttft_p99_ms)} ms  shares {shares}  "
            f"hit {self.hit_rate:.2f}  errors {self.errors}  preempt {self.preemptions}  "
            f"overhead {ms(self.overhead_ms)} ms  {self.wall_s:.0f} s wall, load {self.load1:.1f}, "
            f"CPU s client/router/engines {'/'.join(f'{c:.0f}' for c in self.cpu_s)}"
            + (f"  hottest prefix per engine {self.hot_prefix}" if self.hot_prefix else "")
        )


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_one(
    logdir: Path,
    setup: Setup,
    router: str,
    workload: str,
    *,
    external: str | None,
    rep: int,
    options: list[str] | None = None,
) -> Row:
    """Fresh engines and router, one workload through it, the engines' counters read back.

    ``options``: the router's ``--policy-option`` values (default: the command line's).
    """
    a = setup.args
    options = a.policy_option if options is None else options
    requests = setup.requests[workload]
    spec = setup.engine_spec(workload)
    with fleet(logdir, a.engines, spec, policy=router, external=external, options=options) as f:
        urls = f.engine_urls
        blocks = {c.gpu_blocks for c in scrape(urls)}
        if blocks != {setup.expected_blocks(workload)}:
            raise RuntimeError(
                f"engines report {blocks} KV blocks, expected {setup.expected_blocks(workload)}"
            )
        warm_up(f.router.url, MODEL)
        before = scrape(urls)
        load1, cpu0, t0 = os.getloadavg()[0], (_cpu(), *f.cpu_seconds()), time.monotonic()
        results = drive(f.router.url, MODEL, requests, time_scale=setup.time_scale(workload))
        wall, cpu1 = time.monotonic() - t0, (_cpu(), *f.cpu_seconds())
        time.sleep(0.3)  # aborted requests leave the engines at their next step
        delta = [x.minus(b) for x, b in zip(scrape(urls), before, strict=True)]
    cpu = (cpu1[0] - cpu0[0], cpu1[1] - cpu0[1], cpu1[2] - cpu0[2])
    row = _row(rep, router, workload, results, delta, setup.time_scale(workload), wall, load1, cpu)
    if workload == "shared":
        row.hot_prefix = hot_prefix_engines(requests, results)
    return row


def hot_prefix_engines(
    requests: list[ReplayRequest], results: list[ReplayResult]
) -> dict[str, int]:
    """Requests of the most popular system prompt per engine (kvgate's engine header)."""
    head = "System prompt 0."
    out: dict[str, int] = {}
    for req, res in zip(requests, results, strict=True):
        if req.prompt.startswith(head) and res.engine and not res.error:
            out[res.engine] = out.get(res.engine, 0) + 1
    return dict(sorted(out.items()))


def _row(
    rep: int,
    router: str,
    workload: str,
    results: list[ReplayResult],
    delta: list[Any],
    time_scale: float,
    wall: float,
    load1: float,
    cpu: tuple[float, float, float],
) -> Row:
    kinds: dict[str, int] = {}
    for r in results:
        if r.error:
            kinds[r.error] = kinds.get(r.error, 0) + 1
    ttft = [r.ttft * 1000 / time_scale for r in results if r.ttft is not None and not r.error]
    e2e = [r.e2e * 1000 / time_scale for r in results if r.e2e is not None and not r.error]
    finished = sum(d.finished for d in delta)
    engine_count = sum(d.ttft_count for d in delta)
    engine_ttft = sum(d.ttft_sum for d in delta) * 1000 / engine_count if engine_count else None
    queries = sum(d.queries for d in delta)
    return Row(
        rep=rep,
        router=router,
        workload=workload,
        sent=len(results),
        errors=sum(kinds.values()),
        error_kinds=kinds,
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        e2e_p50_ms=percentile(e2e, 50),
        shares=[d.finished / finished if finished else 0.0 for d in delta],
        hit_rate=sum(d.hits for d in delta) / queries if queries else 0.0,
        preemptions=int(sum(d.preemptions for d in delta)),
        engine_ttft_mean_ms=engine_ttft,
        ttft_mean_ms=sum(ttft) / len(ttft) if ttft else None,
        wall_s=wall,
        load1=load1,
        cpu_s=cpu,
    )


# -- the KV-size self-check ----------------------------------------------------------------
async def _probe(client: httpx.AsyncClient, url: str, blocks: int, bs: int) -> str:
    """Check one engine's KV pool holds ``blocks`` blocks, by admission and by eviction;
    what is wrong, or ``""``."""

    async def complete(text: str, max_tokens: int = 1) -> httpx.Response:
        body = {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "ignore_eos": True}
        return await client.post(url + "/v1/completions", json=body)

    def text(tag: str, tokens: int) -> str:  # tokens - 1 text tokens + BOS = tokens
        return (f"{tag} " + "kv " * (tokens * CHARS_PER_TOKEN))[: (tokens - 1) * CHARS_PER_TOKEN]

    async def cached(tag: str, tokens: int) -> int:
        resp = await complete(text(tag, tokens))
        resp.raise_for_status()
        details = resp.json()["usage"].get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)

    problems = []
    capacity = blocks * bs
    fits = await complete(text("fits", capacity - 1))  # capacity - 1 prompt + 1 output
    over = await complete(text("over", capacity))
    if fits.status_code != 200 or over.status_code != 400:
        codes = f"{fits.status_code}, one more -> {over.status_code}"
        problems.append(f"{url}: {capacity}-token request -> {codes} (expected 200, 400)")
    # eviction: 3 prompts of 4/15 of the pool fit (0.8), 4 do not (1.07); partial blocks
    # are never cached, so a prompt of k whole blocks caches k blocks
    size = (blocks * 4 // 15) * bs
    await cached("X", size)
    for i in range(2):
        await cached(f"Y{i}", size)
    kept = await cached("X", size)
    await cached("Z", size)
    for i in range(3):
        await cached(f"W{i}", size)
    lost = await cached("Z", size)
    full = size - bs  # every whole block but the last (one prompt token is recomputed)
    if kept < full or lost >= full:
        problems.append(f"{url}: a {size}-token prefix kept {kept} after 2 others, {lost} after 3")
    return "; ".join(problems)


def verify_kv(logdir: Path, setup: Setup) -> str:
    """Fresh small-KV engines, probed directly; a one-line verdict (raises on a mismatch)."""
    a = setup.args
    spec = setup.engine_spec("shared")
    engines = start_engines(logdir, a.engines, spec)
    try:
        urls = [e.url for e in engines]
        reported = {c.gpu_blocks for c in scrape(urls)}

        async def all_probes() -> list[str]:
            async with httpx.AsyncClient(timeout=60.0) as client:
                bs = setup.small.block_size
                return list(
                    await asyncio.gather(*(_probe(client, u, a.kv_blocks, bs) for u in urls))
                )

        problems = [p for p in asyncio.run(all_probes()) if p]
    finally:
        for e in engines:
            e.stop()
    if problems or reported != {a.kv_blocks}:
        raise RuntimeError(f"KV check failed (reported {reported}): {'; '.join(problems)}")
    return (
        f"KV ok on {len(urls)} engines: cache_config_info num_gpu_blocks={a.kv_blocks}; "
        f"a {a.kv_blocks * 16}-token request is served and one token more refused (400); "
        f"a {a.kv_blocks * 4 // 15 * 16}-token prefix survives 2 others of its size and is "
        f"(partly) evicted by 3: {a.kv_blocks * 12 // 15} <= blocks < {a.kv_blocks * 16 // 15}"
    )
