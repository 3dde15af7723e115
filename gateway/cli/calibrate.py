"""``kvgate calibrate``: fit the engine performance model to a live OpenAI-compatible engine."""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from gateway.calibrate.client import EngineClient
from gateway.calibrate.fit import (
    DECODE_TERMS,
    PREFILL_TERMS,
    FitError,
    FitResult,
    fit_decode,
    fit_prefill,
)
from gateway.calibrate.frontend import engine_clock_agrees, fit_frontend, fit_wake
from gateway.calibrate.probes import Measurements, ProbePlan, Runner, Say
from gateway.calibrate.profile import Extras, ProfileSource, build_profile, write_profile
from gateway.core.errors import ConfigError
from gateway.perfmodel.model import PerfModel
from gateway.perfmodel.presets import DEFAULT_PRESET, load_preset


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "calibrate",
        help="measure a live engine and write a performance profile (--preset FILE)",
        description=(
            "Send a designed set of probes (cold and cached prefills, concurrent decodes) to an "
            "OpenAI-compatible engine such as vLLM, fit the prefill and decode constants of the "
            "engine model by least squares and write them as a preset file for "
            "`kvgate simulate --preset` and `kvgate emulate --preset`."
        ),
    )
    p.add_argument("--target", required=True, metavar="URL", help="engine base URL")
    p.add_argument("--out", required=True, metavar="FILE", help="profile to write (.yaml)")
    p.add_argument("--model", default=None, metavar="NAME", help="model (default: first served)")
    p.add_argument(
        "--base-preset",
        default=DEFAULT_PRESET,
        metavar="NAME|FILE",
        help=f"preset giving the fields not measured (default {DEFAULT_PRESET})",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=300.0,
        metavar="N",
        help="time budget; later rounds are skipped when it runs out (default 300)",
    )
    p.add_argument(
        "--repeats", type=int, default=3, metavar="N", help="rounds of probes (default 3)"
    )
    p.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        metavar="N",
        help="the engine's max_num_batched_tokens (default: the base preset's)",
    )
    p.add_argument("--api-key", default=None, metavar="KEY", help="bearer token for the engine")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(handler=run)


def _check_args(args: argparse.Namespace) -> Path:
    url = urlparse(args.target)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise ConfigError(f"--target must be an http(s) URL, got {args.target!r}")
    if not args.max_seconds > 0:
        raise ConfigError(f"--max-seconds must be positive, got {args.max_seconds}")
    for flag in ("repeats", "max_batched_tokens"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    out = Path(args.out)
    if out.suffix not in (".yaml", ".yml"):
        raise ConfigError(f"--out must name a .yaml or .yml file, got {args.out!r}")
    if not out.parent.is_dir():
        raise ConfigError(f"--out directory does not exist: {out.parent}")
    return out


async def measure(args: argparse.Namespace, base: PerfModel, say: Say) -> Measurements:
    """Discover the engine, then run the default probe plan against it."""
    async with EngineClient(args.target, api_key=args.api_key) as client:
        facts = await client.discover(args.model)
        max_len = facts.max_model_len or base.max_model_len
        batched = min(args.max_batched_tokens or base.max_num_batched_tokens, max_len)
        say(
            f"target {client.base_url}: model {facts.model}, max_model_len {max_len}, "
            f"probing prompts up to {batched} tokens"
        )
        plan = ProbePlan.default(batched, max_len, args.repeats)
        block = facts.block_size or base.block_size
        runner = Runner(client, plan, facts, block_size=block, budget_s=args.max_seconds, say=say)
        return await runner.run()


def _fit(kind: str, fit: Any, samples: Any, fallback: dict[str, float]) -> FitResult:
    try:
        result: FitResult = fit(samples, fallback)
    except FitError as exc:
        raise ConfigError(f"no usable {kind} measurements ({exc}); raise --max-seconds") from None
    return result


def run(args: argparse.Namespace) -> int:
    out = _check_args(args)
    base = load_preset(args.base_preset)

    def say(message: str) -> None:
        if not args.quiet:
            print(f"calibrate: {message}", file=sys.stderr, flush=True)

    when = datetime.now(UTC)
    got = asyncio.run(measure(args, base, say))
    fallback = {term: float(getattr(base, term)) for term in (*PREFILL_TERMS, *DECODE_TERMS)}
    # with the engine's own latencies on our clock, prefill is what the engine measured and
    # the rest of the client's time is the frontend term; otherwise client TTFT minus floor
    engine_side = engine_clock_agrees(got.frontend) and bool(got.prefill_engine)
    prefill_samples = got.prefill_engine if engine_side else got.prefill
    prefill = _fit("prefill", fit_prefill, prefill_samples, fallback)
    decode = _fit("decode", fit_decode, got.decode, fallback)
    frontend = fit_frontend(got.frontend, got.http_floor_ms)
    wake = fit_wake(got.wake, base.idle_after_s)
    engine: dict[str, int] = {}
    if got.facts.max_model_len:
        engine["max_model_len"] = got.facts.max_model_len
    if got.facts.block_size and got.facts.num_gpu_blocks:
        engine["block_size"] = got.facts.block_size
        engine["kv_capacity_blocks"] = got.facts.num_gpu_blocks
    if args.max_batched_tokens:
        engine["max_num_batched_tokens"] = args.max_batched_tokens
    source = ProfileSource(
        target=args.target,
        model=got.facts.model,
        when=when,
        requests=got.requests,
        rounds=got.rounds,
        elapsed_s=got.elapsed_s,
        http_floor_ms=got.http_floor_ms,
        stopped_early=got.stopped_early,
    )
    extra = Extras(frontend, wake, engine_side)
    profile = build_profile(
        base, prefill, decode, source, name=out.stem, engine=engine, extras=extra
    )
    write_profile(out, profile)
    print(summary(base, prefill, decode, got))
    print(extra.describe())
    print(f"wrote {out} (use it as --preset {out})")
    return 0


def summary(base: PerfModel, prefill: FitResult, decode: FitResult, got: Measurements) -> str:
    """A table of base vs fitted constants and one quality line per fit."""
    lines = [f"{'term':<10} {'base':>12} {'calibrated':>12}"]
    for fit in (prefill, decode):
        for term, value in fit.coefficients.items():
            note = "" if term in fit.fitted else "  (not identifiable: base value kept)"
            lines.append(f"{term:<10} {getattr(base, term):>12.6g} {value:>12.6g}{note}")
    lines.append(f"prefill fit: {prefill.quality()}")
    lines.append(f"decode fit:  {decode.quality()}")
    early = ", stopped by --max-seconds" if got.stopped_early else ""
    lines.append(
        f"{got.requests} requests, {got.rounds} complete round(s) in {got.elapsed_s:.0f} s"
        f"{early}; HTTP floor {got.http_floor_ms:.2f} ms"
    )
    return "\n".join(lines)
