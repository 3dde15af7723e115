"""Session ids from headers and bodies: precedence, agents' own headers, bounded ids."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.config import SessionsConfig
from gateway.proxy.sessions import MAX_ID_CHARS, normalise, session_id

CFG = SessionsConfig()
UUID = "57a121ec-f78c-48c3-a745-e3036a3ecc33"


@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        ({}, {}, ""),
        ({"x-session-id": "s-1"}, {"user": "alice"}, "s-1"),  # a header beats the body
        ({"x-claude-code-session-id": UUID}, {}, UUID),  # Claude Code
        ({"session_id": "codex-1"}, {}, "codex-1"),  # OpenAI Codex CLI
        ({"session-id": "codex-2"}, {}, "codex-2"),
        ({"x-opencode-session": "oc-1"}, {}, "oc-1"),  # opencode
        ({"x-session-id": "  "}, {"user": "alice"}, "alice"),  # a blank header is no session
        ({}, {"session_id": "v", "prompt_cache_key": "k", "user": "u"}, "v"),
        ({}, {"prompt_cache_key": "k", "user": "u"}, "k"),
        ({}, {"metadata": {"user_id": "m"}, "user": "u"}, "m"),
        ({}, {"user": "u"}, "u"),
        ({}, {"user": 7, "metadata": "x"}, ""),  # not strings: ignored
        # Claude Code's metadata.user_id: legacy and JSON forms carry the session's uuid
        ({}, {"metadata": {"user_id": f"user_ab12_account_cd34_session_{UUID}"}}, UUID),
        ({}, {"metadata": {"user_id": json.dumps({"device_id": "d", "session_id": UUID})}}, UUID),
    ],
)
def test_where_the_session_comes_from(
    headers: dict[str, str], body: dict[str, Any], expected: str
) -> None:
    assert session_id(headers, body, CFG) == expected


def test_the_sources_and_their_order_are_configurable() -> None:
    cfg = SessionsConfig(headers=["X-Conversation"], body_fields=["user", "session_id"])
    assert cfg.headers == ["x-conversation"]  # names are matched lower-case
    assert session_id({"x-session-id": "s"}, {"session_id": "v", "user": "u"}, cfg) == "u"
    assert session_id({"x-conversation": "c"}, {"user": "u"}, cfg) == "c"
    off = SessionsConfig(enabled=False)
    assert session_id({"x-session-id": "s"}, {"user": "u"}, off) == ""


def test_long_or_unusual_ids_are_hashed_to_a_bounded_length() -> None:
    plain = "a" * MAX_ID_CHARS
    assert normalise(plain) == plain
    long = normalise("a" * (MAX_ID_CHARS + 1))
    assert long.startswith("h:") and len(long) == 34
    assert normalise("a" * 10_000) != long and len(normalise("a" * 10_000)) == 34
    spaced = normalise("alice@example.com my session")
    assert spaced.startswith("h:") and spaced == normalise(" alice@example.com my session ")
    assert normalise("ünïcode") != normalise("unicode")
    assert normalise("   ") == ""
