"""The ``sessions`` and ``responses`` sections of :class:`gateway.config.Settings` (re-exported
there), and :class:`Strict`, the base of every configuration section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Strict(BaseModel):
    """A configuration section: unknown keys are errors; values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


_SESSION_HEADERS = (
    "x-session-id",  # kvgate's own, and generic clients
    "x-claude-code-session-id",  # Claude Code (v2.1.86+), one UUID per session
    "session_id",  # OpenAI Codex CLI (its conversation id)
    "session-id",  # OpenAI Codex CLI, newer builds
    "x-opencode-session",  # opencode
)
_SESSION_FIELDS = ("session_id", "prompt_cache_key", "metadata.user_id", "user")


class SessionsConfig(Strict):
    """Sessions that stick (docs/gateway.md#sessions): a request's session id comes from the
    first of ``headers`` it carries, else the first of ``body_fields`` (dotted paths) its
    JSON body sets; a session stays on the engine it was routed to until that engine is
    saturated or unhealthy (:mod:`gateway.policies.session_affinity`)."""

    enabled: bool = Field(default=True, description="route a session's turns to one engine")
    headers: list[str] = Field(
        default_factory=lambda: list(_SESSION_HEADERS),
        description="request headers naming the session, first match wins",
    )
    body_fields: list[str] = Field(
        default_factory=lambda: list(_SESSION_FIELDS),
        description="body fields naming the session (after the headers), first match wins",
    )
    ttl_s: float = Field(default=600.0, gt=0, description="a binding lives this long after use")
    max_sessions: int = Field(
        default=100_000,
        ge=1,
        description="bindings kept, ~350 bytes each (least recently used dropped first)",
    )
    load_ratio: float = Field(
        default=1.2, gt=1, description="saturated above this x the pool's mean load"
    )
    min_in_flight: int = Field(
        default=3, ge=0, description="never saturated at or below this many requests"
    )
    min_pending_tokens: int = Field(
        default=256,
        ge=0,
        description="never saturated by a prefill backlog (beyond the least backlogged "
        "engine's) at or below this many tokens",
    )

    @field_validator("headers")
    @classmethod
    def _lower(cls, value: list[str]) -> list[str]:
        return [h.strip().lower() for h in value if h.strip()]


class ResponsesConfig(Strict):
    """Stored Responses (``/v1/responses``): vLLM keeps a stored response in the engine that
    created it, so kvgate remembers which engine that was (:mod:`gateway.proxy.response_store`)."""

    ttl_s: float = Field(
        default=86_400.0, gt=0, description="a response id is remembered this long after use"
    )
    max_entries: int = Field(
        default=200_000, ge=1, description="response ids remembered (oldest dropped first)"
    )
    locate: bool = Field(
        default=True,
        description="ask the engines (GET /v1/responses/{id}) for an id kvgate does not know",
    )
