"""``kvgate serve``: run the gateway in front of vLLM (or emulated) engines."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path
from typing import Any

from gateway.config import Settings, load_settings
from gateway.core.errors import ConfigError
from gateway.policies.registry import POLICIES, create_policy


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible gateway in front of vLLM engines",
        description=(
            "Route OpenAI requests to vLLM engines. Settings come from --config (YAML), then "
            "KVGATE_* environment variables, then these flags."
        ),
    )
    add_serve_flags(p)
    p.set_defaults(handler=run)


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    add_routing_flags(p)
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8000)")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="run N gateway processes sharing the port (SO_REUSEPORT), each a replica with "
        "the same settings; a supervisor restarts a worker that dies (default 1)",
    )


def add_routing_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the routing service: every front end (``serve``, ``epp``) has them."""
    p.add_argument("--config", metavar="FILE", help="YAML settings file")
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="URL",
        help="an engine's base URL (repeatable); adds to the config's engines",
    )
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help="a prefill-only engine (disaggregated serving; repeatable)",
    )
    p.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL",
        help="a decode-only engine (disaggregated serving; repeatable)",
    )
    p.add_argument("--policy", metavar="NAME", help=f"routing policy ({', '.join(POLICIES)})")
    p.add_argument(
        "--policy-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a knob of the policy, e.g. cache_threshold=0.5",
    )
    p.add_argument("--block-size", type=int, metavar="N", help="engine KV block size (default 16)")
    p.add_argument("--admin-key", metavar="KEY", help="protect /admin routes with this key")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--record",
        metavar="PATH",
        help="record traffic (no prompt text: lengths, arrivals, salted block hashes) to PATH "
        "as Mooncake-format JSONL; replay with kvgate simulate --workload recorded:PATH",
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {
        "host": getattr(args, "host", None),  # kvgate epp's --host/--port are gRPC's
        "port": getattr(args, "port", None),
        "block_size": args.block_size,
        "admin_key": args.admin_key,
        "log_level": args.log_level,
    }
    base = load_settings(args.config)
    added = (
        [{"url": u} for u in args.engine]
        + [{"url": u, "role": "prefill"} for u in args.prefill]
        + [{"url": u, "role": "decode"} for u in args.decode]
    )
    if added:
        overrides["engines"] = [
            {**e.model_dump(), "api_key": e.api_key.get_secret_value() if e.api_key else None}
            for e in base.engines
        ] + added
    if getattr(args, "record", None):
        salt = base.record.salt
        overrides["record"] = {
            **base.record.model_dump(),
            "path": args.record,
            "salt": salt.get_secret_value() if salt is not None else None,
        }
    if args.policy or args.policy_option:
        options = dict(base.policy.options)
        for item in args.policy_option:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ConfigError(f"--policy-option {item!r} must look like KEY=VALUE")
            options[key] = value
        overrides["policy"] = {"name": args.policy or base.policy.name, "options": options}
    settings = load_settings(args.config, **overrides)
    if not settings.engines and settings.discovery.kind == "static":
        raise ConfigError(
            "no engines: pass --engine URL, list engines in --config, or configure discovery"
        )
    roles = {e.role for e in settings.engines} | {s.role for s in settings.discovery.services}
    if "prefill" in roles and not roles & {"decode", "both"}:
        raise ConfigError("prefill engines need at least one decode (or both) engine")
    urls = [e.url for e in settings.engines]
    if len(set(urls)) != len(urls):
        raise ConfigError("an engine URL is listed twice")
    create_policy(settings.policy.name, options=settings.policy.options)  # fail fast on typos
    return settings


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.observability import configure_logging
    from gateway.proxy.app import create_app

    settings = settings_from_args(args)
    workers = getattr(args, "workers", 1)
    if workers < 1:
        raise ConfigError("--workers must be at least 1")
    if workers > 1 and settings.record.path is not None:
        raise ConfigError("--record writes one file from one process: not with --workers")
    if settings.record.path is not None:  # a one-line error now, not a failed startup later
        record = Path(settings.record.path)
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            record.open("ab").close()
        except OSError as exc:
            raise ConfigError(f"cannot record to {record}: {exc.strerror or exc}") from None
    from gateway.cli.http_limits import server_options

    configure_logging(settings.log_level)
    if workers > 1:  # N processes on one port, each a replica (gateway/cli/workers.py)
        from gateway.cli.workers import Supervisor

        return Supervisor(settings, workers).run()
    # uvicorn drains on SIGTERM (stops listening, lets open requests finish within the grace
    # period), then re-raises the signal to the handler it found: this one, so a drained
    # gateway exits 0 instead of dying by the signal.
    previous = signal.signal(signal.SIGTERM, lambda _sig, _frame: None)
    try:
        uvicorn.run(
            create_app(settings),
            host=settings.host,
            port=settings.port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=settings.shutdown_grace_s,
            **server_options(settings.max_header_bytes),  # 431/414/408 for heads; no WebSockets
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
