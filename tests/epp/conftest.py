"""Every test here runs against both front ends of ``kvgate epp``: ``python`` (grpc.aio in the
picker) and ``native`` (kvgate-epp-front, C++; ``scripts/setup_native.sh`` builds it and
``scripts/test.sh`` runs that first). The parameter reaches :func:`tests.epp.harness.picker`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.epp import harness


@pytest.fixture(autouse=True, params=["python", "native"])
def frontend(request: pytest.FixtureRequest) -> Iterator[str]:
    harness.FRONTEND = request.param
    try:
        yield request.param
    finally:
        harness.FRONTEND = "python"
