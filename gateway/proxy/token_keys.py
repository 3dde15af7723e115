"""Token-exact routing keys: the engine's own tokens, hashed exactly as vLLM hashes blocks.

With ``keying: tokens`` each request is tokenized by an engine serving its
model, and its full blocks are hashed with the engine's block size and
``prefix_caching_hash_algo`` (read from ``vllm:cache_config_info``), the
request's ``cache_salt`` and its LoRA adapter (name and the path ``/v1/models``
lists as its ``root``), as vLLM 0.32 keys them (:mod:`gateway.core.vllm_hash`).
The keys then equal the block ids in the engines' KV events, so event-driven
cache state matches routing keys exactly.

Tokens by route: ``completions`` token-id prompts as given, text prompts and
``chat`` through ``POST /tokenize`` (chat template included); ``messages`` and
``responses`` through vLLM's render endpoints (``/v1/messages/render``,
``/v1/responses/render``, served by ``vllm serve --enable-scale-out``; 403
without it), which return the token ids the engine would run.
Text keys instead (the request is still served; a metric counts the fallback):
an engine algorithm a router cannot reproduce (``xxhash`` without a pinned
seed), an engine without the endpoint (404: older vLLM or the emulator; 403:
vLLM without ``--enable-scale-out``), a Responses turn with
``previous_response_id`` (its prompt lives in the engine's response store;
sessions keep such turns together), multimodal
content or prompt embeds (vLLM hashes an item identity the router does not
know), an adapter whose path is not known yet, and any tokenizer error.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import httpx

from gateway.cluster.registry import EngineRegistry, EngineState
from gateway.core.vllm_hash import ALGORITHMS, LoraKey, block_ids

log = logging.getLogger("kvgate.proxy")

_CHAT_FIELDS = (
    "messages",
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
)
_RENDER_PATHS = {"messages": "/v1/messages/render", "responses": "/v1/responses/render"}
_MEDIA_PARTS = frozenset(
    {
        "image_url",  # chat
        "input_audio",
        "audio_url",
        "video_url",
        "image_embeds",
        "input_image",  # responses
        "input_file",
        "image",  # messages
        "document",
    }
)
_MAX_SCAN_DEPTH = 8
MAX_WARNINGS = 1024
"""Distinct fallback warnings logged once each (beyond: logged at debug level)."""


def _has_media(value: Any, depth: int = 0) -> bool:
    """True when messages / input hold a media content part (image, audio, video, file):
    vLLM hashes such items by an identity the router does not know."""
    if depth > _MAX_SCAN_DEPTH:
        return True  # deeper than any content structure: do not guess
    if isinstance(value, list):
        return any(_has_media(v, depth + 1) for v in value)
    if isinstance(value, dict):
        if value.get("type") in _MEDIA_PARTS:
            return True
        return any(_has_media(value[k], depth + 1) for k in ("content", "input") if k in value)
    return False


class TokenKeyer:
    """Asks engines for tokens; hashes them as the engines do."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        registry: EngineRegistry,
        *,
        seed: str | None = None,
        timeout_s: float = 2.0,
    ) -> None:
        self.client = client
        self.registry = registry
        self.seed = seed
        self.timeout_s = timeout_s
        self._turn = itertools.count()
        self._warned: set[str] = set()

    def _engine(self, model: str | None) -> EngineState | None:
        engines = [e for e in self.registry.all() if e.routable and e.serves(model)]
        if not engines:
            return None
        return engines[next(self._turn) % len(engines)]

    async def key(
        self, route: str, body: dict[str, Any], model: str | None, default_block: int
    ) -> tuple[tuple[int, ...], int] | None:
        """(block ids, prompt tokens) or None when exact keys are not available."""
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            return None  # the engine rejects it (400); nothing to key
        adapter = self.registry.lora_adapter(model)
        if adapter is not None and not adapter.path:
            self._warn(
                "lora:" + adapter.name,
                f"adapter {adapter.name!r} has no path in /v1/models; text keys for it",
            )
            return None
        lora = LoraKey(adapter.name, adapter.path) if adapter is not None else None
        engine = self._engine(model)
        if engine is None:
            return None
        m = engine.metrics
        algo = m.hash_algo if m and m.hash_algo else "sha256"
        block = m.block_size if m and m.block_size else default_block
        if algo not in ALGORITHMS:
            self._warn(
                engine.id,
                f"engine {engine.id} hashes blocks with {algo!r}, which a "
                "router cannot reproduce; using text keys (set "
                "--prefix-caching-hash-algo sha256 or sha256_cbor)",
            )
            return None
        if (
            "prompt_embeds" in body
            or _has_media(body.get("messages"))
            or _has_media(body.get("input"))
        ):
            return None
        prompt = body.get("prompt")
        if (
            route == "completions"
            and isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) for t in prompt)
        ):
            tokens: list[int] = prompt
        else:
            tokens_or_none = await self._tokenize(engine, route, body, model)
            if tokens_or_none is None:
                return None
            tokens = tokens_or_none
        ids = block_ids(tokens, block, algo=algo, seed=self.seed, lora=lora, cache_salt=salt)
        return ids, len(tokens)

    async def _tokenize(
        self, engine: EngineState, route: str, body: dict[str, Any], model: str | None
    ) -> list[int] | None:
        payload: dict[str, Any] = {"model": model} if model else {}
        path = "/tokenize"
        field = "tokens"
        if route in _RENDER_PATHS:
            if route == "responses" and body.get("previous_response_id") is not None:
                return None
            payload = {**body, **payload}
            path, field = _RENDER_PATHS[route], "token_ids"
        elif route == "chat":
            payload.update({k: body[k] for k in _CHAT_FIELDS if k in body})
            payload.setdefault("add_generation_prompt", True)
        elif route == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list):  # a batch: route on its first prompt
                prompt = prompt[0] if prompt else ""
            payload["prompt"] = prompt
        else:
            return None
        headers = {"authorization": f"Bearer {engine.api_key}"} if engine.api_key else {}
        try:
            resp = await self.client.post(
                engine.url + path, json=payload, headers=headers, timeout=self.timeout_s
            )
            if resp.status_code != 200:
                hint = " (start vLLM with --enable-scale-out)" if resp.status_code == 403 else ""
                self._warn(
                    engine.id + path + str(resp.status_code),
                    f"{path} on {engine.id} answered {resp.status_code}; text keys{hint}",
                )
                return None
            answer = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            self._warn(engine.id + path + "err", f"{path} on {engine.id} failed ({exc}); text keys")
            return None
        if not isinstance(answer, dict) or answer.get("features"):
            return None  # multimodal placeholders: vLLM hashes item identities too
        tokens = answer.get(field)
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return None
        return tokens

    def _warn(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        if len(self._warned) >= MAX_WARNINGS:
            log.debug(message)
            return
        self._warned.add(key)
        log.warning(message)
