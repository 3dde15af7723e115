"""The Azure LLM inference trace 2023 (Splitwise, ISCA'24): arrivals and lengths.

The CSV has the header ``TIMESTAMP,ContextTokens,GeneratedTokens`` and rows
like ``2023-11-16 18:15:46.6805900,374,44`` (any number of fractional digits).
A request arrives at its timestamp minus the earliest one read (the first row
in a sorted trace). ``GeneratedTokens`` of 0 counts as 1 token.

The trace has no content, so by default every prompt is unique. With
``share=F`` a fraction ``F`` of the requests start with one of ``prefixes``
shared prefixes (default 20) chosen by Zipf popularity ``zipf`` (default 1.0).
Each prefix has a fixed length, drawn uniformly within ±50% of ``prefix_frac``
(default 0.5) times the mean context of the rows read, and is clipped to the
context of the request using it. The rest of each prompt is unique. ``seed``
overrides the options' seed.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from datetime import date
from pathlib import Path

from gateway.core.blocks import hashes_from_segments
from gateway.core.errors import WorkloadError
from gateway.sim.generators import SegmentIds, spread_len, zipf_cum_weights
from gateway.sim.workloads import (
    WorkloadOptions,
    WorkloadRequest,
    check_params,
    float_param,
    int_param,
)

_PARAMS = ("share", "prefixes", "prefix_frac", "zipf", "seed")
HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_TIMESTAMP = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9})\d*)?Z?")


def parse_timestamp(text: str) -> int:
    """``YYYY-MM-DD HH:MM:SS[.fraction]`` as integer nanoseconds since 0001-01-01.

    Integers keep the full 7-digit precision of the trace; extra digits beyond
    nanoseconds are dropped. Raises :class:`ValueError` on anything else.
    """
    m = _TIMESTAMP.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"bad timestamp {text!r}")
    day, hh, mm, ss, frac = m.groups()
    try:
        days = date.fromisoformat(day).toordinal()
    except ValueError:
        raise ValueError(f"bad date in timestamp {text!r}") from None
    h, mi, s = int(hh), int(mm), int(ss)
    if h > 23 or mi > 59 or s > 60:
        raise ValueError(f"bad time of day in timestamp {text!r}")
    nanos = int((frac or "").ljust(9, "0"))
    return ((days * 24 + h) * 60 + mi) * 60_000_000_000 + s * 1_000_000_000 + nanos


class _Sharing:
    """Assigns synthetic shared prefixes to prompts."""

    def __init__(self, params: Mapping[str, str], options: WorkloadOptions) -> None:
        self.share = float_param(params, "share", 0.0)
        if self.share > 1:
            raise WorkloadError(f"parameter share must be <= 1, got {self.share}")
        self.count = int_param(params, "prefixes", 20, minimum=1)
        self.frac = float_param(params, "prefix_frac", 0.5)
        if self.frac > 1:
            raise WorkloadError(f"parameter prefix_frac must be <= 1, got {self.frac}")
        self.weights = zipf_cum_weights(self.count, float_param(params, "zipf", 1.0))
        seed = int_param(params, "seed", options.seed)
        self.rng = random.Random(f"{seed}:azure")
        self.ids = SegmentIds(f"azure:{seed}")
        self.prefixes: list[tuple[int, int]] = []

    def start(self, mean_context: float) -> None:
        """Fix the prefixes' ids and lengths once the rows are known."""
        mean = max(1, round(self.frac * mean_context))
        self.prefixes = [(self.ids.fresh(), spread_len(self.rng, mean)) for _ in range(self.count)]

    def pieces(self, context: int) -> list[tuple[int, int]]:
        if self.share <= 0 or self.rng.random() >= self.share:
            return [(self.ids.fresh(), context)]
        seg, length = self.rng.choices(self.prefixes, cum_weights=self.weights)[0]
        length = min(length, context)
        out = [(seg, length)]
        if context > length:
            out.append((self.ids.fresh(), context - length))
        return out


def load_azure(
    path: str, options: WorkloadOptions, params: Mapping[str, str] | None = None
) -> list[WorkloadRequest]:
    """Read an Azure 2023 trace CSV; ``limit`` stops reading early."""
    params = params or {}
    check_params(params, _PARAMS, "azure")
    sharing = _Sharing(params, options)
    file = Path(path)
    if not file.is_file():
        raise WorkloadError("trace file not found", path=path)
    rows: list[tuple[int, int, int]] = []
    limit = options.limit
    try:
        with file.open(encoding="utf-8-sig", newline="") as fh:
            header = fh.readline()
            if not header.strip():
                raise WorkloadError("empty file (expected a CSV header)", path=path, line=1)
            names = tuple(f.strip().strip('"') for f in header.split(","))
            if names != HEADER:
                raise WorkloadError(
                    f"bad header {header.strip()!r} (expected {','.join(HEADER)})",
                    path=path,
                    line=1,
                )
            for lineno, line in enumerate(fh, start=2):
                if not line.strip():
                    continue
                if limit is not None and len(rows) >= limit:
                    break
                rows.append(_parse_row(line, path, lineno))
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"not UTF-8 text ({exc.reason})", path=path) from None
    except OSError as exc:
        raise WorkloadError(f"cannot read trace ({exc.strerror})", path=path) from None
    if not rows:
        raise WorkloadError("trace has no requests", path=path)
    t0 = min(ts for ts, _, _ in rows)
    sharing.start(sum(c for _, c, _ in rows) / len(rows))
    slo = options.default_class
    return [
        WorkloadRequest(
            id=f"azure-{i}",
            arrival=(ts - t0) / 1e9,
            prompt_tokens=context,
            output_tokens=generated,
            block_hashes=hashes_from_segments(sharing.pieces(context), options.block_size),
            slo=slo,
        )
        for i, (ts, context, generated) in enumerate(rows)
    ]


def _parse_row(line: str, path: str, lineno: int) -> tuple[int, int, int]:
    fields = [f.strip().strip('"') for f in line.split(",")]
    if len(fields) != 3:
        raise WorkloadError(
            f"expected 3 fields (TIMESTAMP,ContextTokens,GeneratedTokens), got {len(fields)}",
            path=path,
            line=lineno,
        )
    try:
        ts = parse_timestamp(fields[0])
    except ValueError as exc:
        raise WorkloadError(str(exc), path=path, line=lineno) from None
    counts: list[int] = []
    for name, raw, minimum in (("ContextTokens", fields[1], 1), ("GeneratedTokens", fields[2], 0)):
        try:
            value = int(raw)
        except ValueError:
            value = -1
        if value < minimum:
            raise WorkloadError(
                f"{name} must be an integer >= {minimum}, got {raw!r}", path=path, line=lineno
            )
        counts.append(value)
    return ts, counts[0], max(1, counts[1])
