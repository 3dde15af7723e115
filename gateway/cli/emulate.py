"""``kvgate emulate``: serve one emulated vLLM engine over HTTP (no GPU needed).

The engine is the simulator's :class:`EngineCore` stepped in real time behind a
vLLM-compatible API (see :mod:`gateway.emulator.server`). ``--role`` makes it a
prefill or decode engine of a P/D pair speaking vLLM NixlConnector's
``kv_transfer_params`` (see :mod:`gateway.emulator.pd`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
from typing import Any

from gateway.core.errors import ConfigError
from gateway.emulator.faults import FAULTS, FaultInjector, parse_fault
from gateway.emulator.kv_publisher import KVEventsConfig
from gateway.emulator.lora import parse_lora_modules
from gateway.emulator.pd import ROLES
from gateway.emulator.server import create_emulator_app
from gateway.emulator.state import EmulatorSettings
from gateway.perfmodel.presets import available_presets

_DEFAULTS = EmulatorSettings()
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "emulate",
        help="serve one emulated vLLM engine (OpenAI API, /metrics) driven by the engine model",
        description=(
            "Run a vLLM-compatible HTTP server whose engine is kvgate's performance model in "
            "real time: continuous batching, prefix caching and vLLM's /metrics, no GPU."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, metavar="P", help="port (default 8000)")
    p.add_argument(
        "--model",
        default=_DEFAULTS.model,
        metavar="NAME",
        help=f"served model name (default {_DEFAULTS.model})",
    )
    p.add_argument(
        "--preset",
        default=_DEFAULTS.preset,
        metavar="NAME|FILE",
        help=f"engine performance preset or file (default {_DEFAULTS.preset}; "
        f"known: {', '.join(available_presets())})",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="real seconds per modelled second (0.1 runs 10x faster; default 1)",
    )
    p.add_argument("--seed", type=int, default=0, metavar="N", help="text seed (default 0)")
    p.add_argument(
        "--engine-index",
        default="0",
        metavar="ID",
        help="the `engine` label of the metrics (default 0)",
    )
    p.add_argument(
        "--kv-blocks", type=int, default=None, metavar="N", help="override the KV cache blocks"
    )
    p.add_argument(
        "--max-model-len", type=int, default=None, metavar="N", help="override max_model_len"
    )
    p.add_argument(
        "--priority-groups",
        action="store_true",
        help="admit waiting requests by Preble's cache-hit priority groups instead of FCFS",
    )
    p.add_argument(
        "--role",
        default=_DEFAULTS.role,
        choices=ROLES,
        help="P/D role: prefill legs (do_remote_decode), decode legs (do_remote_prefill) or "
        "both; plain requests are served on every role (default both)",
    )
    p.add_argument(
        "--kv-bandwidth",
        type=float,
        default=_DEFAULTS.kv_bandwidth_gbps,
        metavar="GBPS",
        help="KV transfer bandwidth from prefill engines, GB/s "
        f"(default {_DEFAULTS.kv_bandwidth_gbps:g}; scaled by --time-scale)",
    )
    p.add_argument(
        "--kv-lease",
        type=float,
        default=_DEFAULTS.kv_lease_s,
        metavar="S",
        help="seconds a prefill engine keeps KV no decode engine read "
        f"(default {_DEFAULTS.kv_lease_s:g}, wall clock)",
    )
    p.add_argument(
        "--engine-id",
        default=None,
        metavar="ID",
        help="the NIXL engine id in kv_transfer_params (default: a uuid derived from "
        "host:port and seed)",
    )
    p.add_argument(
        "--fault",
        default=None,
        metavar="NAME[:ARG]",
        help="inject a fault from the start (for fault tests; implies --fault-admin): "
        + "; ".join(f"{name} ({what})" for name, (what, _) in FAULTS.items()),
    )
    p.add_argument(
        "--fault-admin",
        action="store_true",
        help="serve POST/GET /_faults to set and clear faults at run time, and "
        "GET /_faults/log (one entry per generation request); never on a shared network",
    )
    p.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="publish KV cache events as vLLM does (its KVEventsConfig JSON, e.g. "
        '\'{"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:0",'
        '"replay_endpoint":"tcp://127.0.0.1:0"}\'; port 0: a free one; GET /kv_event_sources '
        "tells where)",
    )
    p.add_argument(
        "--prefix-caching-hash-algo",
        default="sha256",
        choices=("sha256", "sha256_cbor"),
        help="block ids of the KV events, as vLLM's flag (default sha256; seeded by "
        "$PYTHONHASHSEED like vLLM)",
    )
    p.add_argument(
        "--runner",
        default="generate",
        choices=("generate", "pooling"),
        help="vLLM's --runner: generate (completions, chat, responses, messages) or pooling "
        "(embeddings, pooling, classify, score, rerank); each serves only its routes",
    )
    p.add_argument(
        "--convert",
        default="embed",
        choices=("embed", "classify"),
        help="the pooling task (vLLM's --convert): embed, or classify (a one-label "
        "cross-encoder); default embed",
    )
    p.add_argument(
        "--transcription",
        action="store_true",
        help="emulate a speech-to-text model: also serve /v1/audio/transcriptions and "
        "/v1/audio/translations (vLLM serves them for Whisper-like models)",
    )
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (vLLM's flag)")
    p.add_argument(
        "--max-loras",
        type=int,
        default=1,
        metavar="N",
        help="distinct adapters one batch holds (vLLM's flag; default 1)",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        metavar="R",
        help="largest adapter rank (vLLM's flag; default 16; accepted, not modelled)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="adapters served from the start (name=path or vLLM's JSON form)",
    )
    p.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM does with "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, which is honoured too)",
    )
    p.add_argument(
        "--responses-store-size",
        type=int,
        default=_DEFAULTS.responses_store_size,
        metavar="N",
        help="stored /v1/responses kept in this process, oldest dropped "
        f"(default {_DEFAULTS.responses_store_size})",
    )
    p.add_argument(
        "--log-level", default="info", choices=LOG_LEVELS, help="uvicorn log level (default info)"
    )
    p.set_defaults(handler=run)


def settings_from_args(args: argparse.Namespace) -> EmulatorSettings:
    """Validated settings for the flags; raises ConfigError."""
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    if not args.time_scale > 0:
        raise ConfigError(f"--time-scale must be positive, got {args.time_scale}")
    for flag in ("kv_blocks", "max_model_len", "kv_bandwidth", "kv_lease"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    if args.role not in ROLES:
        raise ConfigError(f"--role must be one of {', '.join(ROLES)}, got {args.role!r}")
    if args.engine_id is not None and not args.engine_id.strip():
        raise ConfigError("--engine-id must not be empty")
    fault = getattr(args, "fault", None)
    if fault is not None:
        parse_fault(fault)  # a one-line error for a bad spec
    events_json = getattr(args, "kv_events_config", None)
    kv_events = (
        KVEventsConfig.parse(
            events_json,
            hash_algo=getattr(args, "prefix_caching_hash_algo", "sha256"),
            hash_seed=os.environ.get("PYTHONHASHSEED"),
        )
        if events_json
        else None
    )
    lora_modules = parse_lora_modules(getattr(args, "lora_modules", None) or [])
    for flag in ("max_loras", "max_lora_rank", "responses_store_size"):
        value = getattr(args, flag, 1)
        if value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    return EmulatorSettings(
        model=args.model,
        preset=args.preset,
        time_scale=args.time_scale,
        seed=args.seed,
        engine_index=args.engine_index,
        max_model_len=args.max_model_len,
        kv_capacity_blocks=args.kv_blocks,
        priority_groups=args.priority_groups,
        role=args.role,
        kv_bandwidth_gbps=args.kv_bandwidth,
        kv_lease_s=args.kv_lease,
        engine_id=args.engine_id,
        host=args.host,
        port=args.port or None,
        fault=fault,
        fault_admin=bool(getattr(args, "fault_admin", False)),
        kv_events=kv_events,
        runner=getattr(args, "runner", "generate"),
        convert=getattr(args, "convert", "embed"),
        transcription=bool(getattr(args, "transcription", False)),
        enable_lora=bool(getattr(args, "enable_lora", False)),
        max_loras=getattr(args, "max_loras", 1),
        max_lora_rank=getattr(args, "max_lora_rank", 16),
        lora_modules=lora_modules,
        allow_runtime_lora=bool(getattr(args, "allow_runtime_lora", False)),
        responses_store_size=getattr(args, "responses_store_size", _DEFAULTS.responses_store_size),
    )


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); ConfigError when it cannot be had."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError(f"cannot resolve --host {host}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace) -> int:
    import uvicorn

    settings = settings_from_args(args)
    settings.perf_model()  # fail on bad settings before taking the port
    sock = bind(args.host, args.port)
    port = sock.getsockname()[1]
    settings = dataclasses.replace(settings, port=port)  # --port 0: the one bound
    try:
        app = create_emulator_app(settings)
    except BaseException:
        sock.close()
        raise
    print(
        f"kvgate emulate: serving {settings.model!r} on http://{args.host}:{port} "
        f"(preset {settings.preset}, time scale {settings.time_scale}, role {settings.role}, "
        f"runner {settings.runner})",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        lifespan="on",
        timeout_keep_alive=30,
        access_log=args.log_level in ("debug", "info"),
    )
    faults: FaultInjector | None = getattr(app.state, "faults", None)
    if faults is None:
        server = uvicorn.Server(config)
    else:
        from gateway.emulator.listener import FaultServer

        server = FaultServer(config, faults, sock)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on: a normal stop
        pass
    finally:
        sock.close()
    return 0
