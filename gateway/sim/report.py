"""Write a simulation's ``results.json`` and ``report.md``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.sim.bound import fraction_of_bound

_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("cache_hit_rate", "hit rate", "pct"),
    ("ttft_p50", "TTFT p50", "s"),
    ("ttft_p90", "TTFT p90", "s"),
    ("ttft_p99", "TTFT p99", "s"),
    ("tpot_p50", "TPOT p50", "ms"),
    ("tpot_p99", "TPOT p99", "ms"),
    ("e2e_p50", "E2E p50", "s"),
    ("e2e_p99", "E2E p99", "s"),
    ("goodput", "goodput", "pct"),
    ("throughput_rps", "req/s", "num"),
    ("load_cv_mean", "load CV", "num"),
    ("load_cv_p95", "load CV p95", "num"),
    ("preemptions", "preempt.", "int"),
    ("lora_loads", "LoRA loads", "int"),
    ("decision_us_p50", "decide p50 µs", "num"),
    ("decision_us_p99", "decide p99 µs", "num"),
    ("capacity_rps", "capacity req/s", "num"),
)


def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "–"
    if kind == "pct":
        return f"{value:.1%}"
    if kind == "s":
        return f"{value:.3f}"
    if kind == "ms":
        return f"{value * 1000:.1f}"
    if kind == "int":
        return str(int(value))
    return f"{value:.2f}"


def write_results(results: Mapping[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    path.write_text(json.dumps(results, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def render_report(results: Mapping[str, Any], plots: list[str] | None = None) -> str:
    """Markdown with the policies side by side (and per SLO class when mixed)."""
    pols: Mapping[str, Mapping[str, Any]] = results["policies"]
    bound: Mapping[str, Any] | None = results.get("pooled_bound")
    cols = [c for c in _COLUMNS if any(p.get(c[0]) is not None for p in pols.values())]
    lines = [
        "# kvgate simulation report",
        "",
        f"- workload: `{results['workload']}` ({results['requests']} requests, "
        f"{results['rate_rps']:.2f} req/s)",
        f"- cluster: {results['instances']} × `{results['preset']}`, "
        f"block size {results['block_size']}, seed {results['seed']}",
        f"- infinite-cache hit-rate upper bound: {results['cache_hit_upper_bound']:.1%}",
        *(
            [
                f"- pooled bound: the workload on one engine {bound['engines_pooled']}× as fast "
                f"with {bound['engines_pooled']}× the token budget, sequence slots and KV (one "
                "global cache, one queue); see the last table"
            ]
            if bound
            else []
        ),
        "",
        "Times in seconds (TPOT in ms). Goodput = share of requests meeting both the TTFT and "
        "TPOT target of their SLO class. Load CV = std/mean of pending prefill tokens across "
        "instances, sampled at each arrival.",
        "",
        "| policy | " + " | ".join(label for _, label, _ in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for name, pol in pols.items():
        cells = [_fmt(pol.get(key), kind) for key, _, kind in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if bound:
        cells = [_fmt(bound.get(key), kind) for key, _, kind in cols]
        lines.append("| *pooled bound* | " + " | ".join(cells) + " |")
    shared: Mapping[str, Any] | None = results.get("shared_queue_bound")
    if shared:
        cells = [_fmt(shared.get(key), kind) for key, _, kind in cols]
        lines.append("| *shared-queue bound* | " + " | ".join(cells) + " |")
    classes = sorted({c for p in pols.values() for c in p.get("per_class", {})})
    if classes:
        lines += ["", "## Per SLO class", ""]
        lines.append(
            "| policy | class | requests | TTFT p50 | TTFT p99 | TPOT p99 (ms) | goodput |"
        )
        lines.append("|---|---|---:|---:|---:|---:|---:|")
        for name, pol in pols.items():
            for cls in classes:
                c = pol.get("per_class", {}).get(cls)
                if c is None:
                    continue
                lines.append(
                    f"| {name} | {cls} | {c['requests']} | {_fmt(c['ttft_p50'], 's')} | "
                    f"{_fmt(c['ttft_p99'], 's')} | {_fmt(c['tpot_p99'], 'ms')} | "
                    f"{_fmt(c['goodput'], 'pct')} |"
                )
    rejected = {n: p["rejected"] for n, p in pols.items() if p.get("rejected")}
    if rejected:
        lines += [
            "",
            "Rejected requests (longer than the preset's max_model_len or KV capacity): "
            + ", ".join(f"{n}: {v}" for n, v in rejected.items()),
        ]
    if bound:
        lines += ["", *_bound_section(results, pols, bound)]
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{p}]({p})" for p in plots]
    lines.append("")
    return "\n".join(lines)


_VS_BOUND: tuple[tuple[str, str], ...] = (
    ("ttft_mean", "TTFT mean"),
    ("ttft_p50", "TTFT p50"),
    ("cache_hit_rate", "hit rate"),
    ("capacity_rps", "capacity"),
)


def _bound_section(
    results: Mapping[str, Any], pols: Mapping[str, Mapping[str, Any]], bound: Mapping[str, Any]
) -> list[str]:
    cols = [c for c in _VS_BOUND if any(p.get("vs_bound", {}).get(c[0]) for p in pols.values())]
    upper = results["cache_hit_upper_bound"]
    lines = [
        "## Against the pooled bound",
        "",
        "Each policy as a fraction of the pooled bound (100 % = as good as the bound): "
        "bound ÷ policy for TTFT, policy ÷ bound for hit rate and capacity. The last column "
        "is the hit rate over the infinite-cache bound. The bound is claimed for TTFT mean and "
        "p50; a policy can pass it on hit rate by a point or two, and capacity is not claimed "
        "(see docs/simulator.md#the-pooled-bound).",
        "",
        "| policy | " + " | ".join(label for _, label in cols) + " | hit rate ÷ infinite cache |",
        "|---|" + "---:|" * (len(cols) + 1),
    ]
    for name, pol in pols.items():
        vs = pol.get("vs_bound", {})
        cells = [_fmt(vs.get(key), "pct") for key, _ in cols]
        cells.append(_fmt(pol["cache_hit_rate"] / upper if upper else None, "pct"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if results.get("shared_queue_bound"):
        lines += [
            "",
            "## Against the shared-queue bound",
            "",
            "The same fractions of the tighter shared-queue bound (engines of normal speed, "
            "one central work-conserving queue, one global KV cache; "
            "docs/simulator.md#the-shared-queue-bound).",
            "",
            "| policy | " + " | ".join(label for _, label in cols) + " |",
            "|---|" + "---:|" * len(cols),
        ]
        for name, pol in pols.items():
            vs = pol.get("vs_shared_queue", {})
            lines.append(
                f"| {name} | " + " | ".join(_fmt(vs.get(key), "pct") for key, _ in cols) + " |"
            )
    return lines


_CONSOLE: tuple[tuple[str, str, str], ...] = (
    ("cache_hit_rate", "hit", "pct"),
    ("ttft_mean", "TTFT mean", "s"),
    ("ttft_p50", "TTFT p50", "s"),
    ("ttft_p99", "TTFT p99", "s"),
    ("goodput", "goodput", "pct"),
    ("capacity_rps", "cap. req/s", "num"),
    ("lora_loads", "LoRA loads", "int"),
)


def render_console(results: Mapping[str, Any]) -> str:
    """A plain-text table for the terminal: policies, both bounds, fractions of the pooled one."""
    pols: Mapping[str, Mapping[str, Any]] = results["policies"]
    bound: Mapping[str, Any] | None = results.get("pooled_bound")
    cols = [c for c in _CONSOLE if any(p.get(c[0]) is not None for p in pols.values())]
    vs = [c for c in _VS_BOUND if any(p.get("vs_bound", {}).get(c[0]) for p in pols.values())]
    head = ["policy", *(label for _, label, _ in cols)]
    head += [f"{label} / bound" for _, label in vs]
    rows = []
    for name, pol in pols.items():
        cells = [name, *(_fmt(pol.get(k), kind) for k, _, kind in cols)]
        cells += [_fmt(pol.get("vs_bound", {}).get(k), "pct") for k, _ in vs]
        rows.append(cells)
    if bound:
        cells = ["pooled bound", *(_fmt(bound.get(k), kind) for k, _, kind in cols)]
        rows.append(cells + ["100.0%"] * len(vs))
    shared: Mapping[str, Any] | None = results.get("shared_queue_bound")
    if shared:
        cells = ["shared-queue bound", *(_fmt(shared.get(k), kind) for k, _, kind in cols)]
        rows.append(
            cells + [_fmt(fraction_of_bound(shared, bound or {}).get(k), "pct") for k, _ in vs]
        )
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    out = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [head, *rows]
    ]
    out.append(f"infinite-cache hit-rate bound: {results['cache_hit_upper_bound']:.1%}")
    return "\n".join(out)


def write_report(results: Mapping[str, Any], out_dir: Path, plots: list[str] | None = None) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.md"
    path.write_text(render_report(results, plots), encoding="utf-8")
    return path
