"""Token-exact routing keys: the engine's own tokens, hashed exactly as vLLM hashes blocks.

With ``keying: tokens`` each request is tokenized by an engine serving its
model (``POST /tokenize``, chat template included), and its full blocks are
hashed with the engine's block size and ``prefix_caching_hash_algo`` (read from
``vllm:cache_config_info``). The keys then equal the block ids in the engines'
KV events, so event-driven cache state matches routing keys exactly. When an
engine's algorithm cannot be reproduced (``xxhash`` without a pinned seed) or
tokenization fails, the request falls back to text keys and a metric counts it.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import httpx

from gateway.cluster.registry import EngineRegistry, EngineState
from gateway.core.vllm_hash import ALGORITHMS, block_ids

log = logging.getLogger("kvgate.proxy")

_CHAT_FIELDS = (
    "messages",
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
)


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
        return block_ids(tokens, block, algo=algo, seed=self.seed), len(tokens)

    async def _tokenize(
        self, engine: EngineState, route: str, body: dict[str, Any], model: str | None
    ) -> list[int] | None:
        payload: dict[str, Any] = {"model": model} if model else {}
        if route == "chat":
            payload.update({k: body[k] for k in _CHAT_FIELDS if k in body})
            payload.setdefault("add_generation_prompt", True)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list):  # a batch: route on its first prompt
                prompt = prompt[0] if prompt else ""
            payload["prompt"] = prompt
        headers = {"authorization": f"Bearer {engine.api_key}"} if engine.api_key else {}
        try:
            resp = await self.client.post(
                engine.url + "/tokenize", json=payload, headers=headers, timeout=self.timeout_s
            )
            if resp.status_code != 200:
                self._warn(
                    engine.id + str(resp.status_code),
                    f"/tokenize on {engine.id} answered {resp.status_code}; text keys",
                )
                return None
            tokens = resp.json().get("tokens")
        except (httpx.HTTPError, ValueError) as exc:
            self._warn(engine.id + "err", f"/tokenize on {engine.id} failed ({exc}); text keys")
            return None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return None
        return tokens

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)
