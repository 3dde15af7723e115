"""Parsing vLLM's ``/v1/models``: base models, LoRA adapters (``parent``/``root``), bad lists."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.cluster.model_list import MAX_MODELS, ModelListError, parse_model_list
from gateway.cluster.registry import LoraAdapter

# As vLLM 0.32 answers with --enable-lora --lora-modules sql=/adapters/sql (show_available_models)
VLLM_LIST = {
    "object": "list",
    "data": [
        {
            "id": "meta-llama/Llama-3.1-8B",
            "object": "model",
            "owned_by": "vllm",
            "root": "/models/llama",
            "parent": None,
            "max_model_len": 8192,
            "permission": [{}],
        },
        {
            "id": "sql",
            "object": "model",
            "root": "/adapters/sql",
            "parent": "meta-llama/Llama-3.1-8B",
        },
        {
            "id": "chat",
            "object": "model",
            "root": "/adapters/chat",
            "parent": "meta-llama/Llama-3.1-8B",
        },
    ],
}


def test_vllm_list_with_adapters() -> None:
    listing = parse_model_list(VLLM_LIST)
    assert listing.models == ("meta-llama/Llama-3.1-8B", "sql", "chat")
    assert listing.lora == {
        "sql": LoraAdapter("sql", "meta-llama/Llama-3.1-8B", "/adapters/sql"),
        "chat": LoraAdapter("chat", "meta-llama/Llama-3.1-8B", "/adapters/chat"),
    }
    assert not listing.truncated


def test_plain_openai_list_has_no_adapters() -> None:
    listing = parse_model_list({"data": [{"id": "m"}, {"id": "m"}, {"id": "n", "root": "/x"}]})
    assert listing.models == ("m", "n")
    assert listing.lora == {}


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({}, "not an OpenAI model list"),
        ([], "not an OpenAI model list"),
        ({"data": "m"}, "not an OpenAI model list"),
        ({"data": []}, "lists no model"),
        ({"data": [{"name": "m"}]}, "without a string id"),
        ({"data": [{"id": 5}]}, "without a string id"),
        ({"data": ["m"]}, "without a string id"),
    ],
)
def test_bad_lists_are_errors(payload: Any, message: str) -> None:
    with pytest.raises(ModelListError, match=message):
        parse_model_list(payload)


def test_long_lists_are_bounded() -> None:
    listing = parse_model_list({"data": [{"id": f"m{i}"} for i in range(MAX_MODELS + 10)]})
    assert len(listing.models) == MAX_MODELS
    assert listing.truncated
