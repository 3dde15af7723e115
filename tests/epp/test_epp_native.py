"""The native front end's own behaviour: found or clearly missing, and its death noticed."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from gateway.core.errors import ConfigError
from gateway.epp.bridge import find_binary
from tests.epp.harness import fleet, picker


def test_a_missing_binary_names_the_build_script(
    frontend: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if frontend != "native":
        pytest.skip("the native front end's")
    monkeypatch.delenv("KVGATE_EPP_FRONT", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(ConfigError, match=r"setup_native\.sh"):
        find_binary(tmp_path / "nowhere")
    built = tmp_path / "kvgate-epp-front"
    built.write_text("#!/bin/sh\n")
    built.chmod(0o755)
    assert find_binary() == built


async def test_a_front_end_that_dies_stops_the_picker(frontend: str) -> None:
    if frontend != "native":
        pytest.skip("the native front end's")
    async with (
        fleet("both") as (transport, urls),
        picker(transport, [{"url": u} for u in urls]) as server,
    ):
        failed = server.failed
        assert failed is not None and not failed.is_set()
        native = server._native
        assert native is not None and native._proc is not None
        os.kill(native._proc.pid, signal.SIGKILL)
        await asyncio.wait_for(failed.wait(), 10)
