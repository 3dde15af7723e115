"""Decision time: the microsecond figures docs/performance.md quotes, printed.

1. **Policy ``decide``**, every registered policy, timed by the dispatcher's
   injected timer inside full simulations (8 engines) of the Mooncake synthetic
   trace (``--trace``; the first ``--limit`` requests), p50/p99/max per policy.
   Prefix-aware policies' tails follow the trace's longest prompts.
2. **Preble at scale**: a 32k-token prompt against a ~1M-block tree, and the
   128-node deep path, from ``python -m benchmarks.speed.radix_tree`` (run it; its
   figures are printed there, with their targets).
3. **The gateway's own per-request work** outside the frameworks: JSON parse,
   request validation, routing key (text), one metric update, a rate-limit
   bucket take, the hop-by-hop header filter, and the policy decision of the
   default policy on a 3-engine view (``timeit``, best of 5 repeats).

    python -m benchmarks.speed.decision_time [--trace PATH] [--limit 3000] [--policies ...]

``--policies`` takes registry names or ``name:key=v;key=v`` (a policy with its knobs).
"""

from __future__ import annotations

import json
import os
import sys
import time
import timeit
from pathlib import Path

from benchmarks.common import benchmark_parser, mooncake_trace
from benchmarks.quality.diagnose import parse_policy
from gateway.config import PolicyConfig
from gateway.core.types import ClusterView, EngineView, RequestInfo
from gateway.observability import GatewayMetrics
from gateway.perfmodel.presets import DEFAULT_PRESET, load_preset
from gateway.policies.base import PolicyContext
from gateway.policies.registry import create_policy, policy_names
from gateway.proxy.intake import forwarded_client_headers
from gateway.proxy.ratelimit import TokenBuckets
from gateway.proxy.routing_key import RoutingKeyer
from gateway.proxy.schemas import CompletionBody, parse_json_object, validate
from gateway.sim.loop import ClusterSpec
from gateway.sim.metrics import percentile
from gateway.sim.runner import run_policy
from gateway.sim.workloads import WorkloadOptions, load_workload


def policy_decisions(trace: Path, limit: int, policies: list[str]) -> None:
    workload = load_workload(f"mooncake:{trace}", WorkloadOptions(limit=limit))
    cluster = ClusterSpec(8, load_preset(DEFAULT_PRESET))
    longest = max(r.prompt_tokens for r in workload.requests)
    print(
        f"policy decide (us), {len(workload)} requests of the Mooncake synthetic trace "
        f"(longest prompt {longest:,} tokens), 8 x {DEFAULT_PRESET}"
    )
    print(f"  {'policy':<17} {'p50':>7} {'p99':>8} {'max':>8}")
    for spec in policies:  # a registry name, or name:key=v;key=v
        name, options = parse_policy(spec)
        run = run_policy(name, workload, cluster, options=options, timer=time.perf_counter)
        us = [s * 1e6 for s in run.decision_seconds]
        p50, p99 = percentile(us, 50) or 0.0, percentile(us, 99) or 0.0
        print(f"  {spec:<17} {p50:7.1f} {p99:8.1f} {max(us):8.1f}", flush=True)


def best_us(stmt: object, number: int = 20_000) -> float:
    """Best-of-5 microseconds per call of ``stmt``."""
    return min(timeit.repeat(stmt, number=number, repeat=5)) / number * 1e6  # type: ignore[arg-type]


def per_request_work() -> None:
    prompt = "You are a helpful assistant. " * 8 + "Summarise the routing policy."
    raw = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 16, "stream": True}).encode()
    body = parse_json_object(raw)
    keyer = RoutingKeyer(16, 4.0)
    metrics = GatewayMetrics()
    counter = metrics.requests.labels("completions", "cache_aware", "ok")
    buckets = TokenBuckets(1e9, 1_000_000)
    headers = {"x-session-id": "s1", "connection": "keep-alive", "content-type": "x"}
    default = PolicyConfig().name
    policy = create_policy(default, PolicyContext(perf=load_preset(DEFAULT_PRESET)))
    hashes, tokens = keyer.key(prompt)
    info = RequestInfo("r", hashes, tokens, 0.0)
    view = ClusterView(tuple(EngineView(f"http://e{i}:8000", in_flight=i) for i in range(3)))
    big = json.dumps({"model": "m", "prompt": "x" * 1_000_000}).encode()
    rows = [
        ("JSON parse (parse_json_object)", lambda: parse_json_object(raw)),
        ("JSON parse incl. nesting check, 1 MB", lambda: parse_json_object(big)),
        ("validation (CompletionBody)", lambda: validate(CompletionBody, body)),
        ("routing key (text, 270 chars)", lambda: keyer.key(prompt)),
        ("one metric update (counter inc)", counter.inc),
        ("rate-limit bucket take", lambda: buckets.take("client")),
        ("hop-by-hop header filter", lambda: forwarded_client_headers(headers)),
        (f"{default}.decide, 3 engines", lambda: policy.decide(info, view, 0.0)),
    ]
    print("gateway per-request work (us per call, best of 5 x 20,000 calls; 200 for 1 MB)")
    for label, fn in rows:
        number = 200 if "1 MB" in label else 20_000
        print(f"  {label:<38} {best_us(fn, number):8.2f}", flush=True)


def main() -> int:
    ap = benchmark_parser(__doc__, "benchmarks.speed.decision_time")
    ap.add_argument("--trace", type=Path, default=mooncake_trace())
    ap.add_argument("--limit", type=int, default=3000)
    ap.add_argument("--policies", default=",".join(policy_names()))
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    per_request_work()
    if args.trace.is_file():
        policy_decisions(args.trace, args.limit, args.policies.split(","))
    else:
        print(f"trace not found: {args.trace} (set KVGATE_DATA or --trace)", file=sys.stderr)
    print("Preble's 32k-token decide and deep path: python -m benchmarks.speed.radix_tree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
