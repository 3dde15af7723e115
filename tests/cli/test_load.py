"""``kvgate load`` as a real process against a real gateway and emulated engines on 127.0.0.1."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.cli import main
from tests.e2e.procs import ROOT, Cluster, cluster, free_port

pytestmark = pytest.mark.e2e

SUMMARY = re.compile(r"kvgate load: sent (\d+) in [\d.]+ s \([\d.]+ req/s\), ok (\d+)")
PROGRESS = re.compile(r"^\[\s*[\d.]+ s\] sent \d+  ok \d+  errors \d+  in flight \d+  TTFT p50 ")


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("load"), n=3, time_scale=0.05) as c:
        yield c


def kvgate_load(*args: str, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "load", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def counters(url: str) -> dict[str, float]:
    """The gateway's counter and histogram-count samples, summed over their labels."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name.endswith(("_total", "_count")):
                key = s.name + ("" if s.labels.get("outcome", "ok") == "ok" else ":not_ok")
                out[key] = out.get(key, 0.0) + s.value
    return out


def test_load_drives_the_gateway_and_prints_a_summary(running: Cluster) -> None:
    url = running.gateway.url
    before = counters(url)
    proc = kvgate_load(
        *("--url", url, "--duration", "4", "--rate", "12", "--interval", "1"),
        *("--prefixes", "3", "--prefix-tokens", "256", "--max-tokens", "8", "--seed", "3"),
    )
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert out.splitlines()[0] == (
        f"kvgate load: 12 req/s to {url}, model e2e-model, for 4 s"
    )  # the model came from /v1/models
    assert any(PROGRESS.match(line) for line in out.splitlines()), out
    summary = SUMMARY.search(out)
    assert summary, out
    sent, ok = int(summary.group(1)), int(summary.group(2))
    assert sent >= 20 and ok == sent, out
    assert "  errors 0 (none)" in out
    assert re.search(r"TTFT  p50 [\d.]+ s  p90 [\d.]+ s  p99 [\d.]+ s", out), out
    cached = re.search(r"prompt tokens (\d+), cached (\d+) \((\d+)%\)", out)
    assert cached and int(cached.group(1)) > 0 and int(cached.group(2)) > 0, out  # shared prefixes
    engines = re.search(r"engines  (.*)", out)
    assert engines and engines.group(1).startswith("http://127.0.0.1:"), out
    assert sum(int(n) for n in re.findall(r" (\d+)(?:,|$)", engines.group(1))) == ok

    deadline = time.monotonic() + 10
    while True:  # the gateway counts a request when its response has ended
        after = counters(url)
        moved = after["kvgate_requests_total"] - before.get("kvgate_requests_total", 0.0)
        if moved >= ok or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert moved == ok
    assert after.get("kvgate_requests_total:not_ok", 0.0) == before.get(
        "kvgate_requests_total:not_ok", 0.0
    )
    for name in (
        "kvgate_routing_decisions_total",
        "kvgate_time_to_first_token_seconds_count",
        "kvgate_routed_prompt_tokens_total",
    ):
        assert after[name] > before.get(name, 0.0), name


def test_until_interrupted_then_summary(running: Cluster, tmp_path: Path) -> None:
    log = tmp_path / "load.out"
    args = ["--url", running.gateway.url, "--duration", "0", "--rate", "40", "--interval", "0.5"]
    args += ["--concurrency", "2"]
    with log.open("w") as fh:
        popen = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "load", *args, "--no-stream"],
            cwd=ROOT,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 60
            while "] sent" not in log.read_text() and time.monotonic() < deadline:
                assert popen.poll() is None, log.read_text()
                time.sleep(0.1)
            popen.send_signal(signal.SIGINT)
            assert popen.wait(timeout=40) == 0, log.read_text()
        finally:
            if popen.poll() is None:
                popen.kill()
    out = log.read_text()
    assert "until Ctrl-C" in out.splitlines()[0]
    summary = SUMMARY.search(out)
    assert summary and int(summary.group(2)) == int(summary.group(1)) > 0, out
    assert "TTFT  p50 -" in out  # nothing was streamed
    in_flight = [int(n) for n in re.findall(r"  in flight (\d+)  ", out)]
    assert in_flight and max(in_flight) <= 2, out  # --concurrency caps it


def test_unreachable_url_fails_with_a_clear_message() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    proc = kvgate_load("--url", url, "--duration", "1")
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"kvgate load: error: cannot reach {url}/v1/models: [Errno 111] Connection refused"
    )
    assert proc.stdout == ""


def test_every_request_failing_exits_non_zero() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    proc = kvgate_load("--url", url, "--model", "m", "--duration", "1.5", "--rate", "8")
    assert proc.returncode == 1
    sent = SUMMARY.search(proc.stdout)
    assert sent and int(sent.group(1)) > 0 and sent.group(2) == "0", proc.stdout
    assert f"errors {sent.group(1)} (ConnectError: {sent.group(1)})" in proc.stdout
    assert proc.stderr.strip() == f"kvgate load: error: all {sent.group(1)} requests failed"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--url", "ftp://x"), "--url must start with http:// or https://, got 'ftp://x'"),
        (("--rate", "0"), "--rate is out of range: 0.0"),
        (("--chat", "1.5"), "--chat is out of range: 1.5"),
        (("--duration", "-1"), "--duration is out of range: -1.0"),
    ],
)
def test_bad_flags_are_one_line_errors(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["load", *argv]) == 2
    assert capsys.readouterr().err.strip() == f"kvgate load: error: {message}"


def test_listed_in_kvgate_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert re.search(r"^\s+load\s+send OpenAI traffic", capsys.readouterr().out, re.MULTILINE)
