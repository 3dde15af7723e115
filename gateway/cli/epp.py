"""``kvgate epp``: run kvgate as the Endpoint Picker behind Envoy (ext_proc over gRPC)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from pathlib import Path
from typing import Any

from gateway.cli.serve import add_routing_flags, settings_from_args


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "epp",
        help="run as the Endpoint Picker of an Envoy-based Inference Gateway (ext_proc gRPC)",
        description=(
            "Pick the engine of each request Envoy proxies (the Gateway API Inference "
            "Extension's Endpoint Picker protocol over Envoy ext_proc). The routing settings "
            "are kvgate serve's: --config (YAML), then KVGATE_* environment variables, then "
            "these flags."
        ),
    )
    add_routing_flags(p)
    p.add_argument(
        "--host", dest="grpc_host", default="127.0.0.1", help="gRPC listen address (127.0.0.1)"
    )
    p.add_argument(
        "--port", dest="grpc_port", type=int, default=9002, help="gRPC listen port (9002)"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=9090,
        metavar="PORT",
        help="serve Prometheus /metrics on this HTTP port (default 9090; 0: any free port)",
    )
    p.add_argument("--metrics-host", metavar="ADDR", help="/metrics address (default --host)")
    p.add_argument("--cert-path", type=Path, metavar="FILE", help="TLS certificate (PEM)")
    p.add_argument("--key-path", type=Path, metavar="FILE", help="TLS private key (PEM)")
    p.add_argument(
        "--fallbacks",
        type=int,
        default=0,
        metavar="N",
        help="fallback endpoints named after the chosen one, for a data plane that retries "
        "down the list (default 0: Envoy's ORIGINAL_DST cluster takes one address)",
    )
    p.add_argument(
        "--release-after",
        type=float,
        metavar="SECONDS",
        help="release a picked request whose response has not ended after this long "
        "(default: timeouts.read_s)",
    )
    p.add_argument(
        "--frontend",
        choices=["python", "native"],
        default="python",
        help="who speaks ext_proc: python (grpc.aio in this process, the default) or native "
        "(kvgate-epp-front, C++, built by scripts/setup_native.sh; decisions stay here; about "
        "1.4-2.1x the requests per second, docs/performance.md)",
    )
    p.add_argument(
        "--loop",
        choices=["auto", "asyncio", "uvloop"],
        default="auto",
        help="the event loop grpc.aio runs on (auto: uvloop when installed, else asyncio)",
    )
    p.set_defaults(handler=run)


def _loop_factory(name: str) -> Any:
    """The event loop factory for ``--loop`` (None: asyncio's own)."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":
            from gateway.core.errors import ConfigError

            raise ConfigError("--loop uvloop: uvloop is not installed") from None
        return None
    return uvloop.new_event_loop


def options_from_args(args: argparse.Namespace) -> Any:
    from gateway.core.errors import ConfigError
    from gateway.epp.server import EppOptions

    if args.fallbacks < 0:
        raise ConfigError("--fallbacks must be 0 or more")
    if args.release_after is not None and args.release_after <= 0:
        raise ConfigError("--release-after must be positive")
    return EppOptions(
        host=args.grpc_host,
        port=args.grpc_port,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        cert_path=args.cert_path,
        key_path=args.key_path,
        fallbacks=args.fallbacks,
        release_after_s=args.release_after,
        frontend=getattr(args, "frontend", "python"),
    )


def run(args: argparse.Namespace) -> int:
    from gateway.observability import configure_logging

    settings = settings_from_args(args)
    options = options_from_args(args)
    configure_logging(settings.log_level)
    factory = _loop_factory(getattr(args, "loop", "auto"))
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(_serve(settings, options))


async def _serve(settings: Any, options: Any) -> int:
    from gateway.epp.server import EppServer

    server = EppServer(settings, options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        waits = [asyncio.ensure_future(stop.wait())]  # SIGTERM: not ready, drain, exit 0
        if server.failed is not None:  # the native front end died: nothing can route
            waits.append(asyncio.ensure_future(server.failed.wait()))
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        return 1 if server.failed is not None and server.failed.is_set() else 0
    finally:
        await server.stop()
