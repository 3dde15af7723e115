"""LoRA adapters in the engine model: vLLM's slot rule, the adapter caches, load time."""

from __future__ import annotations

import pytest

from gateway.core.blocks import hashes_from_tokens, partition_seed
from gateway.perfmodel.engine import EngineCore, EngineRequest
from gateway.perfmodel.lora import AdapterCache, LoraInfo
from gateway.perfmodel.model import PerfModel
from tests.perfmodel.test_engine import make_model

LOAD, ACTIVATE = 0.5, 0.125


def lora_model(**overrides: object) -> PerfModel:
    base: dict[str, object] = {
        "max_num_batched_tokens": 256,
        "max_num_seqs": 16,
        "kv_capacity_blocks": 400,
        "max_loras": 2,
        "lora_load_s": LOAD,
        "lora_activate_s": ACTIVATE,
    }
    base.update(overrides)
    return make_model(**base)


def request(rid: str, lora: str = "", *, prompt: int = 20, output: int = 4) -> EngineRequest:
    tokens = list(range(prompt))
    seed = partition_seed(0, lora=lora)
    return EngineRequest(
        id=rid,
        prompt_tokens=prompt,
        block_hashes=hashes_from_tokens(tokens, 4, seed=seed),
        output_tokens=output,
        arrival=0.0,
        lora=lora,
    )


def drive(core: EngineCore, now: float = 0.0) -> list[frozenset[str]]:
    """Step until idle; the distinct adapters of the running batch at every step."""
    batches = []
    while core.has_work:
        end = core.start_step(now)
        assert end is not None
        batches.append(core.lora_info.running)
        core.finish_step()
        now = end
    return batches


def test_the_running_batch_never_holds_more_than_max_loras_adapters() -> None:
    core = EngineCore("e", lora_model(max_loras=2), max_decode_run=1)
    reqs = [request(f"r{i}", f"a{i % 5}", output=3 + i % 4) for i in range(20)]
    for r in reqs:
        core.submit(r)
    batches = drive(core)
    assert max(len(b) for b in batches) == 2
    assert all(r.finish_time is not None for r in reqs)  # nobody starves


def test_a_blocked_adapter_request_is_skipped_and_the_ones_behind_it_run() -> None:
    core = EngineCore("e", lora_model(max_loras=1), max_decode_run=1)
    first, blocked, base, same = (
        request("first", "a"),
        request("blocked", "b"),
        request("base"),
        request("same", "a"),
    )
    for r in (first, blocked, base, same):
        core.submit(r)
    core.start_step(0.0)
    assert [r.id for r in core.running] == ["first", "base", "same"]
    assert [r.id for r in core.waiting] == ["blocked"]  # back at the head, not lost
    assert core.lora_info == LoraInfo(frozenset({"a"}), frozenset({"b"}), 1)


def test_skipped_requests_go_back_to_the_head_in_their_order() -> None:
    core = EngineCore("e", lora_model(max_loras=1), max_decode_run=1)
    core.submit(request("run", "a", output=50))
    core.start_step(0.0)
    core.finish_step()
    for rid, lora in (("b1", "b"), ("c1", "c"), ("b2", "b")):
        core.submit(request(rid, lora))
    core.start_step(1.0)
    assert [r.id for r in core.waiting] == ["b1", "c1", "b2"]


def test_load_time_is_charged_once_per_adapter_that_is_not_resident() -> None:
    model = lora_model(max_loras=2)
    core = EngineCore("e", model, max_decode_run=1)
    core.submit(request("a1", "a"))
    assert core.start_step(0.0) == pytest.approx(model.prefill_time(20) + LOAD + ACTIVATE)
    core.finish_step()
    drive(core, 0.1)
    core.submit(request("a2", "a", prompt=40))  # resident: no load
    core.submit(request("base", prompt=40))  # another partition: no hit on a's blocks
    end = core.start_step(10.0)
    assert end == pytest.approx(10.0 + model.step_time([(20, 20), (40, 0)], 0, 0))
    core.finish_step()
    drive(core, 11.0)
    assert (core.adapters.loads, core.adapters.activations) == (1, 1)


def test_two_new_adapters_in_one_step_pay_two_loads() -> None:
    model = lora_model(max_loras=2)
    core = EngineCore("e", model, max_decode_run=1)
    core.submit(request("a", "a"))
    core.submit(request("b", "b"))
    end = core.start_step(0.0)
    assert end == pytest.approx(model.step_time([(20, 0), (20, 0)], 0, 0) + 2 * (LOAD + ACTIVATE))


def test_gpu_slots_and_cpu_cache_are_lru() -> None:
    cache = AdapterCache(max_loras=2, max_cpu_loras=3, load_s=LOAD, activate_s=ACTIVATE)
    assert cache.activate(["a", "b"]) == pytest.approx(2 * (LOAD + ACTIVATE))
    assert cache.activate(["a"]) == 0.0  # a is now the most recently used
    assert cache.activate(["c"]) == pytest.approx(LOAD + ACTIVATE)
    assert cache.gpu_resident == ("a", "c")  # b, the least recently used, left its slot
    assert cache.cpu_resident == ("b", "a", "c")
    assert cache.activate(["b"]) == pytest.approx(ACTIVATE)  # from CPU: a slot copy only
    assert cache.gpu_resident == ("c", "b")
    assert cache.activate(["d"]) == pytest.approx(LOAD + ACTIVATE)
    assert cache.cpu_resident == ("c", "b", "d")  # a dropped from the CPU cache


def test_base_traffic_is_unchanged_by_the_lora_parameters() -> None:
    def finishes(model: PerfModel) -> list[tuple[float | None, float | None]]:
        core = EngineCore("e", model)
        reqs = [request(f"r{i}", prompt=20 + 8 * i, output=5 + i) for i in range(12)]
        for r in reqs:
            core.submit(r)
        drive(core)
        return [(r.first_token_time, r.finish_time) for r in reqs]

    plain = make_model(max_num_batched_tokens=256, max_num_seqs=16, kv_capacity_blocks=400)
    assert finishes(plain) == finishes(lora_model(max_loras=1, lora_load_s=9.0))


def test_decode_runs_stay_exact_while_adapter_requests_wait_for_a_slot() -> None:
    def finishes(max_decode_run: int) -> list[float | None]:
        core = EngineCore("e", lora_model(max_loras=1), max_decode_run=max_decode_run)
        reqs = [request("a", "a", output=40), request("b", "b", output=6)]
        for r in reqs:
            core.submit(r)
        steps = 0
        now = 0.0
        while core.has_work:
            end = core.start_step(now)
            assert end is not None
            core.finish_step()
            now, steps = end, steps + 1
        assert (steps < 20) == (max_decode_run > 1)  # the wait ran as one decode run
        return [r.finish_time for r in reqs]

    assert finishes(256) == pytest.approx(finishes(1))


def test_model_validates_the_lora_parameters() -> None:
    with pytest.raises(ValueError, match="max_loras"):
        lora_model(max_loras=0)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        lora_model(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="lora_load_s"):
        lora_model(lora_load_s=-1.0)
