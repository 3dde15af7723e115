"""The fake tokenizer, chat template and generated text: deterministic and prefix-stable."""

from __future__ import annotations

import pytest

from gateway.emulator.tokenizer import (
    BOS_ID,
    FIRST_TEXT_ID,
    VOCAB_SIZE,
    FakeTokenizer,
    natural_length,
    output_tokens,
    prompt_digest,
    render_chat,
)

TOK = FakeTokenizer()
TEXTS = [
    "",
    "a",
    "hello world",
    "The quick brown fox jumps over the lazy dog. " * 20,
    "naïve café – 東京 🚀 ünïcödé",
]


@pytest.mark.parametrize("text", TEXTS)
def test_about_four_characters_per_token_with_bos(text: str) -> None:
    ids = TOK.encode(text)
    assert ids[0] == BOS_ID
    assert len(ids) == 1 + -(-len(text) // 4)
    assert all(FIRST_TEXT_ID <= t < VOCAB_SIZE for t in ids[1:])
    assert TOK.encode(text, add_special_tokens=False) == ids[1:]


@pytest.mark.parametrize("text", TEXTS)
def test_prefixes_on_chunk_boundaries_give_token_prefixes(text: str) -> None:
    ids = TOK.encode(text)
    for cut in range(0, len(text) + 1, 4):
        prefix = TOK.encode(text[:cut])
        assert ids[: len(prefix)] == prefix


def test_encoding_is_deterministic_and_content_sensitive() -> None:
    assert TOK.encode("same text") == TOK.encode("same text")
    assert TOK.encode("same text") != TOK.encode("same tex!")
    assert FakeTokenizer().encode("abcdabcd")[1] == FakeTokenizer().encode("abcdabcd")[2]


def test_decode_gives_one_word_per_token_and_nothing_for_specials() -> None:
    ids = TOK.encode("some prompt text")
    text = TOK.decode(ids)
    assert len(text.split()) == len(ids) - 1
    assert TOK.decode([BOS_ID, 2, 0]) == ""
    assert TOK.token_repr(BOS_ID) == "<s>"


def test_out_of_vocab() -> None:
    assert TOK.out_of_vocab([1, 2, 3]) is None
    assert TOK.out_of_vocab([1, VOCAB_SIZE, 3]) == VOCAB_SIZE
    assert TOK.out_of_vocab([-1]) == -1


def test_generated_text_depends_on_prompt_seed_and_position() -> None:
    d1, d2 = prompt_digest(TOK.encode("one")), prompt_digest(TOK.encode("two"))
    assert output_tokens(d1, 0, 20, 0) == output_tokens(d1, 0, 20, 0)
    assert output_tokens(d1, 0, 20, 0) != output_tokens(d2, 0, 20, 0)
    assert output_tokens(d1, 0, 20, 0) != output_tokens(d1, 0, 20, 1)
    assert output_tokens(d1, 0, 20, 0)[5:] == output_tokens(d1, 5, 15, 0)


def test_natural_length_is_fixed_per_prompt_and_in_range() -> None:
    lengths = {natural_length(prompt_digest([1, i]), 0) for i in range(300)}
    assert all(16 <= n <= 256 for n in lengths)
    assert len(lengths) > 50
    assert natural_length(prompt_digest([1, 7]), 0) == natural_length(prompt_digest([1, 7]), 0)


def test_chat_template_renders_roles_parts_tools_and_generation_prompt() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "look at "}, {"type": "image_url"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "get", "arguments": '{"x": 1}'}}],
        },
        {"role": "tool", "content": "42"},
    ]
    tools = [{"type": "function", "function": {"name": "get"}}]
    text = render_chat(messages, tools)
    assert text.startswith('<|tools|>\n[{"function": {"name": "get"}')
    assert "<|system|>\nbe brief\n" in text
    assert "<|user|>\nlook at <|image_url|>\n" in text
    assert '<|assistant|>\n<|tool_call|>get({"x": 1})\n' in text
    assert "<|tool|>\n42\n" in text
    assert text.endswith("<|assistant|>\n")
    assert not render_chat(messages, add_generation_prompt=False).endswith("<|assistant|>\n")


def test_a_conversation_turn_extends_the_previous_prompt() -> None:
    turn1 = [{"role": "system", "content": "sys " * 40}, {"role": "user", "content": "q1"}]
    turn2 = [*turn1, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    first, second = render_chat(turn1), render_chat(turn2)
    assert second.startswith(first)
    shared = len(first) // 4 * 4
    assert TOK.encode(second)[: 1 + shared // 4] == TOK.encode(first)[: 1 + shared // 4]


def test_continue_final_message_leaves_the_last_message_open() -> None:
    text = render_chat(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
        continue_final_message=True,
    )
    assert text.endswith("<|assistant|>\nHel")
