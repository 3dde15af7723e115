"""``kvgate emulate``: flags, one-line errors and a real process that serves and stops."""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import textwrap

import httpx
import pytest

from gateway.cli import emulate
from gateway.core.errors import ConfigError


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvgate")
    emulate.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["emulate", *argv])


def test_defaults_and_flags() -> None:
    args = parse()
    assert (args.host, args.port, args.log_level) == ("127.0.0.1", 8000, "info")
    settings = emulate.settings_from_args(
        parse("--model", "m", "--time-scale", "0.5", "--kv-blocks", "64", "--max-model-len", "2048")
    )
    assert settings.model == "m" and settings.time_scale == 0.5
    assert settings.kv_capacity_blocks == 64 and settings.max_model_len == 2048
    perf = settings.perf_model()
    assert perf.kv_capacity_blocks == 64 and perf.max_model_len == 2048


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--time-scale", "0"), "--time-scale must be positive"),
        (("--kv-blocks", "-1"), "--kv-blocks must be positive"),
        (("--max-model-len", "0"), "--max-model-len must be positive"),
        (("--port", "70000"), "--port must be in"),
        (("--preset", "no-such-preset"), "unknown preset"),
    ],
)
def test_bad_flags_raise_config_errors(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        emulate.run(parse(*argv))


def test_port_in_use_is_a_config_error() -> None:
    sock = emulate.bind("127.0.0.1", 0)
    try:
        with pytest.raises(ConfigError, match="cannot listen"):
            emulate.bind("127.0.0.1", sock.getsockname()[1])
    finally:
        sock.close()


SCRIPT = textwrap.dedent(
    """
    import argparse, sys
    from gateway.cli import emulate
    parser = argparse.ArgumentParser(prog="kvgate")
    emulate.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(sys.argv[1:])
    sys.exit(args.handler(args))
    """
)


def test_serves_until_interrupted() -> None:
    flags = ["--port", "0", "--model", "m", "--log-level", "warning", "--time-scale", "0.01"]
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, "emulate", *flags],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert match, line
        base = f"http://127.0.0.1:{match.group(1)}"
        with httpx.Client(base_url=base, timeout=5) as http:
            for _ in range(200):
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
            reply = http.post("/v1/completions", json={"model": "m", "prompt": "hi"})
            assert reply.status_code == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
