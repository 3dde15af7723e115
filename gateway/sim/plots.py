"""PNG plots of a simulation (needs the ``plots`` extra: matplotlib)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from gateway.sim.loop import SimRun

_MAX_POINTS = 2000
_WINDOW = 50


def _rolling_mean(values: list[float], window: int) -> list[float]:
    out: list[float] = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plots_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plots(runs: Mapping[str, SimRun], out_dir: Path) -> list[str]:
    """Write ``ttft_cdf.png`` and ``load_cv.png``; returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[str] = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, run in runs.items():
        ttft = sorted(r.ttft for r in run.records if r.ttft is not None)
        if not ttft:
            continue
        step = max(1, len(ttft) // _MAX_POINTS)
        xs = ttft[::step]
        ys = [(i * step + 1) / len(ttft) for i in range(len(xs))]
        ax.plot(xs, ys, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per policy")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "ttft_cdf.png", dpi=110)
    plt.close(fig)
    written.append("ttft_cdf.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, run in runs.items():
        series = run.load_cv
        if not series:
            continue
        smooth = _rolling_mean([cv for _, cv in series], _WINDOW)
        step = max(1, len(series) // _MAX_POINTS)
        ax.plot([t for t, _ in series[::step]], smooth[::step], label=name, linewidth=1.0)
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"load CV of pending prefill tokens (mean of {_WINDOW} arrivals)")
    ax.set_title("Load imbalance over time")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "load_cv.png", dpi=110)
    plt.close(fig)
    written.append("load_cv.png")
    return written


def write_plan_plot(
    curves: Mapping[str, list[tuple[int, float]]], target: float, path: Path
) -> Path:
    """SLO attainment vs pool size, one line per policy (``kvgate plan``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in curves.items():
        if not points:
            continue
        pts = sorted(points)
        bound = name == "pooled bound"
        ax.plot(
            [n for n, _ in pts],
            [a for _, a in pts],
            marker="o",
            label=name,
            color="black" if bound else None,
            linestyle="--" if bound else "-",
        )
    ax.axhline(target, color="grey", linewidth=1.0, linestyle=":", label=f"target {target:.0%}")
    ax.set_xlabel("engines in the pool")
    ax.set_ylabel("SLO attainment (share of requests)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("SLO attainment vs pool size")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
