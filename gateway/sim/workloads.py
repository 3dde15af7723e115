"""Workloads for the simulator: real traces and parametric generators behind one spec.

A workload spec is ``KIND:ARG`` with optional ``?key=value&...`` parameters:

* ``mooncake:PATH`` — any Mooncake-format JSONL trace (512-token ``hash_ids``);
* ``recorded:PATH`` — traffic recorded by ``kvgate serve --record PATH``: the
  file and its rotated siblings ``PATH.1 ..``, every file of a directory, or a
  glob (``*``); each line's own ``block_size`` and ``slo_class`` are used;
  ``?model=NAME`` keeps one model, ``?failed=drop`` leaves out failed requests;
* ``azure:PATH`` — the Azure LLM inference 2023 CSV (arrivals and lengths;
  ``?share=F`` synthesises prefix sharing);
* ``gen:NAME`` — a parametric generator (see :data:`GENERATORS`).

Every kind accepts ``slo_mix=interactive:0.2,standard:0.8`` to assign SLO
classes, ``tenant_mix=a:1,b:1,c:10`` to assign tenants (seeded draws by weight),
``priority_mix=0:0.2,10:0.8`` to assign vLLM priorities, or ``priority_by_slo=interactive:0,
batch:10`` to give each SLO class a priority (after ``slo_mix``), and the options' ``limit``
and ``rate_scale``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from urllib.parse import parse_qsl

from gateway.core.errors import WorkloadError
from gateway.core.types import DEFAULT_SLO, SloClass


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload, with its engine-block hashes precomputed."""

    id: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...]
    slo: SloClass = DEFAULT_SLO
    session: str | None = None
    lora: str = ""
    """The LoRA adapter the request names ("" = the base model); ``block_hashes`` are
    seeded with its partition (``partition_seed``)."""
    tenant: str = ""
    """Who sent it (flow control's fairness unit; a recording's hashed API key)."""
    priority: int = 0
    """vLLM's ``priority`` (lower is served first), as flow control reads it."""


def builtin_slo_classes(ttft_s: float = 5.0, tpot_s: float = 0.1) -> dict[str, SloClass]:
    """``interactive`` (1 s / 50 ms), ``standard`` (the given targets), ``batch`` (60 s / 0.5 s)."""
    return {
        "interactive": SloClass("interactive", 1.0, 0.05),
        "standard": SloClass("standard", ttft_s, tpot_s),
        "batch": SloClass("batch", 60.0, 0.5),
    }


@dataclass(frozen=True, slots=True)
class WorkloadOptions:
    """How to load a workload: block size, seed, limits and the SLO classes."""

    block_size: int = 16
    seed: int = 0
    limit: int | None = None
    rate_scale: float = 1.0
    slo_classes: Mapping[str, SloClass] = field(default_factory=builtin_slo_classes)
    default_slo: str = "standard"

    @property
    def default_class(self) -> SloClass:
        return self.slo_classes[self.default_slo]


@dataclass(frozen=True, slots=True)
class Workload:
    """A named, arrival-ordered list of requests."""

    name: str
    requests: tuple[WorkloadRequest, ...]
    block_size: int
    params: Mapping[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def span(self) -> float:
        """Seconds from the first to the last arrival."""
        if len(self.requests) < 2:
            return 0.0
        return self.requests[-1].arrival - self.requests[0].arrival

    @property
    def rate(self) -> float:
        """Mean arrival rate in requests per second (0 for fewer than two requests)."""
        span = self.span
        return (len(self.requests) - 1) / span if span > 0 else 0.0

    def scaled(self, factor: float) -> Workload:
        """The same requests arriving ``factor`` times faster."""
        if factor <= 0:
            raise WorkloadError(f"rate scale must be positive, got {factor}")
        if factor == 1.0:
            return self
        t0 = self.requests[0].arrival if self.requests else 0.0
        reqs = tuple(replace(r, arrival=t0 + (r.arrival - t0) / factor) for r in self.requests)
        return replace(self, requests=reqs)

    def head(self, n: int) -> Workload:
        return replace(self, requests=self.requests[:n])


GeneratorFn = Callable[[Mapping[str, str], WorkloadOptions], list[WorkloadRequest]]


def _generators() -> Mapping[str, GeneratorFn]:
    from gateway.sim.generators import GENERATORS

    return GENERATORS


def parse_spec(spec: str) -> tuple[str, str, dict[str, str]]:
    """Split ``KIND:ARG?k=v&...`` into its parts."""
    kind, sep, rest = spec.partition(":")
    if not sep or not rest:
        raise WorkloadError(
            f"workload spec {spec!r} must look like mooncake:PATH, recorded:PATH, azure:PATH "
            "or gen:NAME"
        )
    arg, _, query = rest.partition("?")
    try:
        params = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    except ValueError:
        raise WorkloadError(f"workload spec {spec!r}: bad parameters {query!r}") from None
    return kind, arg, params


def load_workload(spec: str, options: WorkloadOptions | None = None) -> Workload:
    """Load or generate the workload ``spec`` (see the module docstring)."""
    options = options or WorkloadOptions()
    if options.limit is not None and options.limit <= 0:
        raise WorkloadError(f"--limit must be positive, got {options.limit}")
    if options.default_slo not in options.slo_classes:
        raise WorkloadError(f"unknown default SLO class {options.default_slo!r}")
    kind, arg, params = parse_spec(spec)
    slo_mix = params.pop("slo_mix", None)
    flow_mix = {k: params.pop(k) for k in FLOW_MIXES if k in params}
    if kind == "mooncake":
        from gateway.sim.mooncake import load_mooncake

        requests = load_mooncake(arg, options, params)
    elif kind == "recorded":
        from gateway.sim.mooncake import load_recorded

        requests = load_recorded(arg, options, params)
    elif kind == "azure":
        from gateway.sim.azure import load_azure

        requests = load_azure(arg, options, params)
    elif kind == "gen":
        gens = _generators()
        gen = gens.get(arg)
        if gen is None:
            raise WorkloadError(f"unknown generator {arg!r} (known: {', '.join(gens)})")
        requests = gen(params, options)
    else:
        raise WorkloadError(
            f"unknown workload kind {kind!r} (known: mooncake, recorded, azure, gen)"
        )
    requests.sort(key=lambda r: r.arrival)
    if options.limit is not None:
        requests = requests[: options.limit]
    if slo_mix is not None:
        seed = params.get("seed", str(options.seed))
        requests = assign_slo_mix(requests, slo_mix, options, seed=seed)
    if flow_mix:
        requests = assign_flow_mix(requests, flow_mix, seed=params.get("seed", str(options.seed)))
    shown = dict(params)
    if slo_mix is not None:
        shown["slo_mix"] = slo_mix
    shown.update(flow_mix)
    workload = Workload(
        name=spec,
        requests=tuple(requests),
        block_size=options.block_size,
        params=MappingProxyType(shown),
    )
    return workload.scaled(options.rate_scale) if options.rate_scale != 1.0 else workload


def parse_slo_mix(text: str, classes: Mapping[str, SloClass]) -> list[tuple[SloClass, float]]:
    """``interactive:0.2,standard:0.8`` -> [(class, weight), ...]."""
    out: list[tuple[SloClass, float]] = []
    for part in text.split(","):
        name, _, weight = part.partition(":")
        name = name.strip()
        if name not in classes:
            raise WorkloadError(
                f"slo_mix: unknown SLO class {name!r} (known: {', '.join(classes)})"
            )
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise WorkloadError(f"slo_mix: weight {weight!r} of {name!r} is not a number") from None
        if w < 0:
            raise WorkloadError(f"slo_mix: weight of {name!r} must be >= 0")
        out.append((classes[name], w))
    if not out or sum(w for _, w in out) <= 0:
        raise WorkloadError("slo_mix: needs at least one class with a positive weight")
    return out


def assign_slo_mix(
    requests: Sequence[WorkloadRequest],
    text: str,
    options: WorkloadOptions,
    *,
    seed: str | None = None,
) -> list[WorkloadRequest]:
    """Give each request an SLO class drawn (seeded) from the mix."""
    mix = parse_slo_mix(text, options.slo_classes)
    rng = random.Random(f"{options.seed if seed is None else seed}:slo_mix")
    classes = [c for c, _ in mix]
    weights = [w for _, w in mix]
    return [replace(r, slo=rng.choices(classes, weights)[0]) for r in requests]


FLOW_MIXES = ("tenant_mix", "priority_mix", "priority_by_slo")


def _weights(text: str, what: str) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    for part in text.split(","):
        name, _, weight = part.partition(":")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise WorkloadError(f"{what}: weight {weight!r} of {name!r} is not a number") from None
        if not name.strip() or w < 0:
            raise WorkloadError(f"{what}: needs NAME:WEIGHT pairs with weights >= 0")
        out.append((name.strip(), w))
    if not out or sum(w for _, w in out) <= 0:
        raise WorkloadError(f"{what}: needs at least one positive weight")
    return out


def assign_flow_mix(
    requests: Sequence[WorkloadRequest], mixes: Mapping[str, str], *, seed: str
) -> list[WorkloadRequest]:
    """Give each request a tenant and a priority from ``tenant_mix``, ``priority_mix`` or
    ``priority_by_slo`` (seeded draws; see the module docstring)."""
    out = list(requests)
    if "tenant_mix" in mixes:
        pairs = _weights(mixes["tenant_mix"], "tenant_mix")
        rng = random.Random(f"{seed}:tenant_mix")
        names, ws = [n for n, _ in pairs], [w for _, w in pairs]
        out = [replace(r, tenant=rng.choices(names, ws)[0]) for r in out]
    if "priority_mix" in mixes:
        pairs = _weights(mixes["priority_mix"], "priority_mix")
        try:
            prios = [int(n) for n, _ in pairs]
        except ValueError:
            raise WorkloadError("priority_mix: priorities must be integers") from None
        rng = random.Random(f"{seed}:priority_mix")
        out = [replace(r, priority=rng.choices(prios, [w for _, w in pairs])[0]) for r in out]
    if "priority_by_slo" in mixes:
        table: dict[str, int] = {}
        for part in mixes["priority_by_slo"].split(","):
            name, _, value = part.partition(":")
            try:
                table[name.strip()] = int(value)
            except ValueError:
                raise WorkloadError(f"priority_by_slo: {part!r} is not CLASS:INT") from None
        out = [replace(r, priority=table.get(r.slo.name, r.priority)) for r in out]
    return out


def int_param(params: Mapping[str, str], key: str, default: int, *, minimum: int = 0) -> int:
    """An integer parameter of a workload spec, with a clear error."""
    raw = params.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise WorkloadError(f"parameter {key}={raw!r} is not an integer") from None
    if value < minimum:
        raise WorkloadError(f"parameter {key} must be >= {minimum}, got {value}")
    return value


def float_param(
    params: Mapping[str, str], key: str, default: float, *, minimum: float = 0.0
) -> float:
    """A float parameter of a workload spec, with a clear error."""
    raw = params.get(key)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise WorkloadError(f"parameter {key}={raw!r} is not a number") from None
    if not math.isfinite(value) or value < minimum:
        raise WorkloadError(f"parameter {key} must be a finite number >= {minimum}, got {raw}")
    return value


def check_params(params: Mapping[str, str], allowed: Sequence[str], what: str) -> None:
    """Reject parameters a workload kind does not know."""
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise WorkloadError(
            f"{what}: unknown parameter(s) {', '.join(unknown)} "
            f"(allowed: {', '.join(sorted(allowed)) or 'none'}, slo_mix)"
        )
