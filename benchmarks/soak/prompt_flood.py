"""Unique-prompt flood: router memory stays under the configured bound.

Sends ``--prompts`` unique long prompts (no two share a block) through the gateway app with
a prefix-tracking policy (``cache_aware``, ``preble``, ``dualmap``) and samples, every
``--sample-every`` requests, the process RSS (``/proc/self/status`` VmRSS) and the policy's
own structures: blocks per engine in cache_aware's prefix index and dualmap's per-engine
LRUs, blocks and nodes of Preble's radix tree. Their bound is ``--bound`` blocks
(``max_tree_blocks`` / ``cache_blocks``), small enough that a short run fills it several
times over; RSS must stop growing once it is full.

Each policy runs in a fresh child process: the gateway app in process (driven through ASGI,
no HTTP server) in front of in-process fake engines that answer at once, so the process is
the router and nothing else. Two engines report a KV capacity of ``--kv-blocks`` blocks.

    python -m benchmarks.soak.prompt_flood [--policies cache_aware,preble,dualmap]
        [--prompts 20000] [--prompt-chars 4000] [--bound 50000] [--option preble.window_s=10]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import REPO_ROOT, benchmark_parser, rss_kib

ENGINES = ("http://flood-a:1", "http://flood-b:1")
MODEL = "flood-model"
OPTION = {"cache_aware": "max_tree_blocks", "preble": "max_tree_blocks", "dualmap": "cache_blocks"}


def fake_engines(kv_blocks: int) -> httpx.MockTransport:
    metrics = (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="{MODEL}"}} 0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.5\n'
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{kv_blocks}"}} 1.0\n'
    )
    answer = {
        "id": "cmpl-flood",
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1000, "completion_tokens": 1, "total_tokens": 1001},
    }

    def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": MODEL}]})
        if path == "/metrics":
            return httpx.Response(200, text=metrics)
        return httpx.Response(200, json=answer)

    return httpx.MockTransport(handle)


def structures(policy: Any) -> dict[str, int]:
    """The sizes of the policy's own prefix state."""
    name = policy.name
    if name == "cache_aware":
        index = policy.index
        return {
            "max_engine_blocks": max((index.size(e) for e in ENGINES), default=0),
            "distinct_blocks": len(index),
        }
    if name == "preble":
        return {"tree_blocks": policy.tree.num_blocks, "tree_nodes": policy.tree.num_nodes}
    if name == "dualmap":
        cache = policy.cache
        return {
            "max_engine_blocks": max((cache.size(e) for e in ENGINES), default=0),
            "distinct_blocks": len(cache),
            "hot_prefixes_expanded": policy.hotness.expanded,
        }
    return {}


async def flood(args: argparse.Namespace) -> list[dict[str, Any]]:
    from gateway.config import load_settings
    from gateway.proxy.app import create_app

    options: dict[str, Any] = {OPTION[args.policy]: args.bound}
    for item in args.option:
        key, _, value = item.partition("=")
        name, _, knob = key.partition(".")
        if name == args.policy:
            options[knob] = value
    settings = load_settings(
        engines=[{"url": u} for u in ENGINES],
        policy={"name": args.policy, "options": options},
        log_requests=False,
        health={"interval_s": 5.0},
        block_size=16,
    )
    app = create_app(settings, transport=fake_engines(args.kv_blocks))
    rows: list[dict[str, Any]] = []
    filler = ("lorem ipsum dolor sit amet " * (args.prompt_chars // 27 + 1))[: args.prompt_chars]
    async with app.router.lifespan_context(app):
        policy = app.state.gateway.dispatcher.policy
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            sem = asyncio.Semaphore(args.concurrency)
            failed = 0

            async def one(i: int) -> None:
                nonlocal failed
                # unique from the first character: every block of every prompt is new
                prompt = f"{uuid.uuid4().hex} {i} " + filler
                async with sem:
                    r = await client.post(
                        "/v1/completions",
                        json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
                    )
                if r.status_code != 200:
                    failed += 1

            t0 = time.monotonic()
            gc.collect()
            rows.append({"sent": 0, "rss_mib": round(rss_kib() / 1024, 1), **structures(policy)})
            for start in range(0, args.prompts, args.sample_every):
                batch = range(start, min(args.prompts, start + args.sample_every))
                await asyncio.gather(*(one(i) for i in batch))
                gc.collect()
                rows.append(
                    {
                        "sent": batch.stop,
                        "seconds": round(time.monotonic() - t0, 1),
                        "failed": failed,
                        "rss_mib": round(rss_kib() / 1024, 1),
                        **structures(policy),
                    }
                )
    return rows


def child(args: argparse.Namespace) -> int:
    rows = asyncio.run(flood(args))
    print(json.dumps({"policy": args.policy, "bound": args.bound, "rows": rows}))
    return 0


def summarize(result: dict[str, Any], prompt_blocks: int) -> str:
    rows = result["rows"]
    last = rows[-1]
    half = rows[len(rows) // 2]
    size_key = "tree_blocks" if result["policy"] == "preble" else "max_engine_blocks"
    peak = max(r[size_key] for r in rows)
    return (
        f"| {result['policy']} | {last['sent']} ({last['sent'] * prompt_blocks} blocks) | "
        f"{result['bound']} | {peak} | {rows[0]['rss_mib']} | {half['rss_mib']} | "
        f"{max(r['rss_mib'] for r in rows)} | {last['rss_mib']} | "
        f"{last['rss_mib'] - half['rss_mib']:+.1f} | {last['failed']} | {last['seconds']} |"
    )


def main() -> int:
    ap = benchmark_parser(__doc__, "benchmarks.soak.prompt_flood")
    ap.add_argument("--policies", default="cache_aware,preble,dualmap")
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", type=int, default=20_000)
    ap.add_argument("--prompt-chars", type=int, default=4000, help="~1000 tokens each")
    ap.add_argument("--bound", type=int, default=50_000, help="blocks: the policies' bound")
    ap.add_argument("--kv-blocks", type=int, default=1_000_000, help="engines' KV capacity")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--sample-every", type=int, default=1000)
    ap.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="POLICY.KEY=VALUE",
        help="another knob, e.g. preble.window_s=10",
    )
    ap.add_argument("--out", type=Path, help="write all samples as JSON here")
    args = ap.parse_args()
    if args.policy:
        return child(args)
    results = []
    for policy in args.policies.split(","):
        cmd = [sys.executable, "-m", "benchmarks.soak.prompt_flood", "--policy", policy]
        for flag in ("prompts", "prompt_chars", "bound", "kv_blocks", "concurrency"):
            cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
        cmd += ["--sample-every", str(args.sample_every)]
        for item in args.option:
            cmd += ["--option", item]
        print(f"flooding {policy} ...", file=sys.stderr, flush=True)
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO_ROOT)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    # chunks of block_size x chars_per_token = 64 characters are one block
    prompt_blocks = (args.prompt_chars + 34) // 64
    print(
        f"{args.prompts} unique prompts of ~{args.prompt_chars} characters "
        f"(~{prompt_blocks} blocks each), bound {args.bound} blocks, 2 engines, "
        f"concurrency {args.concurrency}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    print(
        "| policy | prompts (blocks offered) | bound | peak size | RSS start | RSS half | "
        "RSS max | RSS end | end - half | failed | seconds |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for result in results:
        print(summarize(result, prompt_blocks))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
