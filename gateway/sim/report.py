"""Write a simulation's ``results.json`` and ``report.md``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
    cols = [c for c in _COLUMNS if any(p.get(c[0]) is not None for p in pols.values())]
    lines = [
        "# kvgate simulation report",
        "",
        f"- workload: `{results['workload']}` ({results['requests']} requests, "
        f"{results['rate_rps']:.2f} req/s)",
        f"- cluster: {results['instances']} × `{results['preset']}`, "
        f"block size {results['block_size']}, seed {results['seed']}",
        f"- infinite-cache hit-rate upper bound: {results['cache_hit_upper_bound']:.1%}",
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
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{p}]({p})" for p in plots]
    lines.append("")
    return "\n".join(lines)


def write_report(results: Mapping[str, Any], out_dir: Path, plots: list[str] | None = None) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.md"
    path.write_text(render_report(results, plots), encoding="utf-8")
    return path
