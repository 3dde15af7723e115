"""Mooncake-format JSONL traces (FAST'25 release format), and kvgate's recordings.

Each line is ``{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}`` where ``hash_ids`` are prefix hashes of 512-token
blocks. Extra fields are ignored. Any file of this shape loads; a malformed
line is reported with its file and line number.

``recorded:`` reads what ``kvgate serve --record`` writes: the same lines with
optional ``block_size`` (tokens per hash id, default 512), ``slo_class``,
``model``, ``ok``, ``session`` (the salted session id: the replayed request
carries it as its session), ``tenant`` (the salted tenant) and ``priority`` (flow
control replays both) and ``recording_start`` (unix ms of the line's time
zero, so several recordings merge on one timeline), from a file and its rotated
siblings, a directory or a glob.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.core.blocks import TRACE_BLOCK_TOKENS, hashes_from_trace
from gateway.core.errors import WorkloadError
from gateway.core.types import SloClass
from gateway.sim.workloads import WorkloadOptions, WorkloadRequest, check_params, int_param

_PARAMS = ("trace_block",)
_RECORDED_PARAMS = ("model", "failed")


def load_mooncake(
    path: str, options: WorkloadOptions, params: Mapping[str, str] | None = None
) -> list[WorkloadRequest]:
    """Read a Mooncake trace; ``limit`` stops reading early."""
    params = params or {}
    check_params(params, _PARAMS, "mooncake")
    trace_block = int_param(params, "trace_block", TRACE_BLOCK_TOKENS, minimum=1)
    file = Path(path)
    if not file.is_file():
        raise WorkloadError("trace file not found", path=path)
    memo: dict[tuple[int, int, int], tuple[int, ...]] = {}
    out: list[WorkloadRequest] = []
    slo = options.default_class
    limit = options.limit
    try:
        with file.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                if limit is not None and len(out) >= limit:
                    break
                ts, n_in, n_out, ids = _parse_line(line, path, lineno)
                hashes = hashes_from_trace(
                    ids, n_in, options.block_size, trace_block=trace_block, memo=memo
                )
                out.append(
                    WorkloadRequest(
                        id=f"req-{len(out)}",
                        arrival=ts / 1000.0,
                        prompt_tokens=n_in,
                        output_tokens=n_out,
                        block_hashes=hashes,
                        slo=slo,
                    )
                )
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"not UTF-8 text ({exc.reason})", path=path) from None
    except OSError as exc:
        raise WorkloadError(f"cannot read trace ({exc.strerror})", path=path) from None
    if not out:
        raise WorkloadError("trace has no requests", path=path)
    return out


def _parse_line(line: str, path: str, lineno: int) -> tuple[float, int, int, list[int]]:
    return _parse_fields(_parse_object(line, path, lineno), path, lineno)


def _parse_object(line: str, path: str, lineno: int) -> dict[str, Any]:
    try:
        obj: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"invalid JSON ({exc.msg})", path=path, line=lineno) from None
    if not isinstance(obj, dict):
        raise WorkloadError("expected a JSON object", path=path, line=lineno)
    return obj


def _parse_fields(obj: dict[str, Any], path: str, lineno: int) -> tuple[float, int, int, list[int]]:
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in obj:
            raise WorkloadError(f"missing field {key!r}", path=path, line=lineno)
    ts = obj["timestamp"]
    n_in = obj["input_length"]
    n_out = obj["output_length"]
    ids = obj["hash_ids"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or ts < 0:
        raise WorkloadError(f"timestamp must be a number >= 0, got {ts!r}", path=path, line=lineno)
    for key, value in (("input_length", n_in), ("output_length", n_out)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise WorkloadError(
                f"{key} must be an integer >= 1, got {value!r}", path=path, line=lineno
            )
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in ids
    ):
        raise WorkloadError("hash_ids must be a list of integers", path=path, line=lineno)
    return float(ts), n_in, n_out, ids


def recorded_files(spec: str) -> list[Path]:
    """The files of ``recorded:SPEC``, oldest first: a file and its rotated siblings
    (``PATH.N`` .. ``PATH.1``, then ``PATH``), every file of a directory, or a glob's matches."""
    path = Path(spec)
    if any(c in spec for c in "*["):
        files = sorted(p for p in map(Path, glob.glob(spec)) if p.is_file())
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    elif path.is_file():
        rotated = [
            p for p in path.parent.glob(path.name + ".*") if p.is_file() and p.suffix[1:].isdigit()
        ]
        files = [*sorted(rotated, key=lambda p: -int(p.suffix[1:])), path]
    else:
        raise WorkloadError("recording not found", path=spec)
    if not files:
        raise WorkloadError("no recording files match", path=spec)
    return files


def load_recorded(
    spec: str, options: WorkloadOptions, params: Mapping[str, str] | None = None
) -> list[WorkloadRequest]:
    """Read a recording (see :func:`recorded_files`); arrivals start at 0.

    ``?model=NAME`` keeps that model's requests; ``?failed=drop`` leaves out requests
    recorded with ``ok: false`` (kept by default: they were real arrivals). Each line's
    ``hash_ids`` are re-cut into engine blocks of ``options.block_size`` from its own
    ``block_size``, so requests share engine blocks exactly as far as they shared ids.
    """
    params = params or {}
    check_params(params, _RECORDED_PARAMS, "recorded")
    model = params.get("model")
    failed = params.get("failed", "keep")
    if failed not in ("keep", "drop"):
        raise WorkloadError(f"recorded: failed must be keep or drop, got {failed!r}")
    memo: dict[tuple[int, int, int], tuple[int, ...]] = {}
    rows: list[tuple[float, int, int, tuple[int, ...], SloClass, str | None, str, int]] = []
    for file in recorded_files(spec):
        name = str(file)
        try:
            with file.open(encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, start=1):
                    if not line.strip():
                        continue
                    obj = _parse_object(line, name, lineno)
                    ts, n_in, n_out, ids = _parse_fields(obj, name, lineno)
                    if model is not None and obj.get("model") != model:
                        continue
                    if failed == "drop" and obj.get("ok") is False:
                        continue
                    start = _number(obj, "recording_start", 0, name, lineno)
                    block = obj.get("block_size", TRACE_BLOCK_TOKENS)
                    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
                        raise WorkloadError(
                            f"block_size must be an integer >= 1, got {block!r}",
                            path=name,
                            line=lineno,
                        )
                    if block == options.block_size:
                        hashes = tuple(ids[: min(n_in, len(ids) * block) // block])
                    else:
                        hashes = hashes_from_trace(
                            ids, n_in, options.block_size, trace_block=block, memo=memo
                        )
                    slo_name = obj.get("slo_class")
                    slo = (
                        options.slo_classes.get(slo_name, options.default_class)
                        if isinstance(slo_name, str)
                        else options.default_class
                    )
                    session = obj.get("session")
                    session = session if isinstance(session, str) and session else None
                    tenant = obj.get("tenant")
                    tenant = tenant if isinstance(tenant, str) else ""
                    prio = obj.get("priority", 0)
                    prio = prio if isinstance(prio, int) and not isinstance(prio, bool) else 0
                    rows.append((start + ts, n_in, n_out, hashes, slo, session, tenant, prio))
        except UnicodeDecodeError as exc:
            raise WorkloadError(f"not UTF-8 text ({exc.reason})", path=name) from None
        except OSError as exc:
            raise WorkloadError(f"cannot read recording ({exc.strerror})", path=name) from None
    if not rows:
        what = f" of model {model!r}" if model is not None else ""
        raise WorkloadError(f"recording has no requests{what}", path=spec)
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [
        WorkloadRequest(
            id=f"req-{i}",
            arrival=(t - t0) / 1000.0,
            prompt_tokens=n_in,
            output_tokens=n_out,
            block_hashes=hashes,
            slo=slo,
            session=session,
            tenant=tenant,
            priority=prio,
        )
        for i, (t, n_in, n_out, hashes, slo, session, tenant, prio) in enumerate(rows)
    ]


def _number(obj: dict[str, Any], key: str, default: float, path: str, lineno: int) -> float:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WorkloadError(f"{key} must be a number, got {value!r}", path=path, line=lineno)
    return float(value)
