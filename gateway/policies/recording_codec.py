"""JSON form of a decision log (:mod:`gateway.policies.recording`), exact both ways.

Values map to JSON as: ``None``/bool/int/float/str as themselves (Python's JSON
keeps ints of any size and floats' shortest round-trip form), a tuple as
``{"T": [...]}``, a list as a list, an :class:`EngineRole` as ``{"E": value}``
and one of the seam's dataclasses as ``{"D": name, "f": {field: value}}``
(private fields and a held request's driver handle are left out). Decoding
accepts only those dataclasses, so a log cannot name arbitrary classes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from gateway.core.types import (
    ClusterView,
    Decision,
    EngineRole,
    EngineView,
    Migration,
    RequestInfo,
    SloClass,
)
from gateway.perfmodel.model import PerfModel
from gateway.policies.pd_rule import PDSettings
from gateway.policies.recording import Call, PolicySpec, QueueSnapshot
from gateway.policies.router_queues import QueuedRequest

_CLASSES: dict[str, type[Any]] = {
    c.__name__: c
    for c in (
        RequestInfo,
        SloClass,
        EngineView,
        ClusterView,
        Decision,
        Migration,
        QueuedRequest,
        QueueSnapshot,
    )
}
_SKIP = {"handle", "live"}


class CodecError(ValueError):
    """A decision log entry that is not one this codec writes."""


def encode(value: Any) -> Any:
    """``value`` as JSON-able data."""
    if value is None or isinstance(value, bool | int | float | str):
        if isinstance(value, EngineRole):
            return {"E": value.value}
        return value
    if isinstance(value, tuple):
        return {"T": [encode(v) for v in value]}
    if isinstance(value, frozenset):  # sorted: the same set always encodes alike
        return {"S": sorted(encode(v) for v in value)}
    if isinstance(value, list):
        return [encode(v) for v in value]
    name = type(value).__name__
    if dataclasses.is_dataclass(value) and _CLASSES.get(name) is type(value):
        return {
            "D": name,
            "f": {
                f.name: encode(getattr(value, f.name))
                for f in dataclasses.fields(value)
                if not f.name.startswith("_") and f.name not in _SKIP
            },
        }
    raise CodecError(f"cannot encode a {name}")


def decode(data: Any) -> Any:
    """The value :func:`encode` made ``data`` from."""
    if data is None or isinstance(data, bool | int | float | str):
        return data
    if isinstance(data, list):
        return [decode(v) for v in data]
    if isinstance(data, dict):
        if "T" in data:
            return tuple(decode(v) for v in data["T"])
        if "S" in data and isinstance(data["S"], list):
            return frozenset(decode(v) for v in data["S"])
        if "E" in data:
            return EngineRole(data["E"])
        cls = _CLASSES.get(data.get("D", ""))
        if cls is not None and isinstance(data.get("f"), dict):
            try:
                return cls(**{k: decode(v) for k, v in data["f"].items()})
            except TypeError as exc:
                raise CodecError(f"bad {cls.__name__}: {exc}") from None
    raise CodecError(f"not a decision log value: {str(data)[:80]}")


def encode_call(call: Call) -> dict[str, Any]:
    return {"m": call.method, "a": encode(call.args), "r": encode(call.result)}


def decode_call(data: Mapping[str, Any]) -> Call:
    try:
        args = decode(data["a"])
        method = data["m"]
    except KeyError as exc:
        raise CodecError(f"call without {exc}") from None
    if not isinstance(args, tuple) or not isinstance(method, str):
        raise CodecError("a call needs a method name and an argument tuple")
    return Call(method, args, decode(data.get("r")))


def encode_spec(spec: PolicySpec) -> dict[str, Any]:
    perf = None
    if spec.perf is not None:
        perf = dataclasses.asdict(spec.perf)
        perf["sources"] = list(spec.perf.sources)
    return {
        "name": spec.name,
        "options": dict(spec.options),
        "seed": spec.seed,
        "block_size": spec.block_size,
        "kv_events": spec.kv_events,
        "perf": perf,
        "pd": dataclasses.asdict(spec.pd),
    }


def decode_spec(data: Mapping[str, Any]) -> PolicySpec:
    perf_data = data.get("perf")
    perf = None
    if perf_data is not None:
        perf = PerfModel(**{**perf_data, "sources": tuple(perf_data.get("sources", ()))})
    return PolicySpec(
        name=str(data["name"]),
        options=dict(data.get("options") or {}),
        seed=int(data.get("seed", 0)),
        block_size=int(data.get("block_size", 16)),
        kv_events=bool(data.get("kv_events", False)),
        perf=perf,
        pd=PDSettings(**data["pd"]) if data.get("pd") else PDSettings(),  # older logs: none
    )
