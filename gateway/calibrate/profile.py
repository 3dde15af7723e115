"""Turn fitted constants into a performance preset file that ``load_preset`` reads."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from gateway.calibrate.fit import FitResult, significant
from gateway.calibrate.frontend import WakeFit
from gateway.core.errors import ConfigError
from gateway.perfmodel.model import PerfModel
from gateway.perfmodel.presets import preset_from_dict, preset_to_dict


@dataclass(frozen=True, slots=True)
class ProfileSource:
    """Where and how the measurements behind a profile were taken."""

    target: str
    model: str
    when: datetime
    requests: int
    rounds: int
    elapsed_s: float
    http_floor_ms: float
    stopped_early: bool = False


@dataclass(frozen=True, slots=True)
class Extras:
    """The costs outside the steps (:mod:`gateway.calibrate.frontend`)."""

    frontend: FitResult
    wake: WakeFit
    engine_side: bool
    """Prefill was fitted on the engine's own TTFT (its clock agrees with the client's)."""

    def values(self) -> dict[str, float]:
        out = {k: significant(v) for k, v in self.frontend.coefficients.items()}
        out["idle_wake_ms"] = significant(self.wake.idle_wake_ms)
        out["idle_after_s"] = significant(self.wake.idle_after_s)
        return out

    def describe(self) -> str:
        f = self.frontend.coefficients
        how = (
            f"client minus engine-reported latency, {self.frontend.quality()}"
            if self.frontend.fitted
            else "the HTTP floor (the engine's latency metrics are missing or on another "
            "clock; prefill fitted on client TTFT minus the floor)"
        )
        return (
            f"frontend: {f['frontend_ms']:.2f} ms + {f['frontend_per_stream_ms']:.3f} ms per "
            f"extra concurrent stream, from {how}\n{self.wake.describe()}"
        )


def _fit_line(kind: str, fit: FitResult) -> str:
    kept = f"; kept from the base preset: {', '.join(fit.kept)}" if fit.kept else ""
    return f"{kind} fit: {fit.quality()}; fitted {', '.join(fit.fitted) or 'nothing'}{kept}"


def build_profile(
    base: PerfModel,
    prefill: FitResult,
    decode: FitResult,
    source: ProfileSource,
    *,
    name: str,
    engine: Mapping[str, int] | None = None,
    extras: Extras | None = None,
) -> dict[str, Any]:
    """A preset mapping: ``base`` with the fitted constants and the engine's own limits."""
    values = preset_to_dict(base)
    for term, value in {**prefill.coefficients, **decode.coefficients}.items():
        values[term] = significant(value)
    if extras is not None:
        values.update(extras.values())
    values.update(engine or {})
    when = source.when.isoformat(timespec="seconds")
    r2 = {k: "n/a" if f.r2 is None else f"{f.r2:.4f}" for k, f in (("p", prefill), ("d", decode))}
    description = (
        f"Calibrated by kvgate calibrate against {source.target} (model {source.model}) at "
        f"{when}: {prefill.points} prefill and {decode.points} decode probe points, prefill "
        f"fit R² {r2['p']}, decode fit R² {r2['d']}. Other fields come from the base preset "
        f"{base.name}."
    )
    stopped = ", stopped by --max-seconds" if source.stopped_early else ""
    sources = [
        f"kvgate calibrate {when}: {source.target}, model {source.model}, {source.requests} "
        f"requests in {source.rounds} complete round(s), {source.elapsed_s:.0f} s{stopped}",
        f"HTTP floor {source.http_floor_ms:.2f} ms subtracted from every time to first token"
        if extras is None or not extras.engine_side
        else "prefill fitted on the engine's own time to first token",
        _fit_line("prefill", prefill),
        _fit_line("decode", decode),
    ]
    if extras is not None:
        sources += extras.describe().split("\n")
    if engine:
        reported = ", ".join(f"{k}={v}" for k, v in engine.items())
        sources.append(f"engine limits ({reported}) as the engine reported or the user set them")
    sources += [f"base preset {base.name}: {s}" for s in base.sources]
    values.update(name=name, description=description, sources=sources)
    head = ("name", "description", "sources")
    return {k: values[k] for k in head} | {k: v for k, v in values.items() if k not in head}


def write_profile(path: Path, profile: Mapping[str, Any]) -> None:
    """Write ``profile`` as YAML after checking that it builds a valid :class:`PerfModel`."""
    preset_from_dict(dict(profile), source=str(path))
    text = yaml.safe_dump(dict(profile), sort_keys=False, width=100, allow_unicode=True)
    header = f"# Engine profile written by `kvgate calibrate`; use it as --preset {path}\n"
    try:
        path.write_text(header + text, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror}") from None
