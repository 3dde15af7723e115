"""Tables and target lines of the live routing benchmark."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from benchmarks.live.run import Row

TARGETS = "shared p50 <= 25 ms, p99 <= 200 ms, busiest <= 30 %, hit >= 0.85; unique p99 <= ref"
_P50, _P99, _BUSIEST, _HIT = 25.0, 200.0, 0.30, 0.85


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _pair(row: Row | None) -> str:
    if row is None:
        return "-"
    return f"{_ms(row.ttft_p50_ms)} / {_ms(row.ttft_p99_ms)}"


def _routers(rows: Sequence[Row]) -> list[str]:
    out: list[str] = []
    for r in rows:
        if r.router not in out:
            out.append(r.router)
    return out


def _get(rows: Sequence[Row], router: str, workload: str) -> Row | None:
    return next((r for r in rows if r.router == router and r.workload == workload), None)


def print_table(rows: Sequence[Row], *, title: str, default: str = "") -> None:
    """One Markdown table: a row per router, TTFTs in model ms.

    ``overhead`` is client mean TTFT minus the engines' own mean (shared/unique/chat): time
    spent in the router, HTTP, the client and CPU contention, not in an engine; ``load`` the
    highest 1-minute load average at a run's start.
    """
    print(f"\n### {title} (TTFT in model ms: wall / time scale)\n")
    print(
        "| router | shared TTFT p50 / p99 | busiest | hit rate | unique TTFT p50 / p99 | "
        "unique busiest | chat TTFT p50 / p99 | chat busiest | chat hit | errors | "
        "overhead ms | load |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in _routers(rows):
        a, b, c = (_get(rows, name, w) for w in ("shared", "unique", "chat"))
        present = [x for x in (a, b, c) if x is not None]
        errors = sum(x.errors for x in present)
        load = max(x.load1 for x in present)
        overhead = "/".join(_ms(x.overhead_ms) if x else "-" for x in (a, b, c))
        cells = [
            f"{name} (default)" if name == default else name,
            _pair(a),
            f"{a.busiest:.0%}" if a else "-",
            f"{a.hit_rate:.2f}" if a else "-",
            _pair(b),
            f"{b.busiest:.0%}" if b else "-",
            _pair(c),
            f"{c.busiest:.0%}" if c else "-",
            f"{c.hit_rate:.2f}" if c else "-",
            str(errors),
            overhead,
            f"{load:.1f}",
        ]
        print("| " + " | ".join(cells) + " |")


def print_spread(rows: Sequence[Row]) -> None:
    """Per router and workload: each metric's values over the repetitions (min-max)."""
    print("\n### spread over repetitions (min - max)\n")
    print("| router | workload | TTFT p50 | TTFT p99 | busiest | hit rate |")
    print("|---|---|---:|---:|---:|---:|")
    for name in _routers(rows):
        for w in ("shared", "unique", "chat"):
            sel = [r for r in rows if r.router == name and r.workload == w]
            if len(sel) < 2:
                continue
            p50 = [r.ttft_p50_ms or 0.0 for r in sel]
            p99 = [r.ttft_p99_ms or 0.0 for r in sel]
            bus = [r.busiest for r in sel]
            hit = [r.hit_rate for r in sel]
            print(
                f"| {name} | {w} | {min(p50):,.0f} - {max(p50):,.0f} | "
                f"{min(p99):,.0f} - {max(p99):,.0f} | {min(bus):.0%} - {max(bus):.0%} | "
                f"{min(hit):.2f} - {max(hit):.2f} |"
            )


def _mean(values: Sequence[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.fmean(xs) if xs else None


def print_targets(rows: Sequence[Row], *, reference: str) -> None:
    """pass/miss per router against the issue's live targets (means over repetitions)."""
    print(f"\n### targets ({TARGETS}; means over repetitions)\n")
    ref_p99 = _mean(
        [r.ttft_p99_ms for r in rows if r.router == reference and r.workload == "unique"]
    )
    for name in _routers(rows):
        shared = [r for r in rows if r.router == name and r.workload == "shared"]
        unique = [r for r in rows if r.router == name and r.workload == "unique"]
        checks: list[tuple[str, str, str, bool]] = []
        if shared:
            p50 = _mean([r.ttft_p50_ms for r in shared])
            p99 = _mean([r.ttft_p99_ms for r in shared])
            bus = _mean([r.busiest for r in shared]) or 0.0
            hit = _mean([r.hit_rate for r in shared]) or 0.0
            errors = sum(r.errors for r in shared)
            checks += [
                ("shared TTFT p50", _ms(p50), f"<= {_P50:.0f} ms", p50 is not None and p50 <= _P50),
                ("shared TTFT p99", _ms(p99), f"<= {_P99:.0f} ms", p99 is not None and p99 <= _P99),
                ("shared busiest engine", f"{bus:.0%}", f"<= {_BUSIEST:.0%}", bus <= _BUSIEST),
                ("shared hit rate", f"{hit:.2f}", f">= {_HIT:.2f}", hit >= _HIT),
                ("shared errors", str(errors), "0", errors == 0),
            ]
        if unique and name != reference:
            p99 = _mean([r.ttft_p99_ms for r in unique])
            ok = p99 is not None and ref_p99 is not None and p99 <= ref_p99
            checks.append(
                (f"unique TTFT p99 vs {reference}", _ms(p99), f"<= {_ms(ref_p99)} ms", ok)
            )
        for what, value, target, ok in checks:
            print(f"{'pass' if ok else 'MISS'}  {name:<16} {what:<32} {value:>7}  ({target})")
