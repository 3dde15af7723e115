"""Mooncake-format JSONL traces (FAST'25 release format).

Each line is ``{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}`` where ``hash_ids`` are prefix hashes of 512-token
blocks. Extra fields are ignored. Any file of this shape loads; a malformed
line is reported with its file and line number.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.core.blocks import TRACE_BLOCK_TOKENS, hashes_from_trace
from gateway.core.errors import WorkloadError
from gateway.sim.workloads import WorkloadOptions, WorkloadRequest, check_params, int_param

_PARAMS = ("trace_block",)


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
    try:
        obj: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"invalid JSON ({exc.msg})", path=path, line=lineno) from None
    if not isinstance(obj, dict):
        raise WorkloadError("expected a JSON object", path=path, line=lineno)
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
