"""The fault suite's fleet: emulated engines with fault switches and kvgate gateways, as real
processes on 127.0.0.1, plus helpers to drive faults, read breaker states and check that no
request was lost or executed twice."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from openai import APIConnectionError, APIError, APIStatusError, OpenAI

from gateway.cli.demo import free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = "fault-model"
LONG = "a prompt long enough to be prefilled on the prefill engine, with its own words " * 8
RESULTS: dict[str, dict[str, Any]] = {}
"""Measured results per fault (printed at the end of the run, see conftest.py)."""

HEALTH = {
    "interval_s": 0.2,
    "timeout_s": 0.5,
    "failure_threshold": 2,
    "recovery_threshold": 1,
    "cooldown_s": 0.5,
    "cooldown_max_s": 2.0,
    "cooldown_jitter": 0.1,
}


@dataclass
class Proc:
    name: str
    port: int
    args: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Proc:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
        env["PYTHONUNBUFFERED"] = "1"
        with self.log.open("ab") as fh:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", *self.args],
                cwd=ROOT,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
            )
        return self

    def wait_ready(self, path: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=1.0) as client:
            while time.monotonic() < deadline:
                assert self.popen is not None
                if self.popen.poll() is not None:
                    raise RuntimeError(f"{self.name} exited early:\n{self.output()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.url + path).status_code == 200:
                        return
                time.sleep(0.05)
        raise RuntimeError(f"{self.name} not ready after {timeout} s:\n{self.output()}")

    def stop(self) -> None:
        p = self.popen
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class Engine(Proc):
    """An emulated vLLM engine started with ``--fault-admin``."""

    def fault(self, spec: str | None, times: int | None = None) -> None:
        r = httpx.post(self.url + "/_faults", json={"fault": spec, "times": times}, timeout=5)
        assert r.status_code == 200, r.text

    def entries(self) -> list[dict[str, Any]]:
        r = httpx.get(self.url + "/_faults/log", timeout=5)
        r.raise_for_status()
        out: list[dict[str, Any]] = r.json()
        return out

    def reset(self) -> None:
        self.fault(None)
        httpx.delete(self.url + "/_faults/log", timeout=5).raise_for_status()


def engine(logdir: Path, index: int, *, time_scale: float = 0.1) -> Engine:
    port = free_port()
    args = ["emulate", "--port", str(port), "--model", MODEL, "--time-scale", str(time_scale)]
    args += ["--seed", str(index), "--fault-admin", "--log-level", "warning"]
    return Engine(f"engine{index}", port, args, logdir / f"engine{index}.log")


class Gateway(Proc):
    def engines(self) -> dict[str, dict[str, Any]]:
        r = httpx.get(self.url + "/admin/engines", timeout=5)
        r.raise_for_status()
        return {e["url"]: e for e in r.json()["engines"]}

    def breaker(self, url: str) -> str:
        state: str = self.engines()[url]["breaker"]
        return state

    def wait_breaker(self, url: str, states: Iterable[str], timeout: float = 10.0) -> float:
        """Seconds until ``url``'s breaker is in one of ``states``; fails after ``timeout``."""
        wanted = set(states)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.breaker(url) in wanted:
                return time.monotonic() - t0
            time.sleep(0.02)
        raise AssertionError(f"{url} breaker not in {wanted} after {timeout} s: {self.engines()}")

    def wait_all_closed(self, timeout: float = 15.0, prompt: str | None = None) -> None:
        """Until every breaker is closed; traffic gives half-open engines their trial."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            engines = self.engines().values()
            if all(e["breaker"] == "closed" and e["routable"] for e in engines):
                return
            if any(e["breaker"] == "half_open" for e in engines):
                ask(self, prompt=f"{time.monotonic_ns()} {prompt}" if prompt else None)
            time.sleep(0.05)
        raise AssertionError(f"engines did not all close: {self.engines()}")

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in (labels or {}).items()):
                total += float(value)
        return total


def gateway(logdir: Path, name: str, config: dict[str, Any], engines: list[str]) -> Gateway:
    port = free_port()
    path = logdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"log_requests": False, **config}))
    args = ["serve", "--port", str(port), "--config", str(path), "--log-level", "warning"]
    for url in engines:
        args += ["--engine", url]
    return Gateway(name, port, args, logdir / f"{name}.log")


@dataclass
class Fleet:
    engines: list[Engine]
    main: Gateway
    """round_robin, breakers with short cooldowns, a generous retry budget."""
    pd: Gateway
    """prefill engine0, decode engine1 and engine2 (the emulators play either leg)."""
    strict: Gateway
    """no breaker trips, a tight retry budget, max_in_flight 3 (overload, shutdown)."""
    procs: list[Proc] = field(default_factory=list)

    def reset(self, *gateways: Gateway) -> None:
        """Clear every fault and log; wait until ``gateways`` route to every engine again."""
        for e in self.engines:
            e.reset()
        for g in gateways:
            g.wait_all_closed(prompt=LONG if g is self.pd else None)

    def completions(
        self, ids: Iterable[str], engines: Iterable[Engine] | None = None
    ) -> dict[str, int]:
        """Per request id: how many engines sent a complete 200 answer."""
        wanted = set(ids)
        counts = dict.fromkeys(wanted, 0)
        for e in engines if engines is not None else self.engines:
            for entry in e.entries():
                if entry["id"] in wanted and entry["status"] == 200 and entry["done"]:
                    counts[entry["id"]] += 1
        return counts

    def attempts(self, ids: Iterable[str], engines: Iterable[Engine] | None = None) -> int:
        wanted = set(ids)
        return sum(
            1
            for e in (engines if engines is not None else self.engines)
            for entry in e.entries()
            if entry["id"] in wanted
        )

    def check_accounting(
        self, outcomes: dict[str, bool], engines: Iterable[Engine] | None = None
    ) -> None:
        """Every request the client got an answer for ran to completion exactly once; every
        failed one never did (nothing lost, nothing executed twice)."""
        counts = self.completions(outcomes, engines)
        for rid, ok in outcomes.items():
            assert counts[rid] == (1 if ok else 0), (rid, ok, counts[rid])


def record(fault: str, **measured: Any) -> None:
    RESULTS.setdefault(fault, {}).update(measured)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


@dataclass
class Outcome:
    rid: str
    ok: bool
    seconds: float
    engine: str | None = None
    status: int | None = None
    error: str | None = None
    retry_after: str | None = None
    chunks: int = 0


_IDS = iter(range(10**9))
_CLIENTS: dict[tuple[str, float], OpenAI] = {}


def client_for(g: Gateway, timeout: float) -> OpenAI:
    """One openai client per gateway and timeout (its connection pool is reused)."""
    key = (g.url, timeout)
    if key not in _CLIENTS:
        _CLIENTS[key] = OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0, timeout=timeout)
    return _CLIENTS[key]


def ask(
    g: Gateway,
    *,
    stream: bool = False,
    max_tokens: int = 8,
    prompt: str | None = None,
    timeout: float = 15.0,
) -> Outcome:
    """One completion through ``g`` with the official openai client and a fresh request id;
    never raises for a failed request, and is bounded by ``timeout``."""
    rid = f"f{os.getpid()}-{next(_IDS)}-{time.monotonic_ns() % 10**9}"
    client = client_for(g, timeout)
    t0 = time.monotonic()
    out = Outcome(rid, ok=False, seconds=0.0)
    try:
        raw = client.completions.with_raw_response.create(
            model=MODEL,
            prompt=prompt or f"request {rid}: tell me something",
            max_tokens=max_tokens,
            stream=stream,
            extra_headers={"X-Request-Id": rid},
        )
        out.engine = raw.headers.get("x-kvgate-engine")
        out.status = raw.status_code
        if stream:
            for chunk in raw.parse():  # type: ignore[union-attr]
                out.chunks += 1 if chunk.choices else 0
        else:
            raw.parse()
        out.ok = True
    except APIStatusError as exc:
        out.status = exc.status_code
        out.error = exc.message
        out.retry_after = exc.response.headers.get("retry-after")
    except APIConnectionError as exc:
        out.error = f"connection: {exc}"
    except APIError as exc:  # an error event in the stream
        out.error = f"stream: {exc.message}"
    out.seconds = time.monotonic() - t0
    return out


class Watch:
    """Polls ``url``'s breaker on ``g`` every 20 ms in a thread: when it first left closed
    (``out_s``) and, after that, when it first was closed again (``back_at``), both
    measured from the start of the watch (``back_at``: a monotonic time)."""

    def __init__(self, g: Gateway, url: str) -> None:
        import threading

        self.g = g
        self.url = url
        self.t0 = time.monotonic()
        self.out_s: float | None = None
        self.back_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self._stop.is_set():
                with contextlib.suppress(httpx.HTTPError, KeyError):
                    engines = client.get(self.g.url + "/admin/engines").json()["engines"]
                    state = next(e["breaker"] for e in engines if e["url"] == self.url)
                    now = time.monotonic()
                    if state != "closed" and self.out_s is None:
                        self.out_s = now - self.t0
                    elif state == "closed" and self.out_s is not None and self.back_at is None:
                        self.back_at = now
                time.sleep(0.02)

    def stop(self) -> Watch:
        self._stop.set()
        self._thread.join(timeout=5)
        return self
