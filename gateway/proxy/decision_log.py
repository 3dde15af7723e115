"""The gateway side of decision recording: wrap the policy, serve the log.

With ``decision_log.enabled`` the gateway's policy is a
:class:`~gateway.policies.recording.RecordingPolicy`, and ``GET
/admin/decisions`` pages through its log as JSON
(:mod:`gateway.policies.recording_codec`): the spec to build a fresh policy,
then the calls in order. Replaying them (``gateway.policies.recording.replay``)
must give the same answers.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse

from gateway.config import Settings
from gateway.policies.base import Policy, PolicyContext
from gateway.policies.recording import PolicySpec, RecordingPolicy
from gateway.policies.recording_codec import encode_call, encode_spec
from gateway.proxy.deps import get_state, require_admin
from gateway.proxy.errors import ApiError

MAX_PAGE = 10_000

admin = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


def record_decisions(policy: Policy, ctx: PolicyContext, settings: Settings) -> Policy:
    """``policy`` wrapped in a recorder when ``settings.decision_log.enabled``."""
    cfg = settings.decision_log
    if not cfg.enabled:
        return policy
    spec = PolicySpec.of(settings.policy.name, ctx, settings.policy.options)
    return RecordingPolicy(policy, spec, max_bytes=cfg.max_bytes)


@admin.get("/decisions")
async def decisions(
    request: Request,
    offset: int = Query(0, ge=0),
    limit: int = Query(1000, ge=1, le=MAX_PAGE),
) -> JSONResponse:
    """A page of the decision log: ``calls[offset : offset + limit]`` and the spec."""
    policy = get_state(request).dispatcher.policy
    if not isinstance(policy, RecordingPolicy):
        raise ApiError(404, "decision recording is off (set decision_log.enabled)")
    calls = policy.calls[offset : offset + limit]  # a copy: later calls may append
    body: dict[str, Any] = {
        "spec": encode_spec(policy.spec),
        "total": len(policy.calls),
        "offset": offset,
        "truncated": policy.truncated,
        "dropped": policy.dropped,
        "bytes_estimate": policy.bytes,
        "calls": [encode_call(c) for c in calls],
    }
    return JSONResponse(body)
