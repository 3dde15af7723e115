"""Preble's radix tree at scale: decision time, memory per million blocks, insert throughput.

Builds a tree of about ``--blocks`` blocks (default 1M) spread over ``--engines`` engines
(default 8) through ``PreblePolicy.on_routed``, as the dispatcher would: ``--groups``
shared prefixes (documents, system prompts) of ``--shared`` blocks, each request one of them
plus a unique tail, ``--prompt-blocks`` blocks in all (default 2048 = a 32k-token prompt).
Then times ``PreblePolicy.decide`` (and ``RadixTree.match`` alone) for 32k-token prompts,
interleaved: full hits and shared prefix + new tail (exploit), a third of a shared prefix +
new tail and misses (explore).

Last, multi-turn conversations (``--conversations``, turns of ``--turn-blocks``) give paths
of ``--prompt-blocks / --turn-blocks`` nodes: ``match`` visits every node on the path and
every engine listed there, so this is the slow case.

Target (issue: Preble policy): p99 decision time <= 200 us for a 32k-token prompt against a
1M-block tree over 8 engines.

    python -m benchmarks.speed.radix_tree [--blocks 1000000] [--engines 8] [--decisions 4000]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import resource
import sys
import time
import tracemalloc

from benchmarks.common import benchmark_parser
from gateway.core.types import ClusterView, Decision, EngineView, RequestInfo
from gateway.perfmodel.presets import DEFAULT_PRESET, load_preset
from gateway.policies.base import PolicyContext
from gateway.policies.preble import PrebleConfig, PreblePolicy

TARGET_P99_US = 200.0
BLOCK = 16


def rss_mib() -> float:
    """Current resident set size (Linux /proc), else the peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


class Builder:
    """Synthetic chained prompts: unique random 64-bit ints per (prefix, position)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        bits = self.rng.getrandbits
        self.groups = [tuple(bits(64) for _ in range(args.shared)) for _ in range(args.groups)]
        # each group's prompts continue with one of ``--subs`` shared middles of ``--sub-blocks``
        self.subs = [
            [tuple(bits(64) for _ in range(args.sub_blocks)) for _ in range(args.subs)]
            for _ in range(args.groups)
        ]
        self.tail_len = args.prompt_blocks - args.shared - (args.sub_blocks if args.subs else 0)
        self.n = 0

    def fresh(self, n: int) -> list[int]:
        bits = self.rng.getrandbits
        return [bits(64) for _ in range(n)]

    def prompt(self, group: int) -> tuple[int, ...]:
        subs = self.subs[group]
        middle = subs[self.rng.randrange(len(subs))] if subs else ()
        return (*self.groups[group], *middle, *self.fresh(self.tail_len))

    def request(self, hashes: tuple[int, ...], now: float) -> RequestInfo:
        self.n += 1
        return RequestInfo(
            id=f"q{self.n}",
            block_hashes=hashes,
            prompt_tokens=len(hashes) * BLOCK + 7,
            arrival=now,
            block_size=BLOCK,
        )


def build(policy: PreblePolicy, b: Builder, engines: list[str], target: int) -> tuple[int, float]:
    """Route prompts until the tree holds ``target`` blocks; returns (requests, seconds)."""
    tree = policy.tree
    count = 0
    start = time.perf_counter()
    span = policy.config.window_s / 2  # every request stays within the window
    estimate = max(1, target // max(1, b.tail_len))
    while tree.num_blocks < target:
        group = count % len(b.groups)
        engine = engines[group % len(engines)]  # a group's requests go to its engine
        now = span * count / estimate
        req = b.request(b.prompt(group), now)
        policy.on_routed(req, Decision(engine=engine, expected_hit_tokens=0), now)
        policy.on_finished(req, engine, now, ok=False)  # drop the per-request state
        count += 1
    return count, time.perf_counter() - start


def main() -> int:
    ap = benchmark_parser(__doc__, "benchmarks.speed.radix_tree")
    ap.add_argument("--blocks", type=int, default=1_000_000, help="tree size to build")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--groups", type=int, default=64, help="shared prefixes")
    ap.add_argument("--shared", type=int, default=1280, help="blocks in each shared prefix")
    ap.add_argument("--subs", type=int, default=8, help="shared middles per prefix (0: none)")
    ap.add_argument("--sub-blocks", type=int, default=128, help="blocks in each middle")
    ap.add_argument("--prompt-blocks", type=int, default=2048, help="blocks per prompt")
    ap.add_argument("--decisions", type=int, default=4000)
    ap.add_argument("--conversations", type=int, default=8, help="deep-path conversations")
    ap.add_argument("--turn-blocks", type=int, default=16, help="blocks per conversation turn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-tracemalloc", action="store_true", help="skip the traced build")
    args = ap.parse_args()
    if args.shared + (args.sub_blocks if args.subs else 0) >= args.prompt_blocks:
        ap.error("--shared + --sub-blocks must be smaller than --prompt-blocks")
    perf = load_preset(DEFAULT_PRESET)
    engines = [f"e{i}" for i in range(args.engines)]
    ctx = PolicyContext(block_size=BLOCK, perf=perf)
    config = PrebleConfig(max_tree_blocks=max(args.blocks * 2, 1))

    # (c) insert throughput and RSS, untraced
    gc.collect()
    rss0 = rss_mib()
    policy = PreblePolicy(ctx, config)
    b = Builder(args)
    n_req, build_s = build(policy, b, engines, args.blocks)
    gc.collect()
    rss1 = rss_mib()
    tree = policy.tree
    blocks, nodes = tree.num_blocks, tree.num_nodes
    print(
        f"tree: {blocks} blocks in {nodes} nodes over {args.engines} engines, "
        f"{n_req} prompts of {args.prompt_blocks} blocks ({args.groups} shared prefixes "
        f"of {args.shared}, each with {args.subs} shared middles of {args.sub_blocks})"
    )
    print(
        f"insert (on_routed): {n_req / build_s:,.0f} prompts/s, "
        f"{n_req * args.prompt_blocks / build_s / 1e6:.2f} M prompt blocks/s, "
        f"{blocks / build_s / 1e6:.2f} M new blocks/s ({build_s:.1f} s)"
    )
    print(
        f"memory (RSS): {rss1 - rss0:.0f} MiB for the tree, "
        f"{(rss1 - rss0) / blocks * 1e6:.0f} MiB per million blocks "
        f"(includes the hash ints; RSS now {rss1:.0f} MiB)"
    )

    # (a) decision time: full hits, shared prefix + new tail, partial matches, misses
    now = config.window_s / 2
    view = ClusterView(tuple(EngineView(id=e) for e in engines))
    rng = random.Random(args.seed + 1)
    full: list[RequestInfo] = []
    for _ in range(64):  # a few dozen prompts routed for real, then asked again: full hits
        group = rng.randrange(args.groups)
        full.append(b.request(b.prompt(group), now))
        policy.on_routed(full[-1], Decision(engine=engines[group % len(engines)]), now)
    kinds: dict[str, list[RequestInfo]] = {
        "full hit": [],
        "prefix hit": [],
        "partial": [],
        "miss": [],
    }
    per_kind = max(1, args.decisions // len(kinds))
    cut = args.shared // 3
    for i in range(per_kind):
        group = rng.randrange(args.groups)
        kinds["full hit"].append(full[i % len(full)])
        kinds["prefix hit"].append(b.request(b.prompt(group), now))  # shared prefix, new tail
        partial = (*b.groups[group][:cut], *b.fresh(args.prompt_blocks - cut))
        kinds["partial"].append(b.request(partial, now))
        kinds["miss"].append(b.request(tuple(b.fresh(args.prompt_blocks)), now))
    mixed = [
        (name, r) for i in range(per_kind) for name, rs in kinds.items() for r in rs[i : i + 1]
    ]
    for _, r in mixed[:64]:  # warm up
        policy.decide(r, view, now)
    reasons: dict[str, int] = {}
    for _, r in mixed:
        reason = policy.decide(r, view, now).reason
        reasons[reason] = reasons.get(reason, 0) + 1
    decide_us: list[float] = []
    match_us: list[float] = []
    by_kind: dict[str, list[float]] = {name: [] for name in kinds}
    clock = time.perf_counter_ns
    decide, match = policy.decide, tree.match
    gc.collect()
    gc.disable()
    try:
        for name, r in mixed:
            t0 = clock()
            decide(r, view, now)
            t1 = clock()
            match(r.block_hashes)
            t2 = clock()
            decide_us.append((t1 - t0) / 1000.0)
            match_us.append((t2 - t1) / 1000.0)
            by_kind[name].append(decide_us[-1])
    finally:
        gc.enable()
    p50, p99 = pct(decide_us, 50), pct(decide_us, 99)
    print(
        f"decide, {args.prompt_blocks * BLOCK}-token prompt, {len(decide_us)} decisions: "
        f"p50 {p50:.1f} us, p99 {p99:.1f} us, max {max(decide_us):.1f} us "
        f"(target p99 <= {TARGET_P99_US:.0f} us: ratio {p99 / TARGET_P99_US:.2f})"
    )
    for name, xs in by_kind.items():
        print(f"  {name:<11} p50 {pct(xs, 50):7.1f} us  p99 {pct(xs, 99):7.1f} us")
    print(f"  reasons: {', '.join(f'{k} {v}' for k, v in sorted(reasons.items()))}")
    print(
        f"match alone: p50 {pct(match_us, 50):.1f} us, p99 {pct(match_us, 99):.1f} us, "
        f"max {max(match_us):.1f} us"
    )

    # (a2) deep paths: multi-turn conversations, one node per turn along a 32k-token prompt
    turns = args.prompt_blocks // args.turn_blocks
    for mode in ("one engine", "rotating"):
        convs = []
        for c in range(args.conversations):
            conv = tuple(b.fresh(args.prompt_blocks))
            convs.append(b.request(conv, now))
            for k in range(1, turns + 1):
                e = (
                    engines[c % len(engines)]
                    if mode == "one engine"
                    else engines[(c + k) % len(engines)]
                )
                policy.on_routed(
                    b.request(conv[: k * args.turn_blocks], now), Decision(engine=e), now
                )
        deep: list[float] = []
        gc.collect()
        gc.disable()
        try:
            for i in range(max(2000, args.decisions // 2)):
                r = convs[i % len(convs)]
                t0 = clock()
                decide(r, view, now)
                deep.append((clock() - t0) / 1000.0)
        finally:
            gc.enable()
        path = len(tree.match(convs[0].block_hashes).path)
        q99 = pct(deep, 99)
        print(
            f"decide, deep path ({path} nodes of {args.turn_blocks} blocks, {mode}): "
            f"p50 {pct(deep, 50):.1f} us, p99 {q99:.1f} us (ratio {q99 / TARGET_P99_US:.2f})"
        )

    # (b) memory per million blocks, traced (a second build of the same shape)
    if not args.no_tracemalloc:
        del policy, tree, b, kinds, mixed
        gc.collect()
        tracemalloc.start()
        before, _ = tracemalloc.get_traced_memory()
        policy = PreblePolicy(ctx, config)
        b = Builder(args)
        build(policy, b, engines, args.blocks)
        b.groups, b.subs = [], []  # the tree keeps its own references to the shared parts
        gc.collect()
        after, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        blocks, nodes = policy.tree.num_blocks, policy.tree.num_nodes
        used = (after - before) / 2**20
        print(
            f"memory (tracemalloc): {used:.0f} MiB for {blocks} blocks in {nodes} nodes: "
            f"{used / blocks * 1e6:.0f} MiB per million blocks, "
            f"{(after - before) / blocks:.0f} B per block (peak {(peak - before) / 2**20:.0f} MiB)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
