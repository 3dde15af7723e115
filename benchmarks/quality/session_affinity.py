"""Session affinity in the simulator: does "sticky until saturated" keep the live targets?

The live routing benchmark's shape (``benchmarks/live/routing.py``): 4 engines of 300 KV
blocks, 1,601-token prompts (8 Zipf(1.0) system prompts of 1,500 tokens + a unique question,
or unique throughout), 32 output tokens, Poisson at 70 % of the no-reuse capacity. Requests
carry sessions in one of these ways:

* ``none`` — no session (the baseline);
* ``prompt`` — one session per system prompt (the hottest session has ~37 % of requests:
  the worst case for concentration);
* ``agents`` — 4 sessions per system prompt (32 agents sharing 8 prompts);
* ``random`` — 16 sessions drawn independently of the prompt (affinity against the prefix).

``chat`` and ``agent`` are the production-shaped generators (``gen:chat``, ``gen:agent``:
sessions whose turns extend the previous prompt, behind a shared system prompt or hot tool
prompts) on 4 engines of the preset's KV at ``--trace-rate`` req/s, with ``--follow`` of the
requests continuing a session and ``--think`` seconds between turns. Prints the
busiest-engine share, the engines' hit rate, TTFT p50/p99 (ms) and the affinity outcomes
per (workload, sessions, policy, settings).

    python -m benchmarks.quality.session_affinity [--policies predicted_ttft,cache_aware]
        [--ratios 1.5] [--floors 3:256] [--requests 800]
"""

from __future__ import annotations

import random
from collections import Counter

from benchmarks.common import benchmark_parser
from benchmarks.live.workloads import SharedPrefixShape, no_reuse_capacity, poisson_arrivals
from gateway.perfmodel.presets import load_preset
from gateway.policies.base import PolicyContext
from gateway.policies.registry import create_policy
from gateway.policies.session_affinity import StickySettings
from gateway.sim.gen_common import zipf_cum_weights
from gateway.sim.loop import ClusterSpec, Simulation
from gateway.sim.metrics import latency_summary
from gateway.sim.workloads import Workload, WorkloadOptions, WorkloadRequest, load_workload

BLOCK = 16
MODES = ("none", "prompt", "agents", "random")


def shared_workload(
    shape: SharedPrefixShape, n: int, rate: float, seed: int, mode: str, unique: bool = False
) -> Workload:
    """Workload A (or B with ``unique``) as block hashes, with sessions as ``mode`` says."""
    rng = random.Random(f"{seed}:prompts")  # the same requests whatever the sessions
    pick = random.Random(f"{seed}:{mode}")
    weights = zipf_cum_weights(shape.prefixes, shape.zipf)
    blocks = shape.prompt_tokens // BLOCK
    system_blocks = 0 if unique else shape.system_tokens // BLOCK
    out = []
    for i, t in enumerate(poisson_arrivals(n, rate, random.Random(f"{seed}:arrivals"))):
        k = rng.choices(range(shape.prefixes), cum_weights=weights)[0]
        hashes = tuple(
            (k + 1) * 1_000 + j if j < system_blocks else 10**9 + i * 1_000 + j
            for j in range(blocks)
        )
        session = {
            "none": None,
            "prompt": f"p{k}",
            "agents": f"p{k}-{pick.randrange(4)}",
            "random": f"r{pick.randrange(16)}",
        }[mode]
        out.append(
            WorkloadRequest(
                f"req-{i}", t, shape.prompt_tokens, shape.output_tokens, hashes, session=session
            )
        )
    return Workload("unique" if unique else "shared", tuple(out), BLOCK)


def without_sessions(wl: Workload) -> Workload:
    reqs = tuple(
        WorkloadRequest(r.id, r.arrival, r.prompt_tokens, r.output_tokens, r.block_hashes, r.slo)
        for r in wl.requests
    )
    return Workload(wl.name, reqs, wl.block_size)


def run(cluster: ClusterSpec, policy: str, wl: Workload, seed: int) -> dict[str, object]:
    sim = Simulation(cluster, create_policy(policy, PolicyContext(seed=seed)), wl)
    out = sim.run()
    summary = latency_summary(out.records)
    counts = Counter(r.engine for r in out.records if r.engine)
    sessions = sim.dispatcher.sessions
    return {
        "busiest": max(counts.values()) / max(1, sum(counts.values())),
        "hit": summary["cache_hit_rate"],
        "p50": 1000 * (summary["ttft_p50"] or 0.0),
        "p99": 1000 * (summary["ttft_p99"] or 0.0),
        "outcomes": dict(sessions.outcomes) if sessions is not None else {},
    }


def main(argv: list[str] | None = None) -> None:
    p = benchmark_parser(__doc__, "benchmarks.quality.session_affinity")
    p.add_argument("--policies", default="predicted_ttft,cache_aware,round_robin")
    p.add_argument("--workloads", default="shared,unique,chat")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--ratios", default="1.5", help="load_ratio values, comma list")
    p.add_argument("--floors", default="3:256", help="min_in_flight:min_pending_tokens list")
    p.add_argument("--requests", type=int, default=800)
    p.add_argument("--load", type=float, default=0.7)
    p.add_argument("--trace-rate", type=float, default=3.0, help="chat/agent req/s (3)")
    p.add_argument("--follow", type=float, default=0.7, help="chat/agent turns that continue")
    p.add_argument("--think", type=float, default=10.0, help="chat/agent s between turns")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    shape = SharedPrefixShape()
    small = load_preset("llama3-8b-h100").with_overrides(kv_capacity_blocks=300)
    cap = no_reuse_capacity(small, [(shape.prompt_tokens, shape.output_tokens)] * 256)
    rate = a.load * 4 * cap
    settings: list[StickySettings | None] = [None]
    for ratio in a.ratios.split(","):
        for floor in a.floors.split(","):
            n, tokens = floor.split(":")
            settings.append(StickySettings(600, 100_000, float(ratio), int(n), int(tokens)))
    print(f"4 engines x 300 blocks, {rate:.1f} req/s ({a.load:.0%} of no-reuse capacity)")
    print("workload  sessions  policy          affinity          busiest  hit    p50 ms  p99 ms")
    for name in a.workloads.split(","):
        if name in ("chat", "agent"):
            spec = (
                f"gen:{name}?n={a.requests}&rate={a.trace_rate}&seed={a.seed}"
                f"&follow={a.follow}&think={a.think}"
            )
            trace = load_workload(spec, WorkloadOptions(block_size=BLOCK, seed=a.seed))
            cases = [("sessions", trace, load_preset("llama3-8b-h100"))]
        else:
            cases = [
                (
                    mode,
                    shared_workload(shape, a.requests, rate, a.seed, mode, name == "unique"),
                    small,
                )
                for mode in a.modes.split(",")
            ]
        for mode, wl, perf in cases:
            for policy in a.policies.split(","):
                for s in settings:
                    if s is not None and mode == "none":
                        continue
                    cluster = ClusterSpec(4, perf, sessions=s)
                    r = run(cluster, policy, wl if s is not None else without_sessions(wl), a.seed)
                    label = (
                        "off"
                        if s is None
                        else f"{s.load_ratio}x {s.min_in_flight}/{s.min_pending_tokens}"
                    )
                    print(
                        f"{name:9s} {mode:9s} {policy:15s} {label:17s} {r['busiest']:6.1%}"
                        f"  {r['hit']:.3f}  {r['p50']:6.0f}  {r['p99']:6.0f}  {r['outcomes'] or ''}"
                    )


if __name__ == "__main__":
    main()
