"""Fitting the engine model: known constants come back, degenerate inputs are handled."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from gateway.calibrate.fit import (
    DecodeSample,
    FitError,
    PrefillSample,
    fit_decode,
    fit_linear,
    fit_prefill,
    nnls,
)
from gateway.calibrate.probes import ProbePlan, TextSource
from gateway.calibrate.profile import ProfileSource, build_profile, write_profile
from gateway.cli import main
from gateway.core.errors import ConfigError
from gateway.emulator.tokenizer import FakeTokenizer
from gateway.perfmodel.presets import load_preset

PREFILL = {"prefill_a": 5.0, "prefill_b": 0.0325, "prefill_c": 4.9e-5, "prefill_d": 1.06e-6}
DECODE = {"decode_e0": 7.5, "decode_e1": 0.03, "decode_e2": 4.9e-5}


def prefill_ms(e: float, x: float, k: dict[str, float] = PREFILL) -> float:
    a, b, c, d = k.values()
    return a + b * e + c * x + d * e * x


def decode_ms(bs: float, ctx: float, k: dict[str, float] = DECODE) -> float:
    e0, e1, e2 = k.values()
    return e0 + e1 * bs + e2 * ctx


def prefill_samples(noise: float, seed: int = 1) -> list[PrefillSample]:
    rng = np.random.default_rng(seed)
    out = []
    grid = itertools.product((8, 128, 512, 2048, 4096, 7372), (0, 4096, 16384), range(3))
    for e, x, _ in grid:
        jitter = noise * (prefill_ms(e, x) + 5.0) * rng.standard_normal()  # relative + absolute
        ms = prefill_ms(e, x) + jitter
        out.append(PrefillSample(e, x, ms))
    return out


def decode_samples(noise: float, seed: int = 2) -> list[DecodeSample]:
    rng = np.random.default_rng(seed)
    out = []
    for bs, per_seq, _ in itertools.product((1, 2, 4, 8, 16), (40, 8192), range(3)):
        ctx = bs * per_seq
        out.append(DecodeSample(bs, ctx, decode_ms(bs, ctx) * (1 + noise * rng.standard_normal())))
    return out


def test_exact_data_gives_exact_constants() -> None:
    pre = fit_prefill(prefill_samples(0.0, seed=3))
    dec = fit_decode(decode_samples(0.0))
    for name, value in {**PREFILL, **DECODE}.items():
        got = {**pre.coefficients, **dec.coefficients}[name]
        assert got == pytest.approx(value, rel=1e-3, abs=1e-9), name
    assert pre.r2 == pytest.approx(1.0) and pre.max_rel_err < 0.01
    assert set(pre.fitted) == set(PREFILL) and set(dec.fitted) == set(DECODE)


def test_noisy_data_recovers_constants_within_tolerance() -> None:
    pre = fit_prefill(prefill_samples(0.01)).coefficients
    dec = fit_decode(decode_samples(0.005)).coefficients
    # 1% noise: the slopes that dominate the times come back tightly, the small terms looser
    assert pre["prefill_b"] == pytest.approx(PREFILL["prefill_b"], rel=0.03)
    assert pre["prefill_a"] == pytest.approx(PREFILL["prefill_a"], rel=0.15)
    assert pre["prefill_d"] == pytest.approx(PREFILL["prefill_d"], rel=0.1)
    assert abs(pre["prefill_c"] - PREFILL["prefill_c"]) * 16384 < 1.0  # < 1 ms at 16k context
    assert dec["decode_e0"] == pytest.approx(DECODE["decode_e0"], rel=0.03)
    assert dec["decode_e2"] == pytest.approx(DECODE["decode_e2"], rel=0.1)
    assert abs(dec["decode_e1"] - DECODE["decode_e1"]) * 16 < 0.2  # < 0.2 ms at batch 16


def test_nnls_clips_and_matches_kkt() -> None:
    rng = np.random.default_rng(5)
    a = rng.uniform(0.0, 1.0, size=(40, 4))
    y = a @ np.array([2.0, -1.0, 0.5, 0.0]) + 0.01 * rng.standard_normal(40)
    x = nnls(a, y)
    grad = a.T @ (a @ x - y)
    assert np.all(x >= 0) and x[1] == 0.0
    assert np.allclose(grad[x > 0], 0.0, atol=1e-8)  # stationary on the support
    assert np.all(grad[x == 0] >= -1e-8)  # no descent direction off it


def test_negative_trend_is_clipped_to_zero() -> None:
    samples = [
        PrefillSample(e, x, 20.0 + 0.05 * e - 0.001 * x)
        for e in (10, 500, 1000)
        for x in (0, 1000, 5000)
    ]
    fit = fit_prefill(samples)
    assert all(v >= 0 for v in fit.coefficients.values())
    assert fit.coefficients["prefill_c"] == 0.0 and fit.coefficients["prefill_b"] > 0.04


def test_degenerate_inputs() -> None:
    with pytest.raises(FitError, match="no samples"):
        fit_prefill([])
    with pytest.raises(FitError, match="finite"):
        fit_decode([DecodeSample(1, 10, float("nan"))])
    with pytest.raises(FitError, match="zero or negative"):
        fit_decode([DecodeSample(1, 10, -1.0), DecodeSample(2, 10, 0.0)])
    one = fit_decode([DecodeSample(4, 100, 9.0)], fallback=DECODE)
    assert one.fitted == ("decode_e0",) and one.r2 is None
    assert one.coefficients["decode_e1"] == DECODE["decode_e1"]
    assert decode_ms(4, 100, dict(one.coefficients)) == pytest.approx(9.0)
    # every prompt the same size and nothing cached: only the intercept is identifiable
    same = [PrefillSample(1000, 0, ms) for ms in (40.0, 41.0, 39.5)]
    fit = fit_prefill(same, fallback=PREFILL)
    assert fit.fitted == ("prefill_a",) and set(fit.kept) == {"prefill_b", "prefill_c", "prefill_d"}
    assert prefill_ms(1000, 0, dict(fit.coefficients)) == pytest.approx(40.0, abs=1.0)
    # collinear columns: ctx always 4x extend makes c indistinguishable from b
    collinear = [PrefillSample(e, 4 * e, 5 + 0.1 * e) for e in (100, 200, 400, 800)]
    assert "prefill_c" not in fit_prefill(collinear).fitted
    with pytest.raises(ValueError, match="do not match"):
        fit_linear(np.zeros((2, 3)), np.ones(3), ("a", "b", "c"), {})


def test_plan_spans_small_to_max_batched_tokens() -> None:
    plan = ProbePlan.default(8192, 131072, repeats=3)
    assert plan.cold[0] == 8 and 0.85 * 8192 < plan.cold[-1] <= 8192
    assert plan.prefixes == (4096, 16384) and max(plan.extends) <= 8192
    assert [k for _, ks in plan.decode_prompts for k in ks] == [1, 2, 4, 8, 16, 1, 4]
    small = ProbePlan.default(2048, 4096, repeats=1)  # nothing may exceed the context limit
    assert all(p + max(small.extends) <= 4096 for p in small.prefixes)
    kinds = [p.kind for p in plan.round()]
    assert kinds.count("cold") == 6 and kinds.count("cached") == 6 and kinds.count("decode") == 7


def test_prefix_text_tokenizes_to_a_prefix() -> None:
    import random

    text = TextSource(random.Random(0))
    tok = FakeTokenizer()
    prefix = text.prefix(1000)
    full = prefix + text.extension(300)
    assert not prefix.endswith(" ") and len(prefix) % 4 == 0
    assert tok.encode(full)[: len(tok.encode(prefix))] == tok.encode(prefix)
    assert abs(len(tok.encode(full)) - 1300) <= 2
    assert text.words(50) != text.words(50)


def test_profile_loads_as_a_preset_and_simulates(tmp_path: Path) -> None:
    base = load_preset("llama3-8b-h100")
    pre = fit_prefill(prefill_samples(0.0))
    dec = fit_decode(decode_samples(0.0))
    source = ProfileSource(
        "http://gpu:8000", "m", datetime(2025, 1, 2, tzinfo=UTC), 90, 3, 60.0, 1.5
    )
    path = tmp_path / "gpu.yaml"
    profile = build_profile(base, pre, dec, source, name="gpu", engine={"max_model_len": 32768})
    write_profile(path, profile)
    model = load_preset(str(path))
    assert model.name == "gpu" and model.max_model_len == 32768
    assert model.prefill_b == pytest.approx(PREFILL["prefill_b"], rel=1e-3)
    assert model.kv_capacity_blocks == base.kv_capacity_blocks
    assert "http://gpu:8000" in model.description and any("R²" in s for s in model.sources)
    out = tmp_path / "sim"
    argv = ["simulate", "--workload", "gen:no_sharing?n=30&rate=5", "--preset", str(path)]
    assert main([*argv, "--policies", "round_robin", "--instances", "2", "--no-plots",
                 "--quiet", "--out", str(out)]) == 0  # fmt: skip
    assert (out / "results.json").is_file()


def test_write_profile_rejects_bad_values(tmp_path: Path) -> None:
    base = load_preset("llama3-8b-h100")
    pre = fit_prefill(prefill_samples(0.0))
    dec = fit_decode(decode_samples(0.0))
    source = ProfileSource("http://x", "m", datetime(2025, 1, 2, tzinfo=UTC), 1, 1, 1.0, 1.0)
    profile = build_profile(base, pre, dec, source, name="bad", engine={"block_size": 0})
    with pytest.raises(ConfigError, match="block_size"):
        write_profile(tmp_path / "bad.yaml", profile)
    assert not (tmp_path / "bad.yaml").exists()
