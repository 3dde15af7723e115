"""The simulator's P/D mode follows the P/D rule: long cold prompts run their prefill leg on
the prefill pool unless it is saturated, for the default policy and for cost_model."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.config import PolicyConfig
from gateway.perfmodel.presets import load_preset
from gateway.policies.pd_rule import PDSettings
from gateway.sim.loop import ClusterSpec
from gateway.sim.runner import run_policy
from gateway.sim.workloads import Workload, WorkloadRequest

PERF = load_preset("mistral-7b-a6000")


def cold(n: int, gap: float, tokens: int = 3000) -> Workload:
    reqs = tuple(
        WorkloadRequest(
            id=f"r{i}",
            arrival=i * gap,
            prompt_tokens=tokens,
            output_tokens=8,
            block_hashes=tuple(range(i * 1000, i * 1000 + tokens // 16)),
        )
        for i in range(n)
    )
    return Workload(name="cold", requests=reqs, block_size=16)


@pytest.mark.parametrize("policy", sorted({PolicyConfig().name, "cost_model", "round_robin"}))
def test_long_cold_prompts_use_the_prefill_pool_when_it_is_not_saturated(policy: str) -> None:
    run = run_policy(policy, cold(12, gap=1.0), ClusterSpec(4, PERF, prefill_instances=2))
    assert {r.pd_reason for r in run.records} == {"remote_long"}
    assert all(r.prefill_engine in {"sim-0", "sim-1"} for r in run.records)
    assert all(r.engine in {"sim-2", "sim-3"} and r.finish_time for r in run.records)


@pytest.mark.parametrize("policy", sorted({PolicyConfig().name, "cost_model"}))
def test_a_burst_past_the_pool_s_wait_threshold_prefills_the_rest_locally(policy: str) -> None:
    """40 cold prompts at once: 2 prefill engines queue 0.33 s of prefill per prompt, so once
    about three are queued on each the pool's predicted wait passes 1 s."""
    run = run_policy(policy, cold(40, gap=0.0), ClusterSpec(4, PERF, prefill_instances=2))
    reasons = Counter(r.pd_reason for r in run.records)
    assert reasons["local_saturated"] >= 10 and reasons["remote_long"] >= 6
    patient = ClusterSpec(4, PERF, prefill_instances=2, pd=PDSettings(saturation_wait_s=60))
    relaxed = run_policy(policy, cold(40, gap=0.0), patient)
    assert {r.pd_reason for r in relaxed.records} == {"remote_long"}


PAIR_MODE = ("cache_aware", "dualmap", "least_loaded", "power_of_two", "round_robin")


@pytest.mark.parametrize(
    "policy",
    sorted({PolicyConfig().name, "cost_model", "weighted_scorer", "length_heuristic", *PAIR_MODE}),
)
def test_sequential_cold_prompts_use_both_decode_engines(policy: str) -> None:
    """Issue 21's sequence: eight cold ~3,000-token prompts one after another (each done
    before the next) on 2 prefill + 2 decode engines: no reuse pays on a decode engine,
    so the decode legs split 4/4 (3/5 at worst), and so do the prefill legs."""
    run = run_policy(policy, cold(8, gap=10.0), ClusterSpec(4, PERF, prefill_instances=2))
    decode = Counter(r.engine for r in run.records)
    prefill = Counter(r.prefill_engine for r in run.records)
    assert set(decode) == {"sim-2", "sim-3"} and min(decode.values()) >= 3, decode
    if policy in {
        PolicyConfig().name,
        "cost_model",
        "least_loaded",
        "round_robin",
        "length_heuristic",
    }:
        assert set(prefill) == {"sim-0", "sim-1"} and min(prefill.values()) >= 3, prefill
