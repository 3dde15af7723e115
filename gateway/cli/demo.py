"""``kvgate demo``: emulated engines and the gateway on 127.0.0.1, in one command."""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

from gateway.config import DEFAULT_POLICY
from gateway.core.errors import ConfigError, KvgateError
from gateway.policies.registry import POLICIES, create_policy


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "demo",
        help="start emulated vLLM engines and the gateway on 127.0.0.1 (Ctrl-C stops all)",
        description=(
            "Start N emulated vLLM engines (kvgate emulate) and the gateway in front of them, "
            "print how to talk to it, and run until Ctrl-C."
        ),
    )
    p.add_argument("--engines", type=int, default=3, metavar="N", help="emulated engines (3)")
    p.add_argument("--policy", default=DEFAULT_POLICY, help=f"one of {', '.join(POLICIES)}")
    p.add_argument("--port", type=int, default=8000, help="gateway port (8000)")
    p.add_argument("--model", default="kvgate-demo", help="served model name")
    p.add_argument("--preset", default="llama3-8b-h100", help="engine performance preset")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="engine time multiplier (0.1 = ten times faster than the preset)",
    )
    p.add_argument(
        "--pd",
        action="store_true",
        help="disaggregated serving: half the engines prefill, half decode (vLLM NIXL flow)",
    )
    p.add_argument(
        "--no-samples",
        dest="samples",
        action="store_false",
        help="with --pd: do not send the sample requests (which print where each leg ran)",
    )
    p.add_argument(
        "--priority-groups",
        action="store_true",
        help="engines admit by Preble's cache-hit priority groups (pairs with --policy preble)",
    )
    p.set_defaults(handler=run)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_healthy(urls: list[str], procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(urls)
    with httpx.Client(timeout=1.0) as client:
        while pending:
            for proc in procs:
                if proc.poll() is not None:
                    raise KvgateError(f"an emulated engine exited early (code {proc.returncode})")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(pending[0] + "/health").status_code == 200:
                    pending.pop(0)
                    continue
            if time.monotonic() > deadline:
                raise KvgateError(f"engine {pending[0]} did not become healthy in {timeout:.0f} s")
            time.sleep(0.1)


def adapters(model: str) -> list[str]:
    """The demo's LoRA adapters (name=path), served by every generate engine."""
    return [f"{model}-lora-{x}=/adapters/{model}-lora-{x}" for x in ("a", "b")]


def banner(
    port: int,
    model: str,
    urls: list[str],
    policy: str,
    roles: list[str] | None,
    *,
    embed_url: str | None = None,
) -> str:
    base = f"http://127.0.0.1:{port}"
    if roles is None:
        listing, mode = " ".join(urls), ""
    else:
        listing = " ".join(f"{u} ({r})" for u, r in zip(urls, roles, strict=True))
        mode = ", disaggregated prefill/decode"
    lora = ", ".join(a.split("=")[0] for a in adapters(model))
    embed = f"\n  embedding {embed_url} (model {model}-embed, pooling runner)" if embed_url else ""
    return f"""
kvgate demo: {len(urls)} emulated engines behind the gateway, policy {policy}{mode}
  gateway   {base}/v1   (metrics {base}/metrics, engines {base}/admin/engines)
  engines   {listing}
  models    {model}, LoRA adapters {lora}{embed}

Try it:
  curl -s {base}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  python - <<'PY'
  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key="none")
  stream = client.chat.completions.create(
      model="{model}", stream=True,
      messages=[{{"role": "user", "content": "Tell me about KV caches"}}])
  for chunk in stream:
      print(chunk.choices[0].delta.content or "", end="", flush=True)
  print()
  first = client.responses.create(model="{model}", input="Hi!")       # Responses API
  second = client.responses.create(model="{model}", input="And?",     # same engine
                                   previous_response_id=first.id)
  print(second.output_text)
  print(len(client.embeddings.create(model="{model}-embed", input="kv").data[0].embedding))
  PY

  python - <<'PY'
  import anthropic                                    # Anthropic Messages API
  client = anthropic.Anthropic(base_url="{base}", api_key="none")
  msg = client.messages.create(model="{model}-lora-a", max_tokens=32,
                               messages=[{{"role": "user", "content": "Hello!"}}])
  print(msg.content[0].text)
  PY

Press Ctrl-C to stop everything.
"""


def _samples_in_background(base: str, urls: list[str], roles: list[str], model: str) -> None:
    """--pd: once the gateway is up, send sample requests and print each one's legs."""
    import threading

    from gateway.cli.demo_pd import print_samples_when_ready

    prefills = [u for u, r in zip(urls, roles, strict=True) if r == "prefill"]
    decodes = [u for u, r in zip(urls, roles, strict=True) if r == "decode"]
    threading.Thread(
        target=print_samples_when_ready,
        args=(base, prefills, decodes, model, lambda text: print(text, flush=True)),
        name="kvgate-demo-samples",
        daemon=True,
    ).start()


def emulator(port: int, model: str, time_scale: float, *extra: str) -> subprocess.Popen[bytes]:
    """One ``kvgate emulate`` process on ``port`` serving ``model`` (quiet logs)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "emulate",
            "--port",
            str(port),
            "--model",
            model,
            "--time-scale",
            str(time_scale),
            "--log-level",
            "warning",
            *extra,
        ]
    )


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.engines <= 64:
        raise ConfigError("--engines must be between 1 and 64")
    if not args.time_scale > 0:
        raise ConfigError("--time-scale must be positive")
    create_policy(args.policy)
    import uvicorn

    from gateway.config import load_settings
    from gateway.observability import configure_logging
    from gateway.proxy.app import create_app

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", args.port))
        except OSError:
            raise ConfigError(f"port {args.port} is in use; pick another with --port") from None
    if args.pd and args.engines < 2:
        raise ConfigError("--pd needs at least 2 engines (one prefill, one decode)")
    n_prefill = max(1, args.engines // 2)
    roles = ["prefill" if i < n_prefill else "decode" for i in range(args.engines)]
    procs: list[subprocess.Popen[bytes]] = []
    urls: list[str] = []
    try:
        for i in range(args.engines):
            port = free_port()
            urls.append(f"http://127.0.0.1:{port}")
            procs.append(
                emulator(
                    port,
                    args.model,
                    args.time_scale,
                    "--preset",
                    args.preset,
                    "--seed",
                    str(i),
                    *(["--priority-groups"] if args.priority_groups else []),
                    *(["--role", roles[i]] if args.pd else []),
                    "--enable-lora",
                    "--max-loras",
                    "2",
                    "--lora-modules",
                    *adapters(args.model),
                )
            )
        embed_port = free_port()
        embed_url = f"http://127.0.0.1:{embed_port}"
        procs.append(
            emulator(embed_port, f"{args.model}-embed", args.time_scale, "--runner", "pooling")
        )
        wait_healthy([*urls, embed_url], procs, timeout=60)
        settings = load_settings(
            engines=[
                *({"url": u, "role": roles[i] if args.pd else "both"} for i, u in enumerate(urls)),
                {"url": embed_url},
            ],
            policy={"name": args.policy},
            port=args.port,
            log_requests=False,
            preset=args.preset,
        )
        configure_logging("warning")
        print(
            banner(
                args.port,
                args.model,
                urls,
                args.policy,
                roles if args.pd else None,
                embed_url=embed_url,
            ),
            flush=True,
        )
        if args.pd and args.samples:
            _samples_in_background(f"http://127.0.0.1:{args.port}", urls, roles, args.model)
        uvicorn.run(
            create_app(settings),
            host="127.0.0.1",
            port=args.port,
            log_level="warning",
            access_log=False,
        )
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        print("kvgate demo: stopped", flush=True)
    return 0
