"""``kvgate calibrate`` against a real ``kvgate emulate`` process recovers the emulator's model.

The emulator runs llama3-8b-h100 at ``--time-scale 10``: every step takes ten
times its modelled duration, so the true constants are the preset's × 10 and
the few milliseconds of HTTP and Python overhead per request are small next to
them (a = 50 ms, e0 = 75 ms). Probing uses prompts up to 2048 tokens
(``--max-batched-tokens 2048``) and two rounds to keep the run near 40 s.

Tolerances: ``b`` (per prompt token) and ``e0`` (per decode step) dominate the
measured times and must be within 10 %. ``a`` absorbs the emulator's own
per-request overhead beyond the HTTP floor (tokenizing, hashing, waking the
engine task: ~2-5 ms of 50 ms), hence 25 %. ``d`` is a large signal at 4096
cached tokens (80 ms of 730 ms), ±30 %. ``c`` is worth only 2 ms at the largest
context, less than that overhead (which also grows with prompt length), so it
is bounded in milliseconds; ``e1``/``e2`` (under 5 ms over the whole probe
range) are judged by the step times they predict.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.calibrate.client import EngineClient, EngineFacts
from gateway.calibrate.probes import Probe, ProbePlan, Runner
from gateway.cli import calibrate
from gateway.cli.demo import free_port
from gateway.core.errors import ConfigError
from gateway.perfmodel.presets import load_preset

# serial: the fit reads the emulator's wall-clock timings (an 8-token prefill measured 18 %
# slow beside another pytest-xdist worker), so it runs with the cores to itself
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[2]
SCALE = 10.0
PRESET = "llama3-8b-h100"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("emu") / "emulate.log"
    argv = ["emulate", "--port", str(port), "--preset", PRESET, "--time-scale", str(SCALE)]
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", *argv, "--log-level", "warning"],
            cwd=ROOT,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "emulator did not start"
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvgate")
    calibrate.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["calibrate", *argv])


@pytest.mark.slow
def test_calibration_recovers_the_emulated_model(
    emulator: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "emu.yaml"
    flags = ["--base-preset", PRESET, "--max-batched-tokens", "2048", "--repeats", "2"]
    args = parse("--target", emulator, "--out", str(out), *flags, "--max-seconds", "70")
    started = time.monotonic()
    assert calibrate.run(args) == 0
    took = time.monotonic() - started
    text = capsys.readouterr()
    sys.stderr.write(text.out + f"calibration took {took:.1f} s\n")
    assert "probe  1/19 prefill cold" in text.err and "decode fit:" in text.out
    fitted = load_preset(str(out))
    true = load_preset(PRESET)

    def rel(name: str) -> float:
        want = getattr(true, name) * SCALE
        return float(abs(getattr(fitted, name) - want) / want)

    assert rel("prefill_b") < 0.10
    assert rel("decode_e0") < 0.10
    assert rel("prefill_a") < 0.25
    assert rel("prefill_d") < 0.30
    # c: under 10 ms at the largest probed context (the smallest TTFT there is ~100 ms)
    assert abs(fitted.prefill_c - true.prefill_c * SCALE) * 4096 < 10.0
    # together, the prefill terms predict every probed point within 10 %: the emulator adds
    # a few ms of its own per request, which the fit rightly charges to a and c
    probed = [(e, 0) for e in (8, 32, 128, 512, 1024, 1843)]
    probed += [(e, x) for e in (128, 512, 1843) for x in (1024, 4096)]
    for e, x in probed:
        want = true.prefill_time(e, x) * SCALE
        assert fitted.prefill_time(e, x) == pytest.approx(want, rel=0.10), (e, x)
    # decode steps are timed on the engine's own clock: predictions within 5 %
    for bs in (1, 4, 16):
        for ctx in (bs * 40, bs * 2048):
            want = true.decode_step_time(bs, ctx) * SCALE
            assert fitted.decode_step_time(bs, ctx) == pytest.approx(want, rel=0.05), (bs, ctx)
    assert fitted.max_num_batched_tokens == 2048 and fitted.max_model_len == true.max_model_len
    assert fitted.kv_capacity_blocks == true.kv_capacity_blocks  # read from /metrics
    assert emulator in fitted.description and fitted.sources[0].startswith("kvgate calibrate")


def test_too_small_a_budget_is_a_one_line_error(emulator: str, tmp_path: Path) -> None:
    args = parse("--target", emulator, "--out", str(tmp_path / "p.yaml"), "--max-seconds", "0.5",
                 "--base-preset", PRESET, "--quiet")  # fmt: skip
    with pytest.raises(ConfigError, match=r"no usable (prefill|decode) measurements") as info:
        calibrate.run(args)
    assert "\n" not in info.value.message and not (tmp_path / "p.yaml").exists()


def test_an_unknown_model_is_an_error(emulator: str, tmp_path: Path) -> None:
    args = parse("--target", emulator, "--out", str(tmp_path / "p.yaml"), "--model", "nope")
    with pytest.raises(ConfigError, match="does not serve model 'nope'"):
        calibrate.run(args)


CLI_SCRIPT = """
import argparse, sys
from gateway.cli import calibrate
from gateway.core.errors import KvgateError

parser = argparse.ArgumentParser(prog="kvgate")
calibrate.register(parser.add_subparsers(dest="command"))
try:
    sys.exit(calibrate.run(parser.parse_args(["calibrate", *sys.argv[1:]])))
except KvgateError as exc:
    print("kvgate calibrate: error:", exc.message, file=sys.stderr)
    sys.exit(exc.exit_code)
"""


def test_an_unreachable_target_exits_2(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    argv = ["--target", url, "--out", str(tmp_path / "p.yaml")]
    proc = subprocess.run(
        [sys.executable, "-c", CLI_SCRIPT, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"kvgate calibrate: error: cannot reach {url}")
    assert proc.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--target", "localhost:8000"), "--target must be an http"),
        (("--max-seconds", "0"), "--max-seconds must be positive"),
        (("--repeats", "0"), "--repeats must be positive"),
        (("--out", "p.json"), "--out must name a .yaml"),
        (("--out", "/no/such/dir/p.yaml"), "--out directory does not exist"),
        (("--base-preset", "nope"), "unknown preset"),
    ],
)
def test_bad_flags(argv: tuple[str, ...], message: str) -> None:
    base = {"--target": "http://127.0.0.1:9", "--out": "p.yaml"}
    pairs = dict(zip(argv[::2], argv[1::2], strict=True))
    flat = [item for pair in {**base, **pairs}.items() for item in pair]
    with pytest.raises(ConfigError, match=message):
        calibrate.run(parse(*flat))


async def test_engine_errors_become_one_line_config_errors() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            body = {"error": {"message": "CUDA out of memory\nsecond line", "code": 500}}
            return httpx.Response(500, json=body)
        if request.url.path == "/tokenize":
            return httpx.Response(404)
        sse = 'data: {"error": {"message": "engine died"}}\n\ndata: [DONE]\n\n'
        return httpx.Response(200, text=sse)

    transport = httpx.MockTransport(answer)
    async with EngineClient("http://gpu:8000/", transport=transport) as client:
        assert await client.count_tokens("hello") is None
        with pytest.raises(ConfigError) as info:
            await client.complete("hello", 1)
        assert info.value.message == (
            "http://gpu:8000/v1/completions answered HTTP 500: CUDA out of memory second line"
        )
    sse_only = httpx.MockTransport(
        lambda r: httpx.Response(200, text='data: {"error": {"message": "engine died"}}\n\n')
    )
    async with EngineClient("http://gpu:8000", transport=sse_only) as client:
        with pytest.raises(ConfigError, match="streamed an error: engine died"):
            await client.complete("hello", 1)


async def test_a_failing_decode_stream_is_one_config_error() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "overloaded"}})

    transport = httpx.MockTransport(answer)
    async with EngineClient("http://gpu:8000", transport=transport) as client:
        plan = ProbePlan.default(2048, 8192, repeats=1)
        runner = Runner(
            client, plan, EngineFacts("m"), block_size=16, budget_s=10.0, say=lambda _: None
        )
        with pytest.raises(ConfigError, match="answered HTTP 503: overloaded"):
            await runner._decode_point(Probe("decode", 32, streams=4))
