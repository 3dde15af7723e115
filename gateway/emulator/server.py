"""The engine emulator: a vLLM-compatible HTTP server driven by :class:`EngineCore`.

``create_emulator_app(settings)`` builds a FastAPI app whose lifespan creates an
:class:`EngineDriver` (the simulator's engine model, stepped in real time), the
fake tokenizer and a Prometheus registry owned by the app. Routes follow vLLM
0.32. The generate runner serves ``/v1/completions`` and ``/v1/chat/completions``
(JSON or SSE, see :mod:`gateway.emulator.generate`), ``/v1/responses`` (+ ``GET
/v1/responses/{id}``, ``POST .../cancel``: :mod:`gateway.emulator.responses`),
``/v1/messages`` and ``/v1/messages/count_tokens`` (:mod:`gateway.emulator.messages`),
and with ``transcription`` ``/v1/audio/transcriptions|translations``
(:mod:`gateway.emulator.audio`); the pooling runner serves the pooling routes of its
task instead (:mod:`gateway.emulator.pooling`); a route the runner lacks answers
FastAPI's ``{"detail": "Not Found"}`` 404, as on vLLM (whose error handler covers
FastAPI's HTTPException, not the router's). LoRA adapters and cache salts:
:mod:`gateway.emulator.lora`. Every runner serves ``/v1/models``, ``/health``, ``/tokenize``,
``/detokenize``, ``/load``, ``/version``, ``/metrics``, ``/kv_event_sources`` and
``POST /reset_prefix_cache`` (KV events: :mod:`gateway.emulator.kv_publisher`). Usage always carries
``prompt_tokens_details.cached_tokens`` (a real vLLM needs
``--enable-prompt-tokens-details`` for that). ``/load`` counts requests in
flight (vLLM does with ``--enable-server-load-tracking``), KV pulls included.
``POST /kvgate/kv_release`` is kvgate's own: decode engines free the prefill
KV they read there (NIXL does that over its side channel). With a fault set
(:mod:`gateway.emulator.faults`) a middleware breaks requests as told and
``/_faults`` switches faults at run time.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.core.errors import KvgateError
from gateway.emulator import audio, faults, generate, lora, messages, pooling, responses
from gateway.emulator.fault_middleware import FaultMiddleware
from gateway.emulator.kv_publisher import reset_prefix_cache
from gateway.emulator.pd import RELEASE_PATH, release_request
from gateway.emulator.protocol import (
    ApiError,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    parse_body,
)
from gateway.emulator.state import EmulatorSettings, StateDep, build_state

__all__ = ["VERSION", "EmulatorSettings", "create_emulator_app"]

VERSION = "0.33.0+kvgate"
router = APIRouter()


@router.get("/v1/models")
async def models(state: StateDep) -> dict[str, Any]:
    name = state.settings.model
    permission = {
        "id": f"modelperm-{name}",
        "object": "model_permission",
        "created": state.created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    card = {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "vllm",
        "root": name,
        "parent": None,
        "max_model_len": state.perf.max_model_len,
        "permission": [permission],
    }
    cards = [card]
    for adapter, path in state.lora.adapters.items():  # vLLM lists adapters after the base
        cards.append({**card, "id": adapter, "root": path, "parent": name, "max_model_len": None})
    return {"object": "list", "data": cards}


@router.get("/health")
async def health(state: StateDep) -> Response:
    return Response(status_code=200 if state.driver.healthy else 503)


@router.post("/tokenize")
async def tokenize(request: Request, state: StateDep) -> dict[str, Any]:
    body = parse_body(await request.body(), TokenizeRequest)
    state.check_model(body.model)
    if body.messages is not None:
        ids = state.tokenizer.encode(generate.chat_prompt(body, body.messages))
    elif body.prompt is not None:
        ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        raise ApiError("Either `prompt` or `messages` is required.", param="prompt")
    strs = [state.tokenizer.token_repr(t) for t in ids] if body.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": state.perf.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


@router.post("/detokenize")
async def detokenize(request: Request, state: StateDep) -> dict[str, Any]:
    body = parse_body(await request.body(), DetokenizeRequest)
    state.check_model(body.model)
    return {"prompt": state.tokenizer.decode(body.tokens)}


@router.get("/load")
async def load(state: StateDep) -> dict[str, int]:
    return {"server_load": state.driver.in_flight + state.kv.in_flight}


@router.post(RELEASE_PATH)
async def kv_release(request: Request, state: StateDep) -> dict[str, bool]:
    """A decode engine read the KV it pulled for ``remote_request_id``: free it."""
    try:
        raw = json.loads(await request.body())
    except ValueError as exc:
        raise ApiError(f"Invalid JSON body: {exc}") from None
    pin_id, engine_id = release_request(raw)
    if engine_id is not None and engine_id != state.engine_id:
        return {"released": False}
    return {"released": state.kv.release(pin_id)}


@router.get("/kv_event_sources")
async def kv_event_sources(state: StateDep) -> dict[str, Any]:
    """Where this engine publishes KV events, per DP rank (empty when it does not)."""
    return state.kv_events.sources() if state.kv_events is not None else {}


@router.post("/reset_prefix_cache")
async def reset_cache(state: StateDep) -> Response:
    """Drop the prefix cache's unused blocks (vLLM serves this in dev mode)."""
    reset_prefix_cache(state.driver.core.pool, state.kv_events)
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": VERSION}


@router.get("/metrics")
async def metrics(state: StateDep) -> Response:
    return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)


async def _on_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, KvgateError) else 500
    body = error_body(exc if isinstance(exc, KvgateError) else ApiError(str(exc), status=500))
    return JSONResponse(body, status_code=status)


def create_emulator_app(settings: EmulatorSettings | None = None) -> FastAPI:
    """A FastAPI app emulating one vLLM engine; raises ConfigError on bad settings."""
    settings = settings or EmulatorSettings()
    perf = settings.perf_model()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = build_state(settings, perf)
        if state.kv_events is not None:
            state.kv_events.start()
        await state.driver.start()
        app.state.emulator = state
        try:
            yield
        finally:
            await state.kv.close()
            await state.driver.stop()
            if state.kv_events is not None:
                await state.kv_events.close()

    app = FastAPI(title="kvgate engine emulator", version=VERSION, lifespan=lifespan)
    app.add_exception_handler(KvgateError, _on_error)
    app.include_router(router)
    if settings.runner == "pooling":  # vLLM registers a runner's routes only
        pooling.attach(app, settings.convert)
    else:
        app.include_router(generate.router)
        app.include_router(responses.router)
        app.include_router(messages.router)
        if settings.transcription:
            app.include_router(audio.router)
    if settings.enable_lora:
        lora.attach(app, allow_runtime=settings.allow_runtime_lora)
    if settings.fault is not None or settings.fault_admin:  # else: not a single extra call
        injector = faults.FaultInjector(
            faults.parse_fault(settings.fault) if settings.fault else None
        )
        app.state.faults = injector
        app.add_middleware(FaultMiddleware, injector=injector)
        app.include_router(faults.router)
    return app
