"""Built-in presets: each loads, cites its sources, and its KV figures follow from them."""

from __future__ import annotations

import pytest

from gateway.perfmodel.presets import available_presets, load_preset


@pytest.mark.parametrize("name", available_presets())
def test_every_preset_loads_and_cites_sources(name: str) -> None:
    perf = load_preset(name)
    assert perf.name == name
    assert perf.sources and perf.description


def test_qwen_on_h100_kv_figures() -> None:
    perf = load_preset("qwen2.5-7b-h100")
    layers, kv_heads, head_dim, bf16 = 28, 4, 128, 2
    assert perf.kv_bytes_per_token == 2 * layers * kv_heads * head_dim * bf16 == 57_344
    assert perf.kv_capacity_tokens == pytest.approx(0.9e6, rel=0.02)
    # the KV budget is what an 80 GB GPU has left at vLLM's 0.9 utilisation after the weights
    kv_bytes = perf.kv_capacity_tokens * perf.kv_bytes_per_token
    weights = 7.61e9 * bf16
    assert 80e9 * 0.9 - weights - 8e9 < kv_bytes < 80e9 * 0.9 - weights
    assert (perf.max_num_batched_tokens, perf.max_num_seqs) == (8192, 1024)
    # GQA: 2.2x the tokens of Llama-3.1-8B's KV on the same GPU
    llama = load_preset("llama3-8b-h100")
    assert perf.kv_capacity_tokens / llama.kv_capacity_tokens == pytest.approx(2.24, rel=0.05)
    # decode reads the weights once per step: 15.2 GB at ~80 % of 3.35 TB/s
    assert perf.decode_e0 == pytest.approx(weights / (0.8 * 3.35e12) * 1e3 + 1.5, rel=0.05)
