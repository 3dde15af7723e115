"""Fuzz tests: helpers of tests/proxy (fake engines) and tests/e2e (processes) importable."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]
for _sub in ("proxy", "e2e"):
    if str(_TESTS / _sub) not in sys.path:
        sys.path.insert(0, str(_TESTS / _sub))
