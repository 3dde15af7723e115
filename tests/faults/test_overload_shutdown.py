"""Overload (max_in_flight) and graceful shutdown of the strict gateway (a real ``kvgate
serve`` process). The shutdown test ends that gateway: it runs last (file order)."""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
from faultkit import MODEL, Fleet, Gateway, ask, record

pytestmark = pytest.mark.e2e

LONG_STREAM = {
    "model": MODEL,
    "prompt": "a long story",
    "max_tokens": 1200,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}


@dataclass
class Stream:
    """A long streamed completion read in a thread: its events, and whether it ended well."""

    g: Gateway
    started: threading.Event = field(default_factory=threading.Event)
    events: list[str] = field(default_factory=list)
    error: str | None = None
    done: bool = False

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with httpx.stream(
                "POST", self.g.url + "/v1/completions", json=LONG_STREAM, timeout=30
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.started.set()
            self.done = True
        except httpx.HTTPError as exc:
            self.error = repr(exc)
        finally:
            self.started.set()

    def tokens(self) -> int:
        """completion_tokens of the final usage chunk (0 without one)."""
        usage = [json.loads(e).get("usage") for e in self.events if e != "[DONE]"]
        return int((usage[-1] or {}).get("completion_tokens", 0)) if usage else 0


def test_past_max_in_flight_requests_get_503_with_retry_after(fleet: Fleet) -> None:
    fleet.reset(fleet.strict)
    g = fleet.strict
    streams = [Stream(g) for _ in range(3)]
    for s in streams:
        assert s.started.wait(10)
    t0 = time.monotonic()
    over = ask(g)
    assert not over.ok and over.status == 503 and over.retry_after == "1"
    assert "limit of 3" in (over.error or "")
    assert time.monotonic() - t0 < 1.0  # refused at once, not queued
    assert g.metric("kvgate_overload_rejected_total") >= 1
    for s in streams:
        s.thread.join(30)
        assert s.done and s.events[-1] == "[DONE]", s.error
    assert ask(g).ok  # capacity is back
    record("overload (max_in_flight=3)", rejected_within_s=over.seconds, in_flight_completed=3)


def test_sigterm_drains_open_streams_refuses_new_connections_and_exits_0(fleet: Fleet) -> None:
    fleet.reset(fleet.strict)
    g = fleet.strict
    assert g.popen is not None
    streams = [Stream(g) for _ in range(3)]
    for s in streams:
        assert s.started.wait(10) and not s.error
    t0 = time.monotonic()
    g.popen.send_signal(signal.SIGTERM)
    open_at_sigterm = sum(not s.done for s in streams)
    assert open_at_sigterm >= 2  # the streams last about a second
    refused = None
    deadline = t0 + 5
    while time.monotonic() < deadline and refused is None:
        try:
            httpx.get(g.url + "/health", timeout=1)
            time.sleep(0.02)
        except httpx.ConnectError:
            refused = time.monotonic() - t0
        except httpx.HTTPError:  # the listener is closing
            time.sleep(0.02)
    assert refused is not None, "new connections were still accepted after SIGTERM"
    code = g.popen.wait(timeout=20)
    drained = time.monotonic() - t0
    assert code == 0, g.output()[-2000:]
    assert drained < 15  # shutdown_grace_s
    for s in streams:
        s.thread.join(5)
        assert s.done and not s.error, s.error
        assert s.events[-1] == "[DONE]"
        assert s.tokens() == LONG_STREAM["max_tokens"]  # every token, nothing cut
    assert not streams[0].thread.is_alive()
    record(
        "shutdown (SIGTERM)",
        refused_new_after_s=refused,
        exit_code=code,
        exited_after_s=drained,
        streams_open_at_sigterm=open_at_sigterm,
        streams_completed=f"{len(streams)}/{len(streams)}",
    )
