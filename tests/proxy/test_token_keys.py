"""TokenKeyer: token-exact keys carry the request's cache_salt and LoRA adapter.

The engine is the emulator in-process (its ``/tokenize`` is vLLM's); the keys must be
``block_ids`` of those tokens with the salt and the adapter (name, the path
``/v1/models`` lists) that vLLM 0.32 hashes, and fall back to text keys (None) where
the router cannot reproduce the engine's hash. The real-engine tier checks the same
keys against a real vLLM's KV events (tests/vllm/test_lora_salt.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from gateway.cluster.registry import EngineRegistry, LoraAdapter
from gateway.core.vllm_hash import LoraKey, block_ids
from gateway.emulator import EmulatorSettings, create_emulator_app
from gateway.proxy.token_keys import TokenKeyer

BASE = "tiny"
ADAPTER = LoraAdapter("ad-a", BASE, "/adapters/a")
BLOCK = 16
CHAT: dict[str, Any] = {
    "messages": [{"role": "user", "content": "a shared system prompt " * 12 + "question"}],
    "max_tokens": 4,
}


@pytest.fixture
async def keyer() -> AsyncIterator[tuple[TokenKeyer, httpx.AsyncClient]]:
    settings = EmulatorSettings(
        model=BASE, enable_lora=True, lora_modules=((ADAPTER.name, ADAPTER.path),)
    )
    app = create_emulator_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://emulator") as client:
            registry = EngineRegistry()
            engine = registry.add("http://emulator", model=BASE)
            engine.models = (BASE, ADAPTER.name)
            engine.lora = {ADAPTER.name: ADAPTER}
            yield TokenKeyer(client, registry), client


async def _tokens(client: httpx.AsyncClient, model: str) -> list[int]:
    body = {"model": model, "messages": CHAT["messages"], "add_generation_prompt": True}
    resp = await client.post("/tokenize", json=body)
    assert resp.status_code == 200, resp.text
    tokens: list[int] = resp.json()["tokens"]
    assert len(tokens) >= 4 * BLOCK
    return tokens


async def test_plain_keys_are_the_block_ids_of_the_engines_tokens(
    keyer: tuple[TokenKeyer, httpx.AsyncClient],
) -> None:
    tk, client = keyer
    tokens = await _tokens(client, BASE)
    assert await tk.key("chat", CHAT, BASE, BLOCK) == (block_ids(tokens, BLOCK), len(tokens))


async def test_a_cache_salt_enters_the_keys(keyer: tuple[TokenKeyer, httpx.AsyncClient]) -> None:
    tk, client = keyer
    tokens = await _tokens(client, BASE)
    got = await tk.key("chat", {**CHAT, "cache_salt": "tenant-a"}, BASE, BLOCK)
    assert got == (block_ids(tokens, BLOCK, cache_salt="tenant-a"), len(tokens))
    other = await tk.key("chat", {**CHAT, "cache_salt": "tenant-b"}, BASE, BLOCK)
    plain = block_ids(tokens, BLOCK)
    assert other is not None and other[0][0] not in (got[0][0], plain[0])


async def test_an_adapter_enters_the_keys_with_its_path(
    keyer: tuple[TokenKeyer, httpx.AsyncClient],
) -> None:
    tk, client = keyer
    tokens = await _tokens(client, ADAPTER.name)
    lora = LoraKey(ADAPTER.name, ADAPTER.path)
    got = await tk.key("chat", {**CHAT, "model": ADAPTER.name}, ADAPTER.name, BLOCK)
    assert got == (block_ids(tokens, BLOCK, lora=lora), len(tokens))
    both = await tk.key(
        "chat", {**CHAT, "model": ADAPTER.name, "cache_salt": "s1"}, ADAPTER.name, BLOCK
    )
    assert both == (block_ids(tokens, BLOCK, lora=lora, cache_salt="s1"), len(tokens))
    assert set(got[0]).isdisjoint(block_ids(tokens, BLOCK))


async def test_token_id_prompts_are_keyed_without_tokenizing(
    keyer: tuple[TokenKeyer, httpx.AsyncClient],
) -> None:
    tk, _ = keyer
    prompt = list(range(3 * BLOCK + 5))
    body = {"prompt": prompt, "cache_salt": "x", "model": ADAPTER.name}
    lora = LoraKey(ADAPTER.name, ADAPTER.path)
    got = await tk.key("completions", body, ADAPTER.name, BLOCK)
    assert got == (block_ids(prompt, BLOCK, lora=lora, cache_salt="x"), len(prompt))


async def test_what_the_router_cannot_reproduce_falls_back_to_text_keys(
    keyer: tuple[TokenKeyer, httpx.AsyncClient],
) -> None:
    tk, _ = keyer
    registry = tk.registry
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    media = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]}
    assert await tk.key("chat", media, BASE, BLOCK) is None
    text_parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert await tk.key("chat", text_parts, BASE, BLOCK) is not None
    responses_media = {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}
    assert await tk.key("responses", responses_media, BASE, BLOCK) is None
    follow_up = {"input": "and then?", "previous_response_id": "resp_1"}
    assert await tk.key("responses", follow_up, BASE, BLOCK) is None
    assert await tk.key("completions", {"prompt_embeds": "AAAA"}, BASE, BLOCK) is None
    assert await tk.key("chat", {**CHAT, "cache_salt": 7}, BASE, BLOCK) is None
    # an adapter whose load path the monitor has not read: its hash cannot be reproduced
    engine = registry.all()[0]
    engine.lora = {ADAPTER.name: LoraAdapter(ADAPTER.name, BASE, "")}
    assert await tk.key("chat", CHAT, ADAPTER.name, BLOCK) is None
    assert await tk.key("chat", CHAT, BASE, BLOCK) is not None
