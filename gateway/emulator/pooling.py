"""The pooling runner (``kvgate emulate --runner pooling``): vLLM 0.32's pooling routes.

vLLM registers a runner's routes only: a pooling model serves none of the generate
routes (404), a generate model none of these. The task (``--convert``) picks them:

* ``embed`` (the default): ``/v1/embeddings``, ``/pooling``, ``/score``, ``/v1/score``,
  ``/rerank``, ``/v1/rerank``, ``/v2/rerank`` (scores are cosine similarities);
* ``classify`` (a one-label cross-encoder, which is when vLLM enables scoring for a
  classifier): ``/classify``, ``/pooling``, and the score and rerank routes (a score
  is the sigmoid of the pair's logit).

Every input is one engine request computing only its prompt (a prefill, priced by
the engine model) and the vectors come from the prompt's tokens: a deterministic
unit vector of :data:`EMBED_DIM` floats (Matryoshka: ``dimensions`` in ``1..EMBED_DIM``
keeps the first ones, renormalised). ``encoding_format`` ``float`` or ``base64``
(little-endian float32, as OpenAI's client decodes). Inputs: a string, strings, token
ids or lists of token ids. Ids: ``embd-``, ``pooling-``, ``classify-``, ``score-``
(score and rerank) + ``X-Request-Id`` or a uuid; usage ``{prompt_tokens,
total_tokens, completion_tokens: 0, prompt_tokens_details: null,
completion_tokens_details: null}`` (rerank: the first two only); errors as vLLM's
pooling routes word them (checked against a real vLLM 0.32 pooling engine).
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time
from typing import Any

import xxhash
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from gateway.emulator.engine_call import start
from gateway.emulator.generate import prompt_ids
from gateway.emulator.lora import check_cache_salt
from gateway.emulator.protocol import ApiError, _Lenient, parse_body, request_id
from gateway.emulator.state import EmulatorState, StateDep
from gateway.emulator.tokenizer import prompt_digest

EMBED_DIM = 384
"""Width of the emulated model's embeddings (its ``embedding_size``)."""
LABEL = "LABEL_0"


class _PoolingBody(_Lenient):
    model: str | None = None
    cache_salt: Any = None


class EmbeddingBody(_PoolingBody):
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None


class ScoreBody(_PoolingBody):
    queries: Any = None
    documents: Any = None
    items: Any = None
    data_1: Any = None
    data_2: Any = None
    text_1: Any = None
    text_2: Any = None


class RerankBody(_PoolingBody):
    query: str
    documents: list[str]
    top_n: int = 0


def vector(token_ids: list[int], dimensions: int | None = None) -> list[float]:
    """The unit vector of a prompt (the first ``dimensions`` coordinates, renormalised)."""
    digest = prompt_digest(token_ids)
    n = dimensions or EMBED_DIM
    raw = [xxhash.xxh3_64_intdigest(struct.pack("<QQ", digest, i)) / 2**63 - 1.0 for i in range(n)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


def _usage(tokens: int, *, rerank: bool = False) -> dict[str, Any]:
    if rerank:
        return {"prompt_tokens": tokens, "total_tokens": tokens}
    return {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def _inputs(state: EmulatorState, value: Any, param: str = "input") -> list[list[int]]:
    """Token ids of each input: a string, strings, token ids, or lists of token ids."""
    if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)):
        return [prompt_ids(state, value)]
    if not isinstance(value, list) or not value:
        raise ApiError(f"`{param}` must be a non-empty string or list.", param=param)
    return [prompt_ids(state, item) for item in value]


async def _prefill(state: EmulatorState, prompts: list[list[int]], lora: str, salt: Any) -> None:
    """Compute each prompt on the engine (one prefill each), concurrently."""
    handles = [
        start(state, ids, max_tokens=1, lora=lora, cache_salt=salt, ignore_eos=True)
        for ids in prompts
    ]
    try:
        await asyncio.gather(*(h.wait() for h in handles))
    finally:
        for h in handles:
            state.driver.abort(h.id)


async def _begin(request: Request, state: EmulatorState, body: _PoolingBody) -> str:
    check_cache_salt(body.cache_salt)
    if body.model and body.model != state.settings.model and body.model not in state.lora.adapters:
        # vLLM's pooling routes word it without the aliases and without a param
        raise ApiError(f"The model `{body.model}` does not exist.", status=404)
    return state.check_model(body.model)


def _head(prefix: str, request: Request, state: EmulatorState, lora: str) -> dict[str, Any]:
    rid = request_id(request.headers.get("x-request-id"), None)
    return {
        "id": f"{prefix}-{rid}",
        "object": "list",
        "created": int(time.time()),
        "model": state.served_name(lora),
    }


def _encode(vec: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vec
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
    raise ApiError(
        f"encoding_format {fmt!r} is not supported (float or base64).", param="encoding_format"
    )


async def embeddings(request: Request, state: StateDep) -> JSONResponse:
    body = parse_body(await request.body(), EmbeddingBody)
    lora = await _begin(request, state, body)
    dims = body.dimensions
    if dims is not None and not 1 <= dims <= EMBED_DIM:
        raise ApiError(
            f"Model {state.settings.model!r} only supports dimensions in range "
            f"[1, {EMBED_DIM}], got {dims}.",
            param="dimensions",
        )
    _encode([], body.encoding_format)
    prompts = _inputs(state, body.input)
    await _prefill(state, prompts, lora, body.cache_salt)
    data = [
        {
            "index": i,
            "object": "embedding",
            "embedding": _encode(vector(p, dims), body.encoding_format),
        }
        for i, p in enumerate(prompts)
    ]
    tokens = sum(map(len, prompts))
    return JSONResponse(
        {**_head("embd", request, state, lora), "data": data, "usage": _usage(tokens)}
    )


def _probability(token_ids: list[int]) -> float:
    """The one-label classifier's sigmoid output for a prompt."""
    logit = vector(token_ids, 1)[0] * 4.0 + (prompt_digest(token_ids) % 1000) / 250.0 - 2.0
    return 1.0 / (1.0 + math.exp(-logit))


async def classify(request: Request, state: StateDep) -> JSONResponse:
    body = parse_body(await request.body(), EmbeddingBody)
    lora = await _begin(request, state, body)
    prompts = _inputs(state, body.input)
    await _prefill(state, prompts, lora, body.cache_salt)
    data = [
        {"index": i, "label": LABEL, "probs": [_probability(p)], "num_classes": 1}
        for i, p in enumerate(prompts)
    ]
    tokens = sum(map(len, prompts))
    return JSONResponse(
        {**_head("classify", request, state, lora), "data": data, "usage": _usage(tokens)}
    )


async def pooling(request: Request, state: StateDep) -> JSONResponse:
    body = parse_body(await request.body(), EmbeddingBody)
    lora = await _begin(request, state, body)
    prompts = _inputs(state, body.input)
    await _prefill(state, prompts, lora, body.cache_salt)
    embed = state.settings.convert == "embed"
    data = [
        {
            "index": i,
            "object": "pooling",
            "data": _encode(vector(p) if embed else [_probability(p)], body.encoding_format),
        }
        for i, p in enumerate(prompts)
    ]
    tokens = sum(map(len, prompts))
    return JSONResponse(
        {**_head("pooling", request, state, lora), "data": data, "usage": _usage(tokens)}
    )


async def _scores(
    state: EmulatorState, lora: str, salt: Any, left: list[list[int]], right: list[list[int]]
) -> tuple[list[float], int]:
    """Scores of ``left`` (one, or as many as ``right``) against each of ``right``."""
    if len(left) != 1 and len(left) != len(right):
        raise ApiError("Input lengths must be either 1:1, 1:N or N:N")
    pairs = [(left[0] if len(left) == 1 else left[i], r) for i, r in enumerate(right)]
    if state.settings.convert == "classify":  # cross-encoder: one prompt per pair
        joined = [a + b for a, b in pairs]
        await _prefill(state, joined, lora, salt)
        return [_probability(p) for p in joined], sum(map(len, joined))
    unique = {tuple(p): p for p in [*left, *right]}
    await _prefill(state, list(unique.values()), lora, salt)
    out = [sum(x * y for x, y in zip(vector(a), vector(b), strict=True)) for a, b in pairs]
    return out, sum(len(a) + len(b) for a, b in pairs)


async def score(request: Request, state: StateDep) -> JSONResponse:
    body = parse_body(await request.body(), ScoreBody)
    lora = await _begin(request, state, body)
    for a, b in (
        ("queries", "documents"),
        ("queries", "items"),
        ("data_1", "data_2"),
        ("text_1", "text_2"),
    ):
        first, second = getattr(body, a), getattr(body, b)
        if first is not None and second is not None:
            break
    else:
        raise ApiError("A score request needs `queries` and `documents`.", param="queries")
    left, right = _inputs(state, first, a), _inputs(state, second, b)
    values, tokens = await _scores(state, lora, body.cache_salt, left, right)
    data = [{"index": i, "object": "score", "score": v} for i, v in enumerate(values)]
    return JSONResponse(
        {**_head("score", request, state, lora), "data": data, "usage": _usage(tokens)}
    )


async def rerank(request: Request, state: StateDep) -> JSONResponse:
    body = parse_body(await request.body(), RerankBody)
    lora = await _begin(request, state, body)
    if not body.documents:
        raise ApiError("`documents` must not be empty.", param="documents")
    left, right = _inputs(state, body.query, "query"), _inputs(state, body.documents, "documents")
    values, tokens = await _scores(state, lora, body.cache_salt, left, right)
    results = [
        {
            "index": i,
            "document": {"text": body.documents[i], "multi_modal": None},
            "relevance_score": v,
        }
        for i, v in enumerate(values)
    ]
    results.sort(key=lambda r: float(r["relevance_score"]), reverse=True)  # type: ignore[arg-type]
    if 0 < body.top_n < len(results):
        results = results[: body.top_n]
    head = _head("score", request, state, lora)
    return JSONResponse(
        {
            "id": head["id"],
            "model": head["model"],
            "usage": _usage(tokens, rerank=True),
            "results": results,
        }
    )


def attach(app: FastAPI, task: str) -> None:
    """The pooling routes vLLM registers for ``task`` (``embed`` or ``classify``)."""
    router = APIRouter()
    router.add_api_route("/pooling", pooling, methods=["POST"])
    if task == "embed":
        router.add_api_route("/v1/embeddings", embeddings, methods=["POST"])
    else:
        router.add_api_route("/classify", classify, methods=["POST"])
    for path in ("/score", "/v1/score"):
        router.add_api_route(path, score, methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        router.add_api_route(path, rerank, methods=["POST"])
    app.include_router(router)
