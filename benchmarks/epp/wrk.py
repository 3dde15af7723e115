"""wrk, the load generator of benchmarks/epp: a POST script for a completion, and one run's
requests per second, latency percentiles and failures."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass

from benchmarks.speed.throughput import MODEL, PROMPT

_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1e3}


@dataclass(frozen=True)
class WrkResult:
    rps: float
    p50: float  # ms
    p99: float  # ms
    bad: int  # non-2xx responses and socket errors


def post_script(prompt: str | None) -> str:
    """A wrk Lua script POSTing a one-token completion of ``prompt`` (the short probe of
    ``benchmarks.speed.throughput`` by default)."""
    body = json.dumps({"model": MODEL, "prompt": prompt or PROMPT, "max_tokens": 1})
    assert "]==]" not in body
    return (
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = [==[{body}]==]\n"
    )


def wrk(url: str, seconds: float, script: str | object, connections: int) -> WrkResult:
    """One ``wrk -t1 -cN`` run of ``script`` (a path) against ``url``."""
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--latency", "-s", str(script),
         url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout  # fmt: skip
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    rps = float(m.group(1)) if m else 0.0

    def pct(q: str) -> float:
        found = re.search(rf"^\s+{q}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        return float(found.group(1)) * _UNIT[found.group(2)] if found else float("nan")

    bad = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out):
        bad += int(n)
    return WrkResult(rps, pct("50"), pct("99"), bad)
