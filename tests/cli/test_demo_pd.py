"""``kvgate demo --pd`` prints which engine did each leg of its sample requests."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.cli.demo import free_port

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_demo_pd_names_the_engine_of_each_leg(tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    args = ["demo", "--pd", "--engines", "4", "--port", str(free_port()), "--time-scale", "0.05"]
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", *args], cwd=ROOT, stdout=fh, stderr=fh
        )
    try:
        deadline = time.monotonic() + 90
        while "  4. short question" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
        out = log.read_text()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    roles = dict(re.findall(r"(http://127\.0\.0\.1:\d+) \((prefill|decode)\)", out))
    prefills = {u for u, r in roles.items() if r == "prefill"}
    decodes = {u for u, r in roles.items() if r == "decode"}
    assert len(prefills) == len(decodes) == 2, out
    legs = re.findall(r"^  \d\. .+?  prefill (\S+).*? \[(\w+)\]  decode (\S+)$", out, flags=re.M)
    assert len(legs) == 4, out
    (p1, why1, d1), (p2, why2, d2), (p3, why3, d3), (p4, why4, d4) = legs
    assert p1 in prefills and why1 == "remote_long"  # the cold document: prefill pool
    assert p2 in prefills and why2 == "remote_uncached"  # a new system prompt
    assert (p3, why3, d3) == ("local", "local_cached", d2)  # reuse where it was loaded
    assert (p4, why4) == ("local", "local_short")
    assert {d1, d2, d4} <= decodes
