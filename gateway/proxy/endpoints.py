"""Every endpoint a vLLM fleet serves, and how kvgate routes each one.

Three kinds:

* ``prefix`` — generation: the body is rendered canonically (one rendering for chat,
  Responses and Messages, so a system prompt shared across APIs keys alike) and the
  policy routes on the prompt's block hashes;
* ``balanced`` — pooling, scoring, tokenizing, audio: no KV reuse to win, so the
  policy sees the prompt's size and no prefix (it balances load among the engines
  serving the model);
* ``stored`` — a stored Responses object (``GET``/``DELETE /v1/responses/{id}``,
  ``POST /v1/responses/{id}/cancel``): vLLM keeps it in the process that created it,
  so the request goes to that engine (:mod:`gateway.proxy.response_store`).

``/v1/messages`` and ``/v1/messages/count_tokens`` answer kvgate's own errors in
Anthropic's shape (its SDK parses them); everything else in OpenAI's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Kind = Literal["prefix", "balanced", "stored"]
BodyFormat = Literal["json", "multipart", "none"]
ErrorShape = Literal["openai", "anthropic"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One proxied path: how its body is read, keyed and routed."""

    path: str
    route: str
    """Metric and log label (bounded: one per endpoint)."""
    kind: Kind
    method: str = "POST"
    body: BodyFormat = "json"
    errors: ErrorShape = "openai"
    streams: bool = False
    """The body may ask for ``stream: true`` (server-sent events)."""
    disaggregates: bool = False
    """Runs as a prefill and a decode leg in a P/D pool (vLLM's NIXL proxy flow)."""


_GENERATE = (
    Endpoint("/v1/completions", "completions", "prefix", streams=True, disaggregates=True),
    Endpoint("/v1/chat/completions", "chat", "prefix", streams=True, disaggregates=True),
    Endpoint("/v1/responses", "responses", "prefix", streams=True),
    Endpoint("/v1/messages", "messages", "prefix", errors="anthropic", streams=True),
    Endpoint("/v1/messages/count_tokens", "count_tokens", "prefix", errors="anthropic"),
)
_BALANCED = (
    Endpoint("/v1/embeddings", "embeddings", "balanced"),
    Endpoint("/v2/embed", "embed", "balanced"),
    Endpoint("/pooling", "pooling", "balanced"),
    Endpoint("/classify", "classify", "balanced"),
    Endpoint("/score", "score", "balanced"),
    Endpoint("/v1/score", "score", "balanced"),
    Endpoint("/rerank", "rerank", "balanced"),
    Endpoint("/v1/rerank", "rerank", "balanced"),
    Endpoint("/v2/rerank", "rerank", "balanced"),
    Endpoint("/tokenize", "tokenize", "balanced"),
    Endpoint("/detokenize", "detokenize", "balanced"),
    Endpoint("/v1/audio/transcriptions", "transcriptions", "balanced", body="multipart"),
    Endpoint("/v1/audio/translations", "translations", "balanced", body="multipart"),
)
ENDPOINTS: dict[str, Endpoint] = {e.path: e for e in _GENERATE + _BALANCED}
"""POST endpoints by exact path."""

STORED_GET = Endpoint("/v1/responses/{id}", "response_get", "stored", method="GET", body="none")
STORED_DELETE = Endpoint(
    "/v1/responses/{id}", "response_delete", "stored", method="DELETE", body="none"
)
STORED_CANCEL = Endpoint("/v1/responses/{id}/cancel", "response_cancel", "stored", body="none")

_STORED_PATH = re.compile(r"^/v1/responses/([A-Za-z0-9._:\-]{1,200})(/cancel)?$")

ROUTE_LABELS = tuple(
    dict.fromkeys(
        [e.route for e in ENDPOINTS.values()]
        + [STORED_GET.route, STORED_DELETE.route, STORED_CANCEL.route]
    )
)
"""Every route label kvgate may report."""


def match(method: str, path: str) -> tuple[Endpoint, str] | None:
    """The endpoint serving ``method path`` and the stored response id it names ("" for
    the others), or None when kvgate does not proxy it."""
    if method == "POST":
        endpoint = ENDPOINTS.get(path)
        if endpoint is not None:
            return endpoint, ""
    if not path.startswith("/v1/responses/"):
        return None
    found = _STORED_PATH.match(path)
    if found is None:
        return None
    response_id, cancel = found.group(1), found.group(2)
    if cancel:
        return (STORED_CANCEL, response_id) if method == "POST" else None
    if method == "GET":
        return STORED_GET, response_id
    if method == "DELETE":
        return STORED_DELETE, response_id
    return None
