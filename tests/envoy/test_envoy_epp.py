"""Real Envoy 1.40 -> ``kvgate epp`` -> three emulated engines, in both body modes
(``BUFFERED`` and ``FULL_DUPLEX_STREAMED``), driven by the official ``openai`` client:
completions and chat, streamed and not, prefix affinity (the same long prefix lands on one
engine), with each engine's own request counter as the witness of where a request went; then
the faults, last because they change the stack: the picker restarted (Envoy's failure mode,
FailClose: requests fail while it is down, succeed once it is back) and an engine killed
mid-run (requests keep succeeding: the picker stops choosing it)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from openai import APIStatusError, OpenAI

from gateway.cli.demo import free_port
from tests.e2e.procs import MODEL, Proc, start_emulator, wait_for
from tests.envoy.rig import FRONTENDS, MODES, Envoy, start_envoy, start_epp, wait
from tests.promtext import sample_sum

pytestmark = [pytest.mark.envoy, pytest.mark.e2e]

EPP_FLAGS: list[str] = ["--fallbacks", "0"]
PREFIX = "kvgate envoy tier shared system prompt: answer tersely, cite nothing. " * 40


@dataclass
class Stack:
    mode: str
    engines: list[Proc]
    epp: Proc
    envoy: Envoy
    config: Path | None = None
    frontend: str = "python"

    @property
    def flags(self) -> list[str]:
        return ["--log-level", "warning", "--frontend", self.frontend, *EPP_FLAGS]

    def client(self, retries: int = 0) -> OpenAI:
        return OpenAI(
            base_url=self.envoy.url + "/v1", api_key="unused", max_retries=retries, timeout=60
        )

    def served(self) -> list[int]:
        """Requests each engine finished, from its own /metrics."""
        out = []
        with httpx.Client(timeout=5) as client:
            for e in self.engines:
                text = client.get(e.url + "/metrics").text
                out.append(int(sample_sum(text, "vllm:request_success_total")))
        return out

    def stop(self) -> None:
        for p in [self.envoy.proc, self.epp, *self.engines]:
            p.stop()


def start_stack(
    logdir: Path,
    mode: str,
    n: int = 3,
    *,
    policy: str = "cache_aware",
    settings: Any = None,
    frontend: str = "python",
) -> Stack:
    """``n`` engines, ``kvgate epp`` (``settings``: its YAML config) and Envoy, all ready
    (started side by side: each Python process takes seconds to import on a loaded machine)."""
    config = None
    if settings is not None:
        config = logdir / "epp.yaml"
        config.write_text(yaml.safe_dump(settings), encoding="utf-8")
    procs: list[Proc] = []
    try:
        ports = [free_port() for _ in range(n)]
        engines = [start_emulator(logdir, i, port=ports[i], wait=False) for i in range(n)]
        procs += engines
        epp, grpc_port = start_epp(logdir, [f"http://127.0.0.1:{p}" for p in ports],
                                   policy=policy, config=config,
                                   extra=["--log-level", "warning", "--frontend", frontend,
                                          *EPP_FLAGS])  # fmt: skip
        procs.append(epp)
        envoy = start_envoy(logdir, mode, grpc_port)
        procs.append(envoy.proc)
        for e in engines:
            wait_for(e, "/health", timeout=300)
        wait(envoy.epp_healthy, 300, "Envoy sees the picker healthy", epp)
        return Stack(mode, engines, epp, envoy, config, frontend)
    except BaseException:
        for p in procs:
            p.stop()
        raise


@pytest.fixture(
    scope="module",
    params=[(m, f) for m in sorted(MODES) for f in FRONTENDS],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    # probes every 0.2 s, out after one failure: a killed engine is noticed at once
    quick = {"health": {"interval_s": 0.2, "failure_threshold": 1}}
    mode, frontend = request.param
    s = start_stack(tmp_path_factory.mktemp(f"envoy-{mode}-{frontend}"), mode,
                    settings=quick, frontend=frontend)  # fmt: skip
    try:
        yield s
    finally:
        s.stop()


def test_completions_through_envoy(stack: Stack) -> None:
    oa = stack.client()
    before = sum(stack.served())
    r = oa.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    assert r.choices[0].text and r.usage is not None and r.usage.completion_tokens == 8
    pieces = list(
        oa.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, stream=True)
    )
    assert "".join(p.choices[0].text for p in pieces if p.choices) == r.choices[0].text
    assert sum(stack.served()) == before + 2  # both reached an engine, once each


def test_chat_through_envoy(stack: Stack) -> None:
    oa = stack.client()
    msgs = [{"role": "user", "content": "Say something."}]
    r = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12)  # type: ignore[arg-type]
    assert r.choices[0].message.content and r.usage is not None
    chunks = list(
        oa.chat.completions.create(
            model=MODEL,
            messages=msgs,  # type: ignore[arg-type]
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content  # the emulator is deterministic
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_a_shared_prefix_stays_on_one_engine(stack: Stack) -> None:
    oa = stack.client()
    for group in ("alpha", "beta"):
        before = stack.served()
        for i in range(6):
            stream = i % 2 == 1
            prompt = f"{PREFIX} [{group}] question {i}: what comes next?"
            if stream:
                list(oa.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=True))
            else:
                oa.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        after = stack.served()
        moved = [b - a for a, b in zip(before, after, strict=True)]
        assert sorted(moved) == [0, 0, 6], f"{group}: engines served {moved}"


def test_an_unknown_model_is_refused_by_the_picker_path(stack: Stack) -> None:
    """A request no engine can serve does not reach an engine."""
    before = stack.served()
    with httpx.Client(timeout=30) as client:
        r = client.post(
            stack.envoy.url + "/v1/completions",
            json={"model": "no-such-model", "prompt": "hi", "max_tokens": 1},
        )
    assert 400 <= r.status_code < 600
    assert stack.served() == before


def complete(oa: OpenAI, i: int) -> bool:
    try:
        r = oa.completions.create(model=MODEL, prompt=f"fault probe {i} " * 8, max_tokens=16)
    except APIStatusError:
        return False
    return bool(r.choices[0].text)


def test_the_picker_restarted(stack: Stack, tmp_path: Path) -> None:
    oa = stack.client()
    assert all(complete(oa, i) for i in range(3))
    stack.epp.stop()
    # FailClose: without its picker Envoy answers 5xx, and no engine is reached
    before = stack.served()
    with httpx.Client(timeout=30) as client:
        r = client.post(stack.envoy.url + "/v1/completions",
                        json={"model": MODEL, "prompt": "down", "max_tokens": 1})  # fmt: skip
    assert r.status_code >= 500, r.text
    assert stack.served() == before
    # Envoy's own gRPC health check sees it gone (so "healthy" below is the new process)
    wait(lambda: not stack.envoy.epp_healthy(), 60, "Envoy marks the picker unhealthy")
    stack.epp, _ = start_epp(tmp_path, [e.url for e in stack.engines], port=stack.envoy.epp_port,
                             config=stack.config, name="epp-again",
                             extra=stack.flags)  # fmt: skip
    wait(stack.envoy.epp_healthy, 300, "Envoy sees the restarted picker healthy", stack.epp)
    assert all(complete(oa, 10 + i) for i in range(8))
    assert sum(stack.served()) == sum(before) + 8


def test_an_engine_lost_mid_run(stack: Stack) -> None:
    victim = stack.engines[0]
    # Killed while requests are in flight; the client retries a 5xx as the openai client does
    # by default, and the picker must stop choosing the dead engine.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(complete, stack.client(retries=2), i) for i in range(24)]
        wait(lambda: sum(f.done() for f in futures) >= 2, 60, "two requests served")
        victim.kill()
        results = [f.result() for f in futures]
    assert all(results), f"{results.count(False)} of {len(results)} failed"
    # Once it has noticed, no request goes there: none needs a retry.
    strict = stack.client(retries=0)
    assert all(complete(strict, 100 + i) for i in range(12))
