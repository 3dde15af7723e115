"""One open-loop load through kvgate + emulated engines, and the same through the simulator.

The arrivals (shared system prompts of a few groups, Zipf-like popularity, a
unique question each, Poisson in time) are sent with the official ``openai``
client at their scheduled times, many in flight, to ``kvgate serve`` (token
keying, decision log on) in front of ``kvgate emulate`` engines of one engine
model; the simulator runs the same requests (token-exact prompts from the
engine's ``/tokenize``) on a cluster of the same model. Used by the parity
tests and, with ``python tests/parity/load_harness.py``, to measure the spread
their tolerances rest on (``--summarize FILE`` prints the table of a saved run).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from dataclasses import astuple, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import yaml
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from procs import MODEL, Proc, start, start_emulator, wait_for

from gateway.cli.demo import free_port
from gateway.core.blocks import hashes_from_tokens
from gateway.core.types import Decision
from gateway.perfmodel.model import PerfModel
from gateway.perfmodel.presets import load_preset, preset_to_dict
from gateway.policies.recording import Call
from gateway.policies.recording_codec import decode_call, decode_spec
from gateway.sim.loop import ClusterSpec, Simulation
from gateway.sim.runner import run_policy
from gateway.sim.workloads import Workload, WorkloadRequest

ENGINES = 3
BLOCK = 16
KV_BLOCKS = 500
"""Per engine: about 12 of the prompts below, so caches evict under every policy."""
TIME_SCALE = 1.0
"""Real seconds per modelled second: engine times (tens of ms) stay well above timer jitter."""
RATE = 30.0
SCRAPE_S = float(os.environ.get("KVGATE_PARITY_SCRAPE_S", "1.0"))
"""The gateway's engine scrape interval (its default 1 s)."""
SIM_SCRAPE_S = float(os.environ.get("KVGATE_PARITY_SIM_SCRAPE_S", str(SCRAPE_S)))
"""The scrape the simulator models (0: exact engine numbers at every decision)."""
N = 120
WORDS = "route cache prefix block token batch queue engine decode prefill stream serve".split()  # noqa: SIM905
OPTIONS: dict[str, dict[str, str]] = {}
"""Policy options for both sides (none: every policy at its defaults)."""


def engine_model() -> PerfModel:
    return load_preset("llama3-8b-h100").with_overrides(name="parity", kv_capacity_blocks=KV_BLOCKS)


@dataclass(frozen=True)
class Arrival:
    rid: str
    at: float
    prompt: str
    output_tokens: int
    stream: bool


def arrivals(tag: str, *, n: int = N, rate: float = RATE, seed: int = 0) -> list[Arrival]:
    """``n`` requests: 6 system prompts (Zipf-like), a unique question, Poisson arrivals."""
    rng = random.Random(seed)
    systems = [
        f"{tag} system {g}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 110)))
        for g in range(6)
    ]
    weights = [1 / (g + 1) for g in range(6)]
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        system = rng.choices(systems, weights)[0]
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
        out.append(
            Arrival(f"{tag}-{i}", t, f"{system} Q{i}: {question}", rng.randint(4, 24), i % 2 == 1)
        )
    return out


@dataclass
class Served:
    rid: str
    engine: int
    prompt_tokens: int
    cached_tokens: int


@dataclass
class LiveRun:
    served: list[Served]
    spec: dict[str, Any]
    calls: list[Call]
    truncated: bool
    wall_s: float
    errors: list[str] = field(default_factory=list)


@dataclass
class Cluster:
    """Emulated engines of :func:`engine_model`, shared by the runs of a module."""

    engines: list[Proc]
    preset: Path
    logdir: Path

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def stop(self) -> None:
        for e in self.engines:
            e.stop()


def start_cluster(logdir: Path, n: int = ENGINES) -> Cluster:
    preset = logdir / "parity-engine.yaml"
    preset.write_text(yaml.safe_dump(preset_to_dict(engine_model())), encoding="utf-8")
    extra = ["--preset", str(preset), "--log-level", "warning"]
    engines = []
    try:
        for i in range(n):
            engines.append(
                start_emulator(logdir, i, time_scale=TIME_SCALE, extra=extra, timeout=120)
            )
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return Cluster(engines, preset, logdir)


def start_gateway(cluster: Cluster, policy: str, *, tag: str) -> Proc:
    config = {
        "engines": [{"url": u} for u in cluster.urls],
        "policy": {"name": policy, "options": OPTIONS.get(policy, {})},
        "keying": "tokens",
        "preset": str(cluster.preset),
        "decision_log": {"enabled": True},
        "log_requests": False,
        "log_level": "warning",
        "health": {"interval_s": SCRAPE_S},
    }
    path = cluster.logdir / f"gateway-{tag}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    port = free_port()
    proc = start(["serve", "--port", str(port), "--config", str(path)], f"gw-{tag}", port,
                 cluster.logdir)  # fmt: skip
    wait_for(proc, "/ready", timeout=120)  # a loaded 2-core machine: 30 s were not enough
    return proc


async def _send(oa: AsyncOpenAI, a: Arrival, urls: list[str]) -> Served:
    args: dict[str, Any] = {
        "model": MODEL,
        "prompt": a.prompt,
        "max_tokens": a.output_tokens,
        "extra_body": {"ignore_eos": True},
        "extra_headers": {"x-request-id": a.rid},
    }
    if a.stream:
        raw = await oa.completions.with_raw_response.create(
            **args, stream=True, stream_options={"include_usage": True}
        )
        usage = None
        async for chunk in raw.parse():
            usage = chunk.usage or usage
    else:
        raw = await oa.completions.with_raw_response.create(**args)
        usage = raw.parse().usage
    assert usage is not None and usage.completion_tokens == a.output_tokens
    details = usage.prompt_tokens_details
    return Served(
        a.rid,
        urls.index(raw.headers["x-kvgate-engine"]),
        usage.prompt_tokens,
        (details.cached_tokens or 0) if details else 0,
    )


async def _load(url: str, plan: list[Arrival], urls: list[str]) -> tuple[list[Served], float]:
    oa = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    # open the client's connections first (no policy call): cold connections delayed the
    # first requests by 30-80 ms, bunching them
    await asyncio.gather(*(oa.models.list() for _ in range(24)))
    start_t = time.monotonic()
    tasks = []
    for a in plan:
        delay = start_t + a.at * TIME_SCALE - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_send(oa, a, urls)))
    served = await asyncio.gather(*tasks)
    await oa.close()
    return list(served), time.monotonic() - start_t


def fetch_log(url: str) -> tuple[dict[str, Any], list[Call], bool]:
    """The gateway's whole decision log: its spec, the calls (decoded), truncated or not."""
    calls: list[Call] = []
    with httpx.Client(timeout=30) as client:
        while True:
            page = client.get(
                url + "/admin/decisions", params={"offset": len(calls), "limit": 5000}
            ).json()
            calls += [decode_call(c) for c in page["calls"]]
            if len(calls) >= page["total"] or not page["calls"]:
                return page["spec"], calls, page["truncated"]


def run_live(cluster: Cluster, policy: str, plan: list[Arrival], *, tag: str) -> LiveRun:
    gw = start_gateway(cluster, policy, tag=tag)
    try:
        served, wall = asyncio.run(_load(gw.url, plan, cluster.urls))
        spec, calls, truncated = fetch_log(gw.url)
    finally:
        gw.stop()
    return LiveRun(served, spec, calls, truncated, wall)


def sim_workload(cluster: Cluster, plan: list[Arrival]) -> Workload:
    """The arrivals with the engine's own token counts and block hashes."""
    reqs = []
    with httpx.Client(timeout=30) as client:
        for a in plan:
            tokens = client.post(
                cluster.urls[0] + "/tokenize", json={"model": MODEL, "prompt": a.prompt}
            ).json()["tokens"]
            reqs.append(
                WorkloadRequest(
                    id=a.rid,
                    arrival=a.at,
                    prompt_tokens=len(tokens),
                    output_tokens=a.output_tokens,
                    block_hashes=hashes_from_tokens(tokens, BLOCK),
                )
            )
    return Workload(name="parity-load", requests=tuple(reqs), block_size=BLOCK)


def run_sim(policy: str, workload: Workload, urls: list[str]) -> list[Served]:
    """The simulated run, its engines named as the live ones (hash rings place them alike)."""
    cluster = ClusterSpec(
        len(urls), engine_model(), engine_ids=tuple(urls), scrape_interval_s=SIM_SCRAPE_S
    )
    run = run_policy(policy, workload, cluster, options=OPTIONS.get(policy))
    return [
        Served(r.source.id, urls.index(r.engine), r.source.prompt_tokens, r.cached_tokens)
        for r in run.records
    ]


class Follow:
    """The policy under test inside the simulator, on the live run's routing: each decide
    asks the policy (on the simulated view) and records its answer, then returns the
    live run's decision for the request, so the simulated cluster holds what the live one
    held when each request came. Every other call goes to the policy unchanged."""

    def __init__(self, policy: Any, live: dict[str, Decision]) -> None:
        self._policy = policy
        self._live = live
        self.own: dict[str, Decision] = {}
        self.views: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)

    def decide(self, req: Any, view: Any, now: float) -> Decision:
        own = self._policy.decide(req, view, now)
        self.own.setdefault(req.id, own)
        self.views.setdefault(req.id, view)
        return self._live.get(req.id, own)


def first_decides(calls: list[Call]) -> dict[str, Call]:
    """Each request's first decide call in a live log."""
    out: dict[str, Call] = {}
    for c in calls:
        if c.method == "decide":
            out.setdefault(c.args[0].id, c)
    return out


@dataclass(frozen=True)
class Followed:
    """The live run's requests and routing replayed through the simulator (:func:`follow`)."""

    agreement: float
    """Share of requests the policy decided alike on the simulated and the live view
    (engine and hold)."""
    in_flight_gap: float
    """Mean over requests of the summed per-engine difference between the router's own
    in-flight counts in the live view and in the simulated one."""
    in_flight: float
    """Mean over requests of the simulated view's in-flight requests (all engines): the
    scale of the gap."""
    below: float
    """Share of (request, engine) pairs where the live view counts fewer requests in flight
    than the simulated one (the live engines cannot finish before the model does)."""


def follow(workload: Workload, live: LiveRun, urls: list[str]) -> Followed:
    """The live run's requests at the live arrival times (when the gateway decided), each
    routed as the gateway routed it, through the simulator; at each request the policy
    (built from the gateway's log spec, fed every hook the simulator calls) decides on the
    simulated view too, and that view and decision are compared with the live ones."""
    live_calls = first_decides(live.calls)
    t0 = min(c.args[2] for c in live_calls.values())
    first = min(r.arrival for r in workload.requests)
    requests = sorted(
        (replace(r, arrival=first + live_calls[r.id].args[2] - t0) for r in workload.requests),
        key=lambda r: r.arrival,
    )
    cluster = ClusterSpec(
        len(urls), engine_model(), engine_ids=tuple(urls), scrape_interval_s=SIM_SCRAPE_S
    )
    decided = {rid: c.result for rid, c in live_calls.items()}
    sim = Follow(decode_spec(live.spec).build(), decided)  # the policy the gateway built
    Simulation(cluster, sim, replace(workload, requests=tuple(requests))).run()
    same = gap = flying = below = pairs = 0
    for rid, c in live_calls.items():
        d, own = c.result, sim.own[rid]
        same += (d.engine, d.hold) == (own.engine, own.hold)
        mine = {e.id: e.in_flight for e in sim.views[rid].engines}
        gap += sum(abs(e.in_flight - mine[e.id]) for e in c.args[1].engines)
        below += sum(e.in_flight < mine[e.id] for e in c.args[1].engines)
        pairs += len(c.args[1].engines)
        flying += sum(mine.values())
    n = len(live_calls)
    return Followed(same / n, gap / n, flying / n, below / pairs)


def shares(served: list[Served], engines: int = ENGINES) -> list[float]:
    counts = [0] * engines
    for s in served:
        counts[s.engine] += 1
    return [c / len(served) for c in counts]


def hit_rate(served: list[Served]) -> float:
    return sum(s.cached_tokens for s in served) / sum(s.prompt_tokens for s in served)


def share_gap(a: list[Served], b: list[Served], *, ordered: bool = False) -> float:
    """Largest difference of one engine's request share between two runs (``ordered``:
    of the i-th largest share, whichever engine had it)."""
    x, y = shares(a), shares(b)
    if ordered:
        x, y = sorted(x), sorted(y)
    return max(abs(p - q) for p, q in zip(x, y, strict=True))


def same_engine(a: list[Served], b: list[Served]) -> float:
    """The share of requests served by the same engine in two runs of the same arrivals
    (requests matched by their index: runs' tags differ)."""
    where = {s.rid.rsplit("-", 1)[1]: s.engine for s in b}
    return sum(s.engine == where[s.rid.rsplit("-", 1)[1]] for s in a) / len(a)


def max_in_flight(calls: list[Call]) -> int:
    """The most requests the router had in flight when it decided (over all decides)."""
    return max(
        (sum(e.in_flight for e in c.args[1].engines) for c in calls if c.method == "decide"),
        default=0,
    )


def _measure(policies: list[str], repeats: int) -> None:
    """Print live-vs-live and live-vs-sim gaps: the spread the tolerances rest on."""
    import tempfile

    from gateway.policies.registry import policy_names

    print(f"load average {os.getloadavg()}, scrape {SCRAPE_S} s (sim {SIM_SCRAPE_S})", flush=True)
    lines: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = start_cluster(Path(tmp))
        try:
            for policy in policies or policy_names():
                for r in range(repeats):
                    # equal-length tags: the same token counts and block structure, no hits
                    # on another run's blocks (stale blocks are evicted first, as from empty)
                    plans = [arrivals(f"{k}{r}{policy[:3]}", seed=r) for k in "ab"]
                    live = [
                        run_live(cluster, policy, p, tag=f"{policy}{r}{k}")
                        for p, k in zip(plans, "ab", strict=True)
                    ]
                    sim = run_sim(policy, sim_workload(cluster, plans[0]), cluster.urls)
                    row = {
                        "policy": policy,
                        "seed": r,
                        "live_live_share": round(share_gap(live[0].served, live[1].served), 3),
                        "live_sim_share": [round(share_gap(x.served, sim), 3) for x in live],
                        "hit_live": [round(hit_rate(x.served), 3) for x in live],
                        "hit_sim": round(hit_rate(sim), 3),
                        "shares_live": [[round(v, 2) for v in shares(x.served)] for x in live],
                        "shares_sim": [round(x, 2) for x in shares(sim)],
                        "in_flight": [max_in_flight(x.calls) for x in live],
                        "same_engine_sim": [round(same_engine(x.served, sim), 3) for x in live],
                        "follow": [
                            [
                                round(v, 3)
                                for v in astuple(follow(sim_workload(cluster, p), x, cluster.urls))
                            ]
                            for p, x in zip(plans, live, strict=True)
                        ],
                        "wall_s": [round(x.wall_s, 2) for x in live],
                    }
                    print(json.dumps(row), flush=True)
                    lines.append(json.dumps(row))
        finally:
            cluster.stop()
    print(summarize(lines))


def summarize(lines: list[str]) -> str:
    """The largest gaps per policy over measurement rows (the JSON lines printed above)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        if line.startswith("{"):
            row = json.loads(line)
            by.setdefault(row["policy"], []).append(row)
    out = [
        "| policy | runs | share gap live-live | share gap live-sim | sorted live-sim "
        "| hit gap live-live | hit gap live-sim | max in flight (min over runs) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for policy, rows in by.items():
        srt = max(
            max(abs(a - b) for a, b in zip(sorted(x), sorted(r["shares_sim"]), strict=True))
            for r in rows
            for x in r["shares_live"]
        )
        cells = [
            len(rows) * 2,
            max(r["live_live_share"] for r in rows),
            max(max(r["live_sim_share"]) for r in rows),
            srt,
            max(abs(r["hit_live"][0] - r["hit_live"][1]) for r in rows),
            max(abs(h - r["hit_sim"]) for r in rows for h in r["hit_live"]),
        ]
        inflight = min(min(r["in_flight"]) for r in rows)
        shown = [str(cells[0]), *(f"{c:.3f}" for c in cells[1:])]
        out.append(f"| {policy} | " + " | ".join(shown) + f" | {inflight} |")
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--summarize":
        print(summarize(Path(sys.argv[2]).read_text().splitlines()))
    else:
        _measure([p for p in sys.argv[1].split(",") if p] if len(sys.argv) > 1 else [], 3)
