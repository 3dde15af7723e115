"""Simulator fidelity: one workload through kvgate + real engines and through the simulator.

The engine model is calibrated on a real engine first (``kvgate calibrate``);
the same requests (token-exact prompt lengths and block hashes from the
engine's tokenizer) are then replayed through ``kvgate serve`` in front of the
real engines and simulated on a cluster of the calibrated profile. The
prediction error of TTFT p50/p90 and mean E2E is reported per policy.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from gateway.bench.loadgen import ReplayRequest, ReplayResult, replay
from gateway.core.vllm_hash import block_ids
from gateway.perfmodel.presets import load_preset
from gateway.sim.loop import ClusterSpec
from gateway.sim.metrics import percentile
from gateway.sim.runner import run_policy
from gateway.sim.workloads import Workload, WorkloadRequest

ROOT = Path(__file__).resolve().parents[2]
WORDS = (
    "router",
    "cache",
    "prefix",
    "block",
    "token",
    "request",
    "decode",
    "prefill",
    "batch",
    "queue",
    "latency",
    "memory",
    "model",
    "gateway",
    "policy",
    "load",
    "balance",
    "hit",
    "route",
    "serve",
    "stream",
    "chunk",
    "engine",
)


def calibrate(target: str, out: Path, *, max_seconds: int = 90) -> Path:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "calibrate",
            "--target",
            target,
            "--out",
            str(out),
            "--base-preset",
            "llama3-8b-h100",
            "--max-seconds",
            str(max_seconds),
            "--max-batched-tokens",
            "2048",
            "--quiet",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=max_seconds + 120,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"calibration failed: {proc.stderr[-2000:]}")
    return out


@dataclass(frozen=True)
class Shape:
    """A workload's shape: words of the 4 shared system prompts (the g-th has ``system[0] +
    g * system[1]``), of each request's unique part, and output tokens (ranges)."""

    system: tuple[int, int] = (150, 60)
    unique: tuple[int, int] = (10, 40)
    output: tuple[int, int] = (8, 32)
    name: str = "chat"


CHAT = Shape()
"""Short shared-prefix chat: ~200-400 token prompts, mostly cached."""
PREFILL = Shape(system=(250, 80), unique=(700, 1300), output=(4, 16), name="prefill")
"""Prefill-dominated: 1-2k token prompts, two thirds of them unique to the request."""


def schedule(n: int, rate: float, seed: int, tag: str, shape: Shape = CHAT) -> list[ReplayRequest]:
    """Shared system prompts (4 groups) + a unique part; Poisson arrivals."""
    rng = random.Random(seed)
    base, step = shape.system
    systems = [
        f"{tag} group {g}: " + " ".join(rng.choice(WORDS) for _ in range(base + step * g))
        for g in range(4)
    ]
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate)
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*shape.unique)))
        out.append(
            ReplayRequest(
                arrival=t,
                prompt=rng.choice(systems) + " Q: " + question,
                output_tokens=rng.randint(*shape.output),
            )
        )
    return out


def sim_workload(engine: str, model: str, requests: list[ReplayRequest], block: int) -> Workload:
    reqs = []
    with httpx.Client(timeout=30) as client:
        for i, r in enumerate(requests):
            tokens = client.post(
                engine + "/tokenize", json={"model": model, "prompt": r.prompt}
            ).json()["tokens"]
            reqs.append(
                WorkloadRequest(
                    id=f"f{i}",
                    arrival=r.arrival,
                    prompt_tokens=len(tokens),
                    output_tokens=r.output_tokens,
                    block_hashes=block_ids(tokens, block),
                )
            )
    return Workload(name="fidelity", requests=tuple(reqs), block_size=block)


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds: busy time of some cores, and the time the engines' processes used."""

    cores_busy: float
    engines: float
    at: float


def cpu_snapshot(session_ids: list[int], cores: set[int]) -> CpuSnapshot:
    """Busy seconds of ``cores`` (``/proc/stat``) and CPU seconds of the processes of these
    sessions (an engine's API server, EngineCore and worker: ``/proc/*/stat``)."""
    tick = os.sysconf("SC_CLK_TCK")
    busy = 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            ticks = [int(v) for v in values]
            busy += sum(ticks) - ticks[3] - ticks[4]  # less idle and iowait
    used = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) in session_ids:  # the session id
                used += int(fields[11]) + int(fields[12])  # utime + stime
        except (OSError, ValueError, IndexError):
            continue
    return CpuSnapshot(busy / tick, used / tick, time.monotonic())


def others_share(before: CpuSnapshot, after: CpuSnapshot, cores: int) -> float:
    """The share of the engines' cores that other processes used between two snapshots."""
    wall = (after.at - before.at) * cores
    other = (after.cores_busy - before.cores_busy) - (after.engines - before.engines)
    return max(0.0, other / wall) if wall > 0 else 0.0


ENGINE_SERIES = {
    "engine_ttft_mean": "vllm:time_to_first_token_seconds",
    "engine_e2e_mean": "vllm:e2e_request_latency_seconds",
    "engine_itl_mean": "vllm:inter_token_latency_seconds",
}


def engine_sums(engines: list[str]) -> dict[str, float]:
    """Sum and count of the engines' own TTFT and E2E histograms, over all engines."""
    out: dict[str, float] = {}
    with httpx.Client(timeout=10) as client:
        for url in engines:
            for line in client.get(url + "/metrics").text.splitlines():
                for key, series in ENGINE_SERIES.items():
                    for part in ("_sum", "_count"):
                        if line.startswith(series + part + "{"):
                            name = key + part
                            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def engine_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean TTFT and E2E as the engines themselves measured them between two snapshots."""
    means = {}
    for key in ENGINE_SERIES:
        count = after.get(key + "_count", 0.0) - before.get(key + "_count", 0.0)
        total = after.get(key + "_sum", 0.0) - before.get(key + "_sum", 0.0)
        means[key] = total / count if count else 0.0
    return means


@dataclass
class Row:
    policy: str
    real: dict[str, float]
    sim: dict[str, float]
    rate: float = 0.0
    workload: str = "chat"

    def error(self, key: str) -> float:
        return abs(self.sim[key] - self.real[key]) / self.real[key]


def stats(ttft: list[float], e2e: list[float]) -> dict[str, float]:
    return {
        "ttft_p50": percentile(ttft, 50) or 0.0,
        "ttft_p90": percentile(ttft, 90) or 0.0,
        "e2e_mean": statistics.mean(e2e) if e2e else 0.0,
        "ttft_mean": statistics.mean(ttft) if ttft else 0.0,
    }


def measure(
    gateway_url: str | None,
    engines: list[str],
    model: str,
    policy: str,
    profile: Path,
    *,
    n: int = 40,
    rate: float = 4.0,
    seed: int = 0,
    shape: Shape = CHAT,
    sessions: list[int] | None = None,
) -> Row:
    """One replay through ``gateway_url`` and its simulation (``gateway_url=None``: straight
    to the engines, the i-th request to engine i mod N, simulated as ``round_robin``);
    ``sessions``: the engines' process sessions (the share of their cores that other
    processes took meanwhile is reported)."""
    sessions = sessions or []
    requests = schedule(n, rate, seed, tag=f"{policy}-{seed}-{rate:g}", shape=shape)
    before = engine_sums(engines)
    cores = {i % 2 for i in range(len(engines))}
    cpu = cpu_snapshot(sessions, cores)
    results = asyncio.run(_send(gateway_url, engines, model, requests))
    others = others_share(cpu, cpu_snapshot(sessions, cores), len(cores))
    after = engine_sums(engines)
    bad = [r.error for r in results if r.error]
    if bad:
        raise RuntimeError(f"replay errors: {bad[:3]}")
    real = stats(
        [r.ttft for r in results if r.ttft is not None],
        [r.e2e for r in results if r.e2e is not None],
    ) | engine_means(before, after)
    real["others_cpu_share"] = others
    perf = load_preset(str(profile))
    workload = sim_workload(engines[0], model, requests, perf.block_size)
    simulated = policy if gateway_url is not None else "round_robin"
    run = run_policy(simulated, workload, ClusterSpec(len(engines), perf))
    sim = stats(
        [x.ttft for x in run.records if x.ttft is not None],
        [x.e2e for x in run.records if x.e2e is not None],
    )
    # engine-side: the same engines without the frontend term (vLLM's histograms start when
    # the API process accepted the request and end before the answer leaves it)
    inside = perf.with_overrides(frontend_ms=0.0, frontend_per_stream_ms=0.0)
    engine_run = run_policy(simulated, workload, ClusterSpec(len(engines), inside))
    engine_stats = stats(
        [x.ttft for x in engine_run.records if x.ttft is not None],
        [x.e2e for x in engine_run.records if x.e2e is not None],
    )
    sim["engine_ttft_mean"] = engine_stats["ttft_mean"]
    sim["engine_e2e_mean"] = engine_stats["e2e_mean"]
    return Row(policy, real, sim, rate, shape.name)


async def _send(
    gateway_url: str | None, engines: list[str], model: str, requests: list[ReplayRequest]
) -> list[ReplayResult]:
    if gateway_url is not None:
        return await replay(gateway_url, model, requests)
    parts = await asyncio.gather(
        *(replay(url, model, requests[i :: len(engines)]) for i, url in enumerate(engines))
    )
    return [r for part in parts for r in part]


CLIENT_KEYS = ("ttft_p50", "ttft_p90", "e2e_mean")
ENGINE_KEYS = ("engine_ttft_mean", "engine_e2e_mean")


def table(rows: list[Row]) -> str:
    """Client-side (through kvgate) and engine-side (vLLM's own histograms) real vs simulated."""
    lines = [
        "| policy | workload | req/s | TTFT p50 real / sim (error) | TTFT p90 real / sim (error) | "
        "E2E mean real / sim (error) | engine-side TTFT mean | engine-side E2E mean | "
        "engines' inter-token mean | other processes on the engines' cores |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [
            f"{r.real[k] * 1000:.1f} / {r.sim[k] * 1000:.1f} ms ({r.error(k):.0%})"
            for k in CLIENT_KEYS + ENGINE_KEYS
        ]
        others = r.real.get("others_cpu_share", 0.0)
        itl = r.real.get("engine_itl_mean", 0.0) * 1000
        lines.append(
            f"| {r.policy} | {r.workload} | {r.rate:g} | "
            + " | ".join(cells)
            + f" | {itl:.1f} ms | {others:.0%} |"
        )
    return "\n".join(lines)


def largest_error(rows: list[Row], keys: tuple[str, ...] = CLIENT_KEYS) -> tuple[float, str]:
    """The largest relative error over ``rows`` and ``keys``, and where it is."""
    return max((r.error(k), f"{r.policy} at {r.rate:g} req/s, {k}") for r in rows for k in keys)
