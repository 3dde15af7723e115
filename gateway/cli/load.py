"""``kvgate load``: Poisson OpenAI traffic whose requests share ``--prefixes`` system prompts (a
few hot, most cold), so prefix caching and kvgate's routing show in the dashboards."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.bench.loadgen import ReplayResult
from gateway.core.errors import ConfigError, KvgateError

_WORDS = ("cache", "prefix", "block", "engine", "route", "token", "batch", "queue", "decode")


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "load",
        help="send OpenAI traffic with shared prefixes to a gateway (load tests, demo traffic)",
        description="Send OpenAI requests with shared system prompts; print progress, summary.",
    )
    for flag, kind, default, meta, text in (
        ("--url", str, "http://127.0.0.1:8000", "URL", "gateway base URL (%(default)s)"),
        ("--rate", float, 2.0, "R", "requests per second, Poisson arrivals (%(default)s)"),
        ("--duration", float, 60.0, "S", "seconds to run; 0 = until Ctrl-C (%(default)s)"),
        ("--model", str, None, "NAME", "model (default: the first of GET /v1/models)"),
        ("--prefixes", int, 8, "N", "shared system prompts, a few hot (%(default)s)"),
        ("--prefix-tokens", int, 512, "N", "system prompt length, ~tokens (%(default)s)"),
        ("--max-tokens", int, 64, "N", "max_tokens of each request (%(default)s)"),
        ("--stream", float, 0.8, "F", "share of streamed requests (%(default)s)"),
        ("--chat", float, 0.5, "F", "share of chat completions (%(default)s)"),
        ("--concurrency", int, 64, "N", "most requests in flight (%(default)s)"),
        ("--api-key", str, os.environ.get("OPENAI_API_KEY"), "KEY", "API key; $OPENAI_API_KEY"),
        ("--interval", float, 5.0, "S", "seconds between progress lines (%(default)s)"),
        ("--seed", int, 0, "N", "seed of prompts and arrivals (%(default)s)"),
    ):
        p.add_argument(flag, type=kind, default=default, metavar=meta, help=text)
    p.add_argument("--no-stream", dest="stream", action="store_const", const=0.0, help="no streams")
    p.set_defaults(handler=run)


@dataclass
class Stats:
    sent: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    engines: Counter[str] = field(default_factory=Counter)
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, r: ReplayResult, usage: dict[str, Any]) -> None:
        if r.error is not None:
            self.errors[r.error] += 1
            return
        self.engines[r.engine or "?"] += 1
        self.ttft += [r.ttft] if r.ttft is not None else []
        self.e2e += [r.e2e] if r.e2e is not None else []
        self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        self.cached_tokens += int(details.get("cached_tokens") or 0)


def pcts(values: list[float], qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> str:
    s = sorted(values)
    return "  ".join(f"p{q * 100:g} " + (f"{s[int(q * len(s))]:.3f} s" if s else "-") for q in qs)


def check(args: argparse.Namespace) -> None:
    if not args.url.startswith(("http://", "https://")):
        raise ConfigError(f"--url must start with http:// or https://, got {args.url!r}")
    positive = ("rate", "prefixes", "prefix_tokens", "max_tokens", "concurrency", "interval")
    bad = [n for n in positive if not getattr(args, n) > 0]
    bad += [n for n in ("stream", "chat") if not 0 <= getattr(args, n) <= 1]
    bad += [] if args.duration >= 0 else ["duration"]
    if bad:
        raise ConfigError(f"--{bad[0].replace('_', '-')} is out of range: {getattr(args, bad[0])}")


def discover_model(url: str, headers: dict[str, str]) -> str:
    try:
        resp = httpx.get(url + "/v1/models", headers=headers, timeout=10.0)
    except httpx.HTTPError as exc:
        raise KvgateError(f"cannot reach {url}/v1/models: {exc or type(exc).__name__}") from None
    if resp.status_code != 200:
        raise KvgateError(f"{url}/v1/models answered HTTP {resp.status_code}: {resp.text[:200]}")
    data = resp.json().get("data") if "json" in resp.headers.get("content-type", "") else None
    models = [m.get("id") for m in data or [] if isinstance(m, dict)]
    if not models or not isinstance(models[0], str):
        raise KvgateError(f"{url} serves no model yet (no healthy engine?); or pass --model")
    return models[0]


def make_request(args: argparse.Namespace, rng: random.Random, n: int) -> Any:
    k = rng.choices(range(args.prefixes), weights=[1 / (i + 1) for i in range(args.prefixes)])[0]
    words = random.Random(k).choices(_WORDS, k=args.prefix_tokens * 2 // 3 + 1)  # ~4 chars/token
    system = f"System prompt {k}. " + " ".join(words)
    user = f"Request {n}: " + " ".join(rng.choices(_WORDS, k=24)) + "?"
    body: dict[str, Any] = {"model": args.model, "max_tokens": args.max_tokens, "stream": False}
    if rng.random() < args.stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if rng.random() < args.chat:
        body["messages"] = [dict(role="system", content=system), dict(role="user", content=user)]
        return "/v1/chat/completions", body
    return "/v1/completions", {**body, "prompt": f"{system}\n\n{user}"}


async def send(client: httpx.AsyncClient, path: str, body: dict[str, Any], stats: Stats) -> None:
    out, usage = ReplayResult(arrival=time.perf_counter()), dict[str, Any]()
    try:
        async with client.stream("POST", path, json=body) as resp:
            out.engine = resp.headers.get("x-kvgate-engine")
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}"
            elif body["stream"]:
                async for line in resp.aiter_lines():
                    chunk = json.loads(line[6:]) if line.startswith("data: {") else {}
                    out.error = "error mid-stream" if "error" in chunk else out.error
                    if chunk.get("choices") and out.ttft is None:
                        out.ttft = time.perf_counter() - out.arrival
                    usage = chunk.get("usage") or usage
            else:
                usage = json.loads(await resp.aread()).get("usage") or {}
        out.e2e = time.perf_counter() - out.arrival
    except Exception as exc:  # whatever went wrong, this request failed
        out.error = type(exc).__name__
    stats.add(out, usage)


async def progress(st: Stats, tasks: set[asyncio.Task[None]], interval: float) -> None:
    start, seen = time.perf_counter(), 0
    while True:
        await asyncio.sleep(interval)
        ttft, seen = pcts(st.ttft[seen:], (0.5, 0.99)), len(st.ttft)
        head = f"[{time.perf_counter() - start:6.1f} s] sent {st.sent}  ok {st.engines.total()}"
        tail = f"errors {st.errors.total()}  in flight {len(tasks)}  TTFT {ttft}"
        print(f"{head}  {tail}", flush=True)


async def generate(args: argparse.Namespace, headers: dict[str, str]) -> tuple[Stats, float]:
    stats, stop, rng = Stats(), asyncio.Event(), random.Random(args.seed)
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    stopped, tasks = asyncio.create_task(stop.wait()), set[asyncio.Task[None]]()
    ticker = asyncio.create_task(progress(stats, tasks, args.interval))
    start = time.perf_counter()
    next_at, end = start + rng.expovariate(args.rate), start + (args.duration or float("inf"))
    limits, timeout = httpx.Limits(max_connections=args.concurrency), httpx.Timeout(300, connect=10)
    client = httpx.AsyncClient(base_url=args.url, headers=headers, timeout=timeout, limits=limits)
    async with client:
        while True:
            await asyncio.wait([stopped], timeout=max(0.0, min(next_at, end) - time.perf_counter()))
            while len(tasks) >= args.concurrency and not stop.is_set():  # at the cap: wait
                await asyncio.wait([*tasks, stopped], return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set() or time.perf_counter() >= end:
                break
            path, body = make_request(args, rng, stats.sent)
            task = asyncio.create_task(send(client, path, body, stats))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            stats.sent += 1
            next_at = max(next_at, time.perf_counter() - 1.0) + rng.expovariate(args.rate)
        elapsed = time.perf_counter() - start
        in_flight = list(tasks)  # let them finish, within reason
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*in_flight), timeout=30.0)
        stats.errors["cancelled at exit"] += sum(t.cancelled() for t in in_flight)
    ticker.cancel()  # asyncio.run cancels `stopped`
    return stats, elapsed


def run(args: argparse.Namespace) -> int:
    check(args)
    args.url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    args.model = args.model or discover_model(args.url, headers)
    until = f"for {args.duration:g} s" if args.duration else "until Ctrl-C"
    print(f"kvgate load: {args.rate:g} req/s to {args.url}, model {args.model}, {until}")
    st, elapsed = asyncio.run(generate(args, headers))
    kinds = ", ".join(f"{k}: {n}" for k, n in st.errors.most_common() if n) or "none"
    rate, ok = st.sent / max(elapsed, 1e-9), st.engines.total()
    print(f"kvgate load: sent {st.sent} in {elapsed:.1f} s ({rate:.2f} req/s), ok {ok}")
    print(f"  errors {st.errors.total()} ({kinds})\n  TTFT  {pcts(st.ttft)}  (streamed requests)")
    share = st.cached_tokens / st.prompt_tokens if st.prompt_tokens else 0.0
    print(f"  E2E   {pcts(st.e2e)}")
    print(f"  prompt tokens {st.prompt_tokens}, cached {st.cached_tokens} ({share:.0%})")
    print("  engines  " + (", ".join(f"{e} {n}" for e, n in sorted(st.engines.items())) or "-"))
    if not st.engines:
        raise KvgateError(f"all {st.sent} requests failed" if st.sent else "nothing was sent")
    return 0
