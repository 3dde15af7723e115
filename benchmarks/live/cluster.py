"""Processes of the live routing benchmark: emulated engines, the router under test, metrics.

Engines are ``kvgate emulate`` processes on free 127.0.0.1 ports (started together, then
waited for); the router is ``kvgate serve --policy NAME`` or an external command. Every run
gets fresh engines, so each starts with empty prefix caches. What the engines did is read from
their own Prometheus series (``vllm:*``), never from the router.
"""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import cpu_seconds
from tests.e2e.procs import MODEL, Proc, free_port, start, wait_for

__all__ = ["MODEL", "EngineCounts", "Fleet", "fleet", "scrape"]


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """How every emulated engine of a run is started."""

    preset: str
    time_scale: float
    kv_blocks: int | None = None

    def args(self) -> list[str]:
        out = ["--preset", self.preset, "--log-level", "warning"]
        return out + (["--kv-blocks", str(self.kv_blocks)] if self.kv_blocks else [])


@dataclass(slots=True)
class EngineCounts:
    """One engine's counters, from its own ``/metrics``."""

    queries: float = 0.0
    hits: float = 0.0
    finished: float = 0.0
    preemptions: float = 0.0
    ttft_sum: float = 0.0
    """Sum of the engine's own TTFTs (model seconds: its histogram's ``_sum``)."""
    ttft_count: float = 0.0
    gpu_blocks: int = 0

    def minus(self, before: EngineCounts) -> EngineCounts:
        return EngineCounts(
            self.queries - before.queries,
            self.hits - before.hits,
            self.finished - before.finished,
            self.preemptions - before.preemptions,
            self.ttft_sum - before.ttft_sum,
            self.ttft_count - before.ttft_count,
            self.gpu_blocks,
        )


_COUNTERS = {
    "vllm:prefix_cache_queries": "queries",
    "vllm:prefix_cache_hits": "hits",
    "vllm:request_success": "finished",
    "vllm:num_preemptions": "preemptions",
}


def parse_counts(text: str) -> EngineCounts:
    """The counters of one engine's Prometheus exposition (``_total`` samples summed)."""
    out = EngineCounts()
    for family in text_string_to_metric_families(text):
        attr = _COUNTERS.get(family.name)
        for sample in family.samples:
            if attr and sample.name.endswith("_total"):
                setattr(out, attr, getattr(out, attr) + sample.value)
            elif sample.name == "vllm:time_to_first_token_seconds_sum":
                out.ttft_sum += sample.value
            elif sample.name == "vllm:time_to_first_token_seconds_count":
                out.ttft_count += sample.value
            elif sample.name == "vllm:cache_config_info":
                out.gpu_blocks = int(sample.labels.get("num_gpu_blocks", "0"))
    return out


def scrape(urls: Sequence[str]) -> list[EngineCounts]:
    with httpx.Client(timeout=10.0) as client:
        return [parse_counts(client.get(url + "/metrics").text) for url in urls]


@dataclass
class Fleet:
    """Running engines and the router in front of them."""

    engines: list[Proc]
    router: Proc
    logdir: Path

    @property
    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU seconds used so far by (the router, all engines)."""
        return cpu_seconds(self.router.popen.pid), sum(
            cpu_seconds(e.popen.pid) for e in self.engines
        )


def start_engines(logdir: Path, n: int, spec: EngineSpec) -> list[Proc]:
    """``n`` emulators started at once, returned when all answer ``/health``."""
    logdir.mkdir(parents=True, exist_ok=True)
    procs = []
    for i in range(n):
        port = free_port()
        args = ["emulate", "--port", str(port), "--model", MODEL, "--seed", str(i)]
        args += ["--engine-index", str(i), "--time-scale", str(spec.time_scale), *spec.args()]
        procs.append(start(args, f"engine{i}", port, logdir))
    try:
        for p in procs:
            wait_for(p, "/health", timeout=60.0)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def start_kvgate(
    logdir: Path, engines: Sequence[str], policy: str, options: Sequence[str] = ()
) -> Proc:
    """``kvgate serve --policy policy``, returned once every engine is routable."""
    port = free_port()
    args = ["serve", "--port", str(port), "--policy", policy, "--log-level", "warning"]
    for item in options:
        args += ["--policy-option", item]
    for url in engines:
        args += ["--engine", url]
    proc = start(args, f"kvgate-{policy}", port, logdir)
    deadline = time.monotonic() + 60.0
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"kvgate serve exited early:\n{proc.output()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                resp = client.get(proc.url + "/ready")
                if resp.status_code == 200 and resp.json()["healthy_engines"] == len(engines):
                    return proc
            time.sleep(0.1)
    proc.stop()
    raise RuntimeError(f"kvgate serve not ready with {len(engines)} engines after 60 s")


def start_external(logdir: Path, engines: Sequence[str], template: str) -> Proc:
    """An external router from a command template.

    Placeholders: ``{port}`` (a free port), ``{workers}`` (engine URLs, space-separated,
    each a separate argument) and ``{workers_csv}``. Ready once ``/v1/models`` answers 200.
    """
    port = free_port()
    argv: list[str] = []
    for word in shlex.split(template):
        if word == "{workers}":
            argv += list(engines)
        else:
            argv.append(word.format(port=port, workers_csv=",".join(engines)))
    log = logdir / "external.log"
    with log.open("wb") as fh:
        popen = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT)
    proc = Proc("external", f"http://127.0.0.1:{port}", popen, log)
    wait_for(proc, "/v1/models", timeout=60.0)
    return proc


@contextlib.contextmanager
def fleet(
    logdir: Path,
    n: int,
    spec: EngineSpec,
    *,
    policy: str | None,
    external: str | None,
    options: Sequence[str] = (),
) -> Iterator[Fleet]:
    """Fresh engines (cold caches) and a router; everything stopped on exit."""
    engines = start_engines(logdir, n, spec)
    router: Proc | None = None
    try:
        urls = [e.url for e in engines]
        if external is not None:
            router = start_external(logdir, urls, external)
        else:
            router = start_kvgate(logdir, urls, policy or "", options)
        yield Fleet(engines, router, logdir)
    finally:
        for p in [router, *engines]:
            if p is not None:
                p.stop()
