"""A request's session id: which agent run or conversation it belongs to.

:func:`session_id` looks, in order, at

1. the request headers of ``sessions.headers``, first one set wins (default:
   ``x-session-id``; Claude Code's ``x-claude-code-session-id``; the OpenAI Codex
   CLI's ``session_id`` and ``session-id``; opencode's ``x-opencode-session``);
2. the JSON body fields of ``sessions.body_fields`` (dotted paths), first one set
   wins (default: vLLM's ``session_id``, the Responses/chat ``prompt_cache_key``,
   Anthropic's ``metadata.user_id``, OpenAI's ``user``).

Headers come first: a client that names its session explicitly means it, while the
body fields are wider (``user`` spans every conversation of an end user). Claude
Code's ``metadata.user_id`` (``user_<hash>_account_<id>_session_<uuid>``, or a
JSON object with a ``session_id``) yields its session part. An id of at most
:data:`MAX_ID_CHARS` printable ASCII characters is kept as it is; a longer one,
or one with other characters, becomes ``h:`` + 32 hex digits of its BLAKE2b hash,
so what the affinity table and the replica messages hold is bounded. "" means
no session.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from gateway.config import SessionsConfig
from gateway.policies.session_affinity import SessionAffinity, StickySettings

__all__ = ["MAX_ID_CHARS", "normalise", "session_affinity", "session_id"]

MAX_ID_CHARS = 64
"""Longest id kept verbatim; longer ones are hashed to 34 characters."""
_PLAIN = re.compile(rf"[!-~]{{1,{MAX_ID_CHARS}}}")  # printable ASCII, no spaces
_CLAUDE_LEGACY = re.compile(r"_session_([0-9A-Za-z-]{8,64})$")


def normalise(raw: str) -> str:
    """``raw`` stripped, kept when short and plain, else hashed ("" stays "")."""
    value = raw.strip()
    if not value:
        return ""
    if _PLAIN.fullmatch(value):
        return value
    return "h:" + hashlib.blake2b(value.encode("utf-8", "replace"), digest_size=16).hexdigest()


def session_id(headers: Mapping[str, str], body: Mapping[str, Any], cfg: SessionsConfig) -> str:
    """The session of a request ("" when it names none or sessions are off).

    ``headers`` are keyed by lower-case name (as the proxy builds them); ``body`` is
    the parsed JSON body (an empty mapping for bodies that are not JSON objects).
    """
    if not cfg.enabled:
        return ""
    for name in cfg.headers:
        value = headers.get(name)
        if value:
            found = normalise(value)
            if found:
                return found
    for path in cfg.body_fields:
        value = _field(body, path)
        if isinstance(value, str) and value.strip():
            if path == "metadata.user_id":
                value = _claude_session(value)
            return normalise(value)
    return ""


def _field(body: Mapping[str, Any], path: str) -> Any:
    node: Any = body
    for part in path.split("."):
        if not isinstance(node, Mapping):
            return None
        node = node.get(part)
    return node


def _claude_session(user_id: str) -> str:
    """The session part of Claude Code's ``metadata.user_id``, else the whole value."""
    text = user_id.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            return text
        found = obj.get("session_id") if isinstance(obj, dict) else None
        return found if isinstance(found, str) and found.strip() else text
    legacy = _CLAUDE_LEGACY.search(text)
    return legacy.group(1) if legacy else text


def session_affinity(cfg: SessionsConfig) -> SessionAffinity | None:
    """The dispatcher's session affinity for ``sessions`` settings (None when off)."""
    if not cfg.enabled:
        return None
    return SessionAffinity(
        StickySettings(
            ttl_s=cfg.ttl_s,
            max_sessions=cfg.max_sessions,
            load_ratio=cfg.load_ratio,
            min_in_flight=cfg.min_in_flight,
            min_pending_tokens=cfg.min_pending_tokens,
        )
    )
