"""Speech to text: ``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``.

vLLM serves them when the model supports the ``transcription`` task (Whisper-like
architectures, with the generate runner); ``kvgate emulate --transcription`` makes
the emulated model one. The body is a multipart form (``file``, ``model``,
``language``, ``prompt``, ``response_format`` ``json``, ``temperature``...). The
file's bytes stand for audio at :data:`BYTES_PER_SECOND` (16 kHz 16-bit mono): they
become :data:`TOKENS_PER_SECOND` prompt tokens a second (hashes of the bytes, so the
same file is the same prompt and hits the prefix cache), and the engine then decodes
:data:`WORDS_PER_SECOND` words a second of audio (at least one), priced by the
engine model. The text is those words, deterministic per file. Transcriptions
answer ``{"text", "usage": {"type": "duration", "seconds"}}``, translations
``{"text"}``, as vLLM.
"""

from __future__ import annotations

import math
from typing import Any

import xxhash
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile

from gateway.emulator.engine_call import start, wait_or_disconnect
from gateway.emulator.protocol import ApiError
from gateway.emulator.state import EmulatorState, StateDep
from gateway.emulator.tokenizer import BOS_ID, FIRST_TEXT_ID, VOCAB_SIZE

BYTES_PER_SECOND = 32_000
TOKENS_PER_SECOND = 50
WORDS_PER_SECOND = 2.5
MAX_FILE_BYTES = 25 * 1024 * 1024
"""Uploads past this answer 400 (OpenAI's limit; vLLM's default is the same order)."""

router = APIRouter()


def audio_prompt(data: bytes, limit: int) -> list[int]:
    """Prompt token ids for an audio file: one per 1/TOKENS_PER_SECOND s of audio."""
    step = BYTES_PER_SECOND // TOKENS_PER_SECOND
    span = VOCAB_SIZE - FIRST_TEXT_ID
    ids = [BOS_ID]
    for i in range(0, len(data), step):
        if len(ids) >= limit:
            break
        ids.append(FIRST_TEXT_ID + xxhash.xxh3_64_intdigest(data[i : i + step]) % span)
    return ids


async def _form(request: Request) -> tuple[bytes, dict[str, Any]]:
    try:
        form = await request.form()
    except Exception as exc:  # not multipart, or a broken body
        raise ApiError(f"Expected a multipart/form-data body: {exc}") from None
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise ApiError("Field required: `file` (the audio file).", param="file")
    data = await upload.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ApiError(f"The audio file is larger than {MAX_FILE_BYTES} bytes.", param="file")
    if not data:
        raise ApiError("The audio file is empty.", param="file")
    fields = {k: v for k, v in form.items() if isinstance(v, str)}
    return data, fields


async def _transcribe(request: Request, state: EmulatorState, *, usage: bool) -> Response:
    data, fields = await _form(request)
    lora = state.check_model(fields.get("model") or None)
    fmt = fields.get("response_format", "json")
    if fmt != "json":
        raise ApiError(f"The emulator answers response_format json only, got {fmt!r}.")
    seconds = len(data) / BYTES_PER_SECOND
    limit = state.perf.max_model_len
    ids = audio_prompt(data, limit // 2)
    words = max(1, min(limit - len(ids) - 1, math.ceil(seconds * WORDS_PER_SECOND)))
    handle = start(state, ids, max_tokens=words, lora=lora, ignore_eos=True)
    reason = await wait_or_disconnect(request, state.driver, handle)
    if reason is None:
        return Response(status_code=499)
    text = state.text(handle, 0, handle.produced).strip()
    if not usage:
        return JSONResponse({"text": text})
    duration = {"type": "duration", "seconds": max(1, math.ceil(seconds))}
    return JSONResponse({"text": text, "usage": duration})


@router.post("/v1/audio/transcriptions")
async def transcriptions(request: Request, state: StateDep) -> Response:
    return await _transcribe(request, state, usage=True)


@router.post("/v1/audio/translations")
async def translations(request: Request, state: StateDep) -> Response:
    return await _transcribe(request, state, usage=False)
