"""The live routing benchmark's own pieces: prompt texts, capacity, KV check, one tiny run."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
from pathlib import Path

import httpx
import pytest

from benchmarks.live import routing as live_routing
from benchmarks.live.cluster import EngineSpec, scrape, start_engines
from benchmarks.live.run import _probe
from benchmarks.live.workloads import (
    SharedPrefixShape,
    no_reuse_capacity,
    shared_prefix_requests,
    trace_requests,
    unique_requests,
)
from gateway.emulator.tokenizer import FakeTokenizer
from gateway.perfmodel.presets import load_preset
from gateway.sim.workloads import WorkloadOptions, load_workload

TOKENIZER = FakeTokenizer()  # the emulator's


def common_prefix(a: str | list[int], b: str | list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_prompts_have_exact_sizes_and_share_only_their_system_prompt() -> None:
    shape = SharedPrefixShape()
    shared = shared_prefix_requests(shape, 4000, rate=10.0, seed=3)
    unique = unique_requests(shape, 40, rate=10.0, seed=3)
    tokens = [TOKENIZER.encode(r.prompt) for r in [*shared[:40], *unique]]
    assert {len(t) for t in tokens} == {shape.prompt_tokens}
    system = 1 + shape.system_tokens  # BOS + the system prompt
    for a, b in itertools.combinations(tokens[:40], 2):
        n = common_prefix(a, b)
        assert n < 16 or system <= n < system + 8  # another prompt, or the same one
    for a, b in itertools.combinations(tokens[40:], 2):
        assert common_prefix(a, b) < 16  # unique prompts share no block
    heads = [r.prompt[: 4 * shape.system_tokens] for r in shared]
    counts = sorted((heads.count(h) for h in set(heads)), reverse=True)
    assert len(counts) == shape.prefixes
    assert counts[0] / len(shared) == pytest.approx(1 / sum(1 / k for k in range(1, 9)), abs=0.03)
    gaps = [b.arrival - a.arrival for a, b in itertools.pairwise(shared)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.05)  # Poisson at rate 10


def test_trace_text_shares_exactly_the_blocks_the_trace_shares() -> None:
    spec = "gen:chat?n=40"
    source = load_workload(spec, WorkloadOptions(block_size=16, seed=0)).requests
    replay = trace_requests(spec, 40, seed=0)
    assert [r.output_tokens for r in replay.requests] == [r.output_tokens for r in source]
    tokens = [TOKENIZER.encode(r.prompt) for r in replay.requests]
    assert [len(t) for t in tokens] == [s.prompt_tokens for s in source]
    continued = 0
    for (ta, sa), (tb, sb) in itertools.combinations(zip(tokens, source, strict=True), 2):
        blocks = common_prefix(list(sa.block_hashes), list(sb.block_hashes))
        assert common_prefix(ta, tb) // 16 == blocks  # the engine's shared 16-token blocks
        continued += blocks > 32  # more than the 512-token system block: a continuation
    assert continued > 0


def test_no_reuse_capacity_is_bound_by_the_kv_cache() -> None:
    small = load_preset("llama3-8b-h100").with_overrides(kv_capacity_blocks=300)
    prompt, out = 1601, 32
    alone = small.prefill_time(prompt) + sum(  # first token from prefill, then 31 steps
        small.decode_step_time(1, prompt + k) for k in range(out - 1)
    )
    assert no_reuse_capacity(small, [(prompt, out)]) == pytest.approx(1 / alone, rel=1e-6)
    # 300 blocks hold two requests of 103 blocks, not three: between 1 and 2 at a time
    many = [(prompt, out)] * 128
    assert 1 / alone < no_reuse_capacity(small, many) <= 2 / alone
    big = small.with_overrides(kv_capacity_blocks=25_000)
    assert no_reuse_capacity(big, many) > 2 / alone


@pytest.mark.e2e
def test_kv_probe_tells_300_blocks_from_400(tmp_path: Path) -> None:
    results = {}
    for blocks, served in ((300, 10), (400, 11)):
        spec = EngineSpec("llama3-8b-h100", time_scale=0.02, kv_blocks=blocks)
        (engine,) = start_engines(tmp_path / str(blocks), 1, spec)
        try:

            async def probe(url: str = engine.url) -> str:
                async with httpx.AsyncClient(timeout=30.0) as client:
                    return await _probe(client, url, 300, 16)

            results[blocks] = asyncio.run(probe())
            (counts,) = scrape([engine.url])
        finally:
            engine.stop()
        assert counts.gpu_blocks == blocks
        assert counts.finished == served  # 300 blocks: the 4,801-token request is refused
        assert 0 < counts.hits < counts.queries
    assert results[300] == ""
    assert "4800-token request -> 200, one more -> 200" in results[400]  # admitted: too big
    assert "kept 1264 after 2 others, 1264 after 3" in results[400]  # nothing evicted


@pytest.mark.e2e
@pytest.mark.slow
def test_a_tiny_run_measures_hits_shares_and_targets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rows.json"
    args = ["--policies", "round_robin", "--workloads", "shared", "--engines", "2"]
    args += ["--shared-requests", "40", "--time-scale", "0.2", "--json", str(out)]
    assert live_routing.main(args) == 0
    text = capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    assert row["router"] == "round_robin" and row["sent"] == 40 and row["errors"] == 0
    assert row["shares"] == [0.5, 0.5]  # round robin, as the engines counted it
    assert 0.2 < row["hit_rate"] < 1  # repeated system prompts hit on both engines
    assert row["ttft_p50_ms"] > 0 and row["engine_ttft_mean_ms"] > 0
    hot = row["hot_prefix"]  # the hottest prompt's requests per engine, from kvgate's header
    assert len(hot) == 2 and 10 < sum(hot.values()) < 30
    assert "KV ok on 2 engines" in text
    assert "| round_robin |" in text
    assert "shared busiest engine" in text and "pass  round_robin" in text
    now = re.search(r"load average now (\d+\.\d\d) (\d+\.\d\d) (\d+\.\d\d) \((\d+) CPUs\)", text)
    assert now and int(now[4]) == os.cpu_count()  # the machine's load when done, and its CPUs
    assert row["load1"] >= 0 and f"load {row['load1']:.1f}, CPU s" in text  # each run's, at start
