"""Property tests of request parsing and routing keys (hypothesis, deterministic).

Whatever the bytes, parsing and validation end in a value or a clean 4xx ApiError; a
body that validates always gets a routing key; the canonical chat rendering is
deterministic, independent of the order of keys in objects, and append-only (a
conversation's rendering starts with the rendering of its first messages).
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gateway.proxy.errors import ApiError
from gateway.proxy.routing_key import RoutingKeyer, completion_prompt, render_chat
from gateway.proxy.schemas import (
    MAX_JSON_DEPTH,
    ChatBody,
    CompletionBody,
    parse_json_object,
    validate,
)

FUZZ = settings(
    max_examples=200,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=30,
)
# Values of the fields kvgate reads, right or wrong, so validation is reached and passed.
field_values = {
    "model": st.none() | st.text(max_size=20) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.none() | st.dictionaries(st.text(max_size=5), scalars) | json_values,
    "max_tokens": st.none() | st.integers(min_value=-5, max_value=2**66) | json_values,
    "max_completion_tokens": st.integers(min_value=-5, max_value=2**64) | json_values,
    "n": st.integers(min_value=-2, max_value=200) | json_values,
    "prompt": st.text(max_size=300)
    | st.lists(st.integers(min_value=-(2**64), max_value=2**64), max_size=70)
    | st.lists(st.text(max_size=50), max_size=4)
    | st.lists(st.lists(st.integers(min_value=-3, max_value=2**64), max_size=40), max_size=3)
    | json_values,
    "tools": st.none() | st.lists(st.dictionaries(st.text(max_size=8), json_values)) | json_values,
}
messages = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(["system", "user", "assistant", "tool", ""]) | json_values,
            "content": st.none()
            | st.text(max_size=200)
            | st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "image_url"]) | json_values},
                    optional={"text": st.text(max_size=50) | json_values, "x": json_values},
                ),
                max_size=3,
            )
            | json_values,
            "name": st.none() | st.text(max_size=10) | json_values,
            "tool_calls": st.none() | st.lists(st.dictionaries(st.text(max_size=5), json_values)),
            "tool_call_id": st.none() | st.text(max_size=10) | json_values,
        },
    )
    | json_values,
    max_size=5,
)
bodies = st.fixed_dictionaries(
    {}, optional={**field_values, "messages": messages | json_values, "extra": json_values}
)


def key_of(route: str, raw: bytes, keyer: RoutingKeyer) -> tuple[tuple[int, ...], int]:
    """What the gateway does with a body before routing (gateway/proxy/routes_openai.py)."""
    body = parse_json_object(raw)
    parsed = validate(ChatBody if route == "chat" else CompletionBody, body)
    if isinstance(parsed, ChatBody):
        return keyer.chat_key(body["messages"], body.get("tools"))
    assert isinstance(parsed, CompletionBody)
    return keyer.key(completion_prompt(parsed.prompt))


def only_clean_4xx(route: str, raw: bytes) -> None:
    keyer = RoutingKeyer(16)
    try:
        hashes, tokens = key_of(route, raw, keyer)
    except ApiError as exc:
        assert 400 <= exc.status < 500, exc.status
        assert exc.message and exc.error_type == "invalid_request_error"
        return
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)
    assert isinstance(tokens, int) and tokens >= 0


@FUZZ
@given(raw=st.binary(max_size=400))
def test_arbitrary_bytes_are_a_value_or_a_400(raw: bytes) -> None:
    only_clean_4xx("chat", raw)
    only_clean_4xx("completions", raw)


@FUZZ
@given(value=json_values)
def test_arbitrary_json_is_a_value_or_a_400(value: Any) -> None:
    raw = json.dumps(value).encode()
    only_clean_4xx("chat", raw)
    only_clean_4xx("completions", raw)


@settings(FUZZ, max_examples=150)
@given(body=bodies)
def test_openai_shaped_bodies_are_a_value_or_a_400(body: dict[str, Any]) -> None:
    for ascii_only in (True, False):
        raw = json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
        only_clean_4xx("chat", raw)
        only_clean_4xx("completions", raw)


@FUZZ
@given(depth=st.integers(min_value=1, max_value=3000), opener=st.sampled_from(["[", '{"a":']))
def test_any_nesting_depth_is_a_value_or_a_400(depth: int, opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    inner = opener * depth + "1" + closer * depth
    raw = ('{"model":"m","prompt":"x","extra":' + inner + "}").encode()
    try:
        body = parse_json_object(raw)
    except ApiError as exc:
        assert exc.status == 400 and "nested too deeply" in exc.message
        assert depth + 1 > MAX_JSON_DEPTH
        return
    assert depth + 1 <= MAX_JSON_DEPTH
    assert body["prompt"] == "x"


# -- the canonical chat rendering -----------------------------------------------------
CHAT = settings(FUZZ, max_examples=100)
small_json = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=6,
)
texts = st.text(max_size=80)
chat_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool"])},
        optional={
            "content": st.none()
            | texts
            | st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "image_url", "input_audio"])},
                    optional={"text": texts, "detail": small_json},
                ),
                max_size=3,
            ),
            "name": texts,
            "tool_calls": st.lists(st.dictionaries(st.text(max_size=6), small_json), max_size=2),
            "tool_call_id": texts,
        },
    ),
    min_size=1,
    max_size=6,
)
tool_lists = st.none() | st.lists(st.dictionaries(st.text(max_size=6), small_json), max_size=3)


def shuffled_keys(value: Any, rng: random.Random) -> Any:
    """``value`` with every object's keys in another order (same content)."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: shuffled_keys(v, rng) for k, v in items}
    if isinstance(value, list):
        return [shuffled_keys(v, rng) for v in value]
    return value


@CHAT
@given(msgs=chat_messages, tools=tool_lists, seed=st.integers(0, 2**16))
def test_chat_rendering_is_deterministic_and_key_order_free(
    msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None, seed: int
) -> None:
    text = render_chat(msgs, tools)
    assert render_chat(copy.deepcopy(msgs), copy.deepcopy(tools)) == text
    rng = random.Random(seed)
    assert render_chat(shuffled_keys(msgs, rng), shuffled_keys(tools, rng)) == text
    keyer = RoutingKeyer(16)
    assert keyer.chat_key(msgs, tools) == keyer.chat_key(shuffled_keys(msgs, rng), tools)


@CHAT
@given(msgs=chat_messages, tools=tool_lists, cut=st.integers(0, 6))
def test_chat_rendering_is_append_only(
    msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None, cut: int
) -> None:
    """A conversation's key extends the key of its first messages: prefix caching works
    across turns."""
    head = msgs[: min(cut, len(msgs))]
    assert render_chat(msgs, tools).startswith(render_chat(head, tools))
    keyer = RoutingKeyer(4, chars_per_token=1.0)
    full, _ = keyer.chat_key(msgs, tools)
    part, _ = keyer.chat_key(head, tools)
    assert full[: len(part)] == part


@CHAT
@given(msgs=chat_messages, i=st.integers(0, 5), j=st.integers(0, 5))
def test_message_order_matters(msgs: list[dict[str, Any]], i: int, j: int) -> None:
    """Swapping two different messages changes the rendering (order is part of the key)."""
    assume(all("<|" not in json.dumps(m) for m in msgs))  # no role markers inside content
    i, j = i % len(msgs), j % len(msgs)
    swapped = list(msgs)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    if render_chat([msgs[i]]) != render_chat([msgs[j]]):
        assert render_chat(swapped) != render_chat(msgs)
    else:
        assert render_chat(swapped) == render_chat(msgs)
