"""Health, readiness, metrics and runtime engine membership."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError

from gateway.cluster.discovery import RegistryMembership
from gateway.cluster.registry import EngineState
from gateway.config import EngineConfig
from gateway.core.types import EngineRole
from gateway.proxy.deps import get_state, read_body, require_admin
from gateway.proxy.errors import ApiError
from gateway.proxy.schemas import ErrorResponse, body_schema, parse_json_object


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


_ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {
    401: _error("admin key missing or wrong (when `admin_key` is set)"),
    403: _error("no `admin_key` is set and the caller is not on loopback"),
}
router = APIRouter()
admin = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], responses=_ADMIN_ERRORS)


@router.get("/health")
async def health() -> JSONResponse:
    """Liveness: the gateway process answers."""
    return JSONResponse({"status": "ok"})


@router.get(
    "/ready",
    responses={
        503: {"description": "no engine can take traffic", "content": {"application/json": {}}}
    },
)
async def ready(request: Request) -> JSONResponse:
    """Readiness: at least one engine can take traffic."""
    state = get_state(request)
    healthy = [e.id for e in state.registry.all() if e.routable]
    if not healthy:
        return JSONResponse(
            {"status": "not ready", "healthy_engines": 0},
            status_code=503,
            headers={"Retry-After": "1"},
        )
    return JSONResponse({"status": "ready", "healthy_engines": len(healthy)})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry = get_state(request).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def describe(e: EngineState, in_flight: int, queued: int = 0) -> dict[str, Any]:
    m = e.metrics
    return {
        "id": e.id,
        "url": e.url,
        "role": e.role.value,
        "models": list(e.models),
        "health": e.health.value,
        "routable": e.routable,
        "in_flight": in_flight,
        "router_queued": queued,
        "pending_prefill_tokens_est": e.pending_tokens,
        "consecutive_failures": e.consecutive_failures,
        "breaker": e.breaker.state.value,
        "breaker_trips": e.breaker.trips,
        "last_error": e.last_error,
        "metrics": None
        if m is None
        else {
            "running": m.running,
            "waiting": m.waiting,
            "kv_cache_usage": m.kv_usage,
            "prefix_cache_hit_ratio": (m.prefix_hits / m.prefix_queries)
            if m.prefix_queries
            else None,
            "block_size": m.block_size,
            "num_gpu_blocks": m.num_gpu_blocks,
        },
    }


@admin.get("/engines")
async def list_engines(request: Request) -> JSONResponse:
    state = get_state(request)
    flights = state.dispatcher.in_flight
    return JSONResponse(
        {
            "policy": state.dispatcher.policy.name,
            "engines": [
                describe(e, flights.get(e.id, 0), state.dispatcher.queues.count(e.id))
                for e in state.registry.all()
            ],
            "router_queued": len(state.dispatcher.queues),
        }
    )


class _EngineBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str
    role: str = "both"
    model: str | None = None


@admin.post(
    "/engines",
    status_code=201,
    responses={400: _error("invalid engine"), 409: _error("already registered")},
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": body_schema(EngineConfig)}},
        }
    },
)
async def add_engine(request: Request) -> JSONResponse:
    state = get_state(request)
    body = parse_json_object(await read_body(request, 64 * 1024))
    try:
        cfg = EngineConfig.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ()))
        raise ApiError(400, f"{loc}: {err.get('msg')}", param=loc or None) from None
    if cfg.url in state.registry:
        raise ApiError(409, f"engine {cfg.url} is already registered", error_type="conflict")
    engine = state.registry.add(
        cfg.url,
        role=EngineRole(cfg.role),
        model=cfg.model,
        api_key=cfg.api_key.get_secret_value() if cfg.api_key else None,
    )
    await state.monitor.check(engine)
    return JSONResponse(describe(engine, 0), status_code=201)


@admin.delete(
    "/engines",
    responses={400: _error("`url` missing"), 404: _error("no such engine")},
)
async def remove_engine(request: Request, url: str) -> JSONResponse:
    state = get_state(request)
    members = RegistryMembership(state.registry, state.monitor, state.dispatcher, state.kv_events)
    engine = members.remove(url.rstrip("/"))
    if engine is None:
        raise ApiError(404, f"engine {url} is not registered", param="url")
    return JSONResponse({"removed": engine.id})
