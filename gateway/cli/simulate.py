"""``kvgate simulate``: compare routing policies on a workload in the simulator."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from gateway.config import DEFAULT_POLICY
from gateway.config_flow import FlowControlConfig
from gateway.core.errors import ConfigError
from gateway.perfmodel.model import PerfModel
from gateway.perfmodel.presets import DEFAULT_PRESET, load_preset
from gateway.policies.registry import POLICIES, create_policy
from gateway.sim.bound import attach_bound
from gateway.sim.loop import ClusterSpec
from gateway.sim.plots import plots_available, write_plots
from gateway.sim.report import render_console, write_report, write_results
from gateway.sim.runner import SimulateOptions, simulate
from gateway.sim.workloads import Workload, WorkloadOptions, builtin_slo_classes, load_workload

DEFAULT_POLICIES = ",".join(
    dict.fromkeys(
        (DEFAULT_POLICY, "round_robin", "least_loaded", "power_of_two", "cache_aware", "kv_cost")
    )
)
"""The default policy first, then the baselines it is measured against."""


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "simulate",
        help="compare routing policies on a workload in the discrete-event simulator",
        description=(
            "Replay a trace or generated workload on N simulated vLLM engines under each "
            "policy; write results.json, report.md and PNG plots to --out."
        ),
    )
    add_workload_args(p)
    p.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        metavar="P1,P2,...",
        help=f"policies to compare (known: {', '.join(POLICIES)})",
    )
    p.add_argument("--instances", type=int, default=8, metavar="N", help="engines (default 8)")
    p.add_argument(
        "--rate-scale", type=float, default=1.0, metavar="X", help="multiply the arrival rate by X"
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        metavar="N",
        help="engine block size in tokens (default: the preset's, usually 16)",
    )
    p.add_argument(
        "--capacity",
        action="store_true",
        help="also search each policy's effective request capacity",
    )
    p.add_argument(
        "--prefill-instances",
        type=int,
        default=0,
        metavar="K",
        help="disaggregated serving: the first K instances prefill, the rest decode",
    )
    p.add_argument(
        "--kv-bandwidth",
        type=float,
        default=25.0,
        metavar="GBPS",
        help="KV transfer bandwidth between prefill and decode instances (default 25 GB/s)",
    )
    p.add_argument(
        "--priority-groups",
        action="store_true",
        help="engines use Preble's local priority groups instead of FCFS",
    )
    p.add_argument(
        "--no-timing",
        action="store_true",
        help="do not measure decision time (results become byte-identical per seed)",
    )
    p.add_argument(
        "--hide-adapters",
        action="store_true",
        help="policies see no LoRA adapter residency (as a gateway that does not read "
        "vllm:lora_requests_info): the adapter filter keeps every engine",
    )
    p.add_argument(
        "--flow-control",
        default=None,
        metavar="on|FILE",
        help="flow control in front of the policy, as kvgate serve runs it: 'on' (its "
        "defaults) or a kvgate YAML config whose flow_control: section is used (default off)",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument(
        "--out", default="kvgate-sim", metavar="DIR", help="output directory (default ./kvgate-sim)"
    )
    p.set_defaults(handler=run)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The flags ``simulate`` and ``plan`` share: workload, SLO, preset, knobs, seed, quiet."""
    p.add_argument(
        "--workload",
        required=True,
        metavar="SPEC",
        help="mooncake:PATH, recorded:PATH, azure:PATH or gen:NAME[?key=value&...]",
    )
    p.add_argument(
        "--preset",
        default=DEFAULT_PRESET,
        metavar="NAME|FILE",
        help=f"engine performance preset or calibrated profile (default {DEFAULT_PRESET})",
    )
    p.add_argument(
        "--limit", type=int, default=None, metavar="N", help="use only the first N requests"
    )
    p.add_argument(
        "--ttft-slo",
        type=float,
        default=5.0,
        metavar="SEC",
        help="TTFT target of the 'standard' SLO class (default 5)",
    )
    p.add_argument(
        "--tpot-slo",
        type=float,
        default=0.1,
        metavar="SEC",
        help="TPOT target of the 'standard' SLO class (default 0.1)",
    )
    p.add_argument(
        "--policy-option",
        action="append",
        default=[],
        metavar="POLICY.KEY=VALUE",
        help="set a policy knob, e.g. cache_aware.cache_threshold=0.5",
    )
    p.add_argument(
        "--max-loras",
        type=int,
        default=None,
        metavar="N",
        help="LoRA adapters one engine batches at once, vLLM's --max-loras (default: the "
        "preset's, 1)",
    )
    p.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        metavar="N",
        help="adapters an engine keeps in its CPU cache (default: the preset's, 0 = max-loras)",
    )
    p.add_argument(
        "--lora-load-s",
        type=float,
        default=None,
        metavar="SEC",
        help="seconds a step takes longer per adapter read from disk (default: the preset's)",
    )
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def apply_lora_args(perf: PerfModel, args: argparse.Namespace) -> PerfModel:
    """The preset with ``--max-loras``, ``--max-cpu-loras`` and ``--lora-load-s`` applied."""
    changes: dict[str, Any] = {
        field: value
        for field, value in (
            ("max_loras", args.max_loras),
            ("max_cpu_loras", args.max_cpu_loras),
            ("lora_load_s", args.lora_load_s),
        )
        if value is not None
    }
    if not changes:
        return perf
    try:
        return perf.with_overrides(**changes)
    except ValueError as exc:
        flags = str(exc).split(" in preset")[0].replace("_", "-")
        raise ConfigError(f"--{flags}") from None


def check_policy_names(names: list[str]) -> None:
    """Known policies, each once (``--policies``)."""
    unknown = [p for p in names if p not in POLICIES]
    if unknown:
        raise ConfigError(f"unknown policy {unknown[0]!r} (known: {', '.join(POLICIES)})")
    if len(set(names)) != len(names):
        raise ConfigError("--policies lists a policy twice")


def progress_printer(quiet: bool) -> Callable[[str], None]:
    """Progress lines on stderr unless ``quiet``."""

    def say(message: str) -> None:
        if not quiet:
            print(message, file=sys.stderr, flush=True)

    return say


def load_cli_workload(
    args: argparse.Namespace, block_size: int, rate_scale: float = 1.0
) -> Workload:
    """The ``--workload`` with the shared flags' limit, seed and SLO classes."""
    options = WorkloadOptions(
        block_size=block_size,
        seed=args.seed,
        limit=args.limit,
        rate_scale=rate_scale,
        slo_classes=builtin_slo_classes(args.ttft_slo, args.tpot_slo),
    )
    return load_workload(args.workload, options)


def workload_line(spec: str, workload: Workload, started: float) -> str:
    return (
        f"workload {spec}: {len(workload)} requests over {workload.span:.0f} s "
        f"({workload.rate:.2f} req/s), loaded in {time.perf_counter() - started:.1f} s"
    )


def _positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ConfigError(f"{name} must be positive, got {value}")


def parse_policy_options(items: list[str], policies: list[str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        policy, dot, knob = key.partition(".")
        if not sep or not dot or not knob:
            raise ConfigError(f"--policy-option {item!r} must look like POLICY.KEY=VALUE")
        if policy not in policies:
            raise ConfigError(f"--policy-option {item!r} names a policy not in --policies")
        out.setdefault(policy, {})[knob] = value
    return out


def flow_control_spec(value: str | None) -> dict[str, Any]:
    """``ClusterSpec`` fields of ``--flow-control``: none (off), the defaults (``on``), or
    the ``flow_control:`` section of a kvgate config file."""
    if value is None:
        return {}
    section: Any = {}
    if value != "on":
        try:
            loaded = yaml.safe_load(Path(value).read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"--flow-control {value}: {exc}") from None
        section = loaded.get("flow_control", {}) if isinstance(loaded, dict) else None
    try:
        cfg = FlowControlConfig.model_validate(section)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "flow_control"
        raise ConfigError(f"--flow-control {value}: {where}: {first['msg']}") from None
    if not cfg.enabled:
        return {}
    return {"flow": cfg.flow_settings(), "saturation": cfg.saturation_settings()}


def run(args: argparse.Namespace) -> int:
    for name in ("instances", "rate_scale", "limit", "ttft_slo", "tpot_slo", "block_size"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise ConfigError("--policies is empty")
    check_policy_names(policies)
    policy_options = parse_policy_options(args.policy_option, policies)
    for name in policies:  # fail on bad knobs before loading a large trace
        create_policy(name, options=policy_options.get(name))
    flow = flow_control_spec(args.flow_control)  # a bad section fails before the trace loads
    perf = apply_lora_args(load_preset(args.preset), args)
    if args.block_size is not None:
        perf = perf.with_overrides(block_size=args.block_size)
    say = progress_printer(args.quiet)
    started = time.perf_counter()
    workload = load_cli_workload(args, perf.block_size, args.rate_scale)
    say(workload_line(args.workload, workload, started))
    opts = SimulateOptions(
        policies=policies,
        cluster=ClusterSpec(
            instances=args.instances,
            perf=perf,
            priority_groups=args.priority_groups,
            prefill_instances=args.prefill_instances,
            kv_bandwidth_gbps=args.kv_bandwidth,
            adapter_view=not args.hide_adapters,
            **flow,
        ),
        seed=args.seed,
        capacity=args.capacity,
        policy_options=policy_options,
    )
    result = simulate(
        workload,
        opts,
        progress=say,
        timer=None if args.no_timing else time.perf_counter,
        preset_name=args.preset,
    )
    results = result.results
    bound_started = time.perf_counter()
    attach_bound(
        results,
        workload,
        opts.cluster,
        seed=args.seed,
        capacity=args.capacity,
        target=opts.capacity_target,
        steps=opts.capacity_steps,
    )
    say(_bound_line(results, time.perf_counter() - bound_started))
    results["rate_scale"] = args.rate_scale
    results["limit"] = args.limit
    results["slo"] = {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo}
    out_dir = Path(args.out)
    try:
        write_results(results, out_dir)
        plots: list[str] = []
        if not args.no_plots:
            if plots_available():
                plots = write_plots(result.runs, out_dir)
            else:
                say("matplotlib is not installed: skipping plots (pip install 'kvgate[plots]')")
        write_report(results, out_dir, plots)
    except OSError as exc:
        raise ConfigError(f"cannot write to {out_dir}: {exc.strerror}") from None
    print(render_console(results))
    say(f"wrote {out_dir}/results.json and report.md in {time.perf_counter() - started:.1f} s")
    return 0


def _bound_line(results: dict[str, Any], seconds: float) -> str:
    b = results["pooled_bound"]
    ttft = "-" if b["ttft_p50"] is None else f"{b['ttft_p50']:.3f}s"
    line = (
        f"[bound] pooled ({b['engines_pooled']} engines as one): hit {b['cache_hit_rate']:.1%}, "
        f"TTFT p50 {ttft}, goodput {b['goodput']:.1%}"
    )
    if b.get("capacity_rps") is not None:
        line += f", capacity {b['capacity_rps']:.2f} req/s"
    return line + f" ({seconds:.1f} s)"
