"""A response's end is settled when its message arrives, not after the picker's answer.

Envoy's sequence on the response side of a BUFFERED request: response headers, the body in
several ``STREAMED`` chunks, an empty chunk with ``end_of_stream``, (trailers when sent),
then the gRPC stream closes. Once Envoy has the answer to the last chunk it finishes the
client's response and closes or resets the stream, and grpc.aio may then drop the handler's
generator at that answer without resuming it. The handler is driven here as grpc.aio drives
it, and closed right after each answer of the response's end: the recording must say
``ok`` with the engine's usage (prompt and output lengths), as ``kvgate serve``'s does.
A client that stops reading at a stream's last event (the ``openai`` client) makes Envoy
close the stream before the body's ``end_of_stream``: that answer is finished too; one
closed before its last event is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from gateway.proxy.recorder import Entry
from tests.epp.harness import MODEL, MODES, _headers, _metadata, fleet, picker

END = ["end_chunk", "trailers", "headers_only", "closed", "cut"]
"""How the response ends: its empty last chunk, trailers after it, headers alone, the
stream closed after the whole body but before ``end_of_stream`` (the client stopped
reading at the last event), or closed before the last event."""


async def _drive(server: Any, transport: Any, body: dict[str, Any], end: str) -> list[Entry]:
    stream = bool(body.get("stream"))
    recorded: list[Entry] = []
    assert server.service.recorder is not None
    server.service.recorder.put = recorded.append
    inbox: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[pb.ProcessingRequest]:
        while (msg := await inbox.get()) is not None:
            yield msg

    answers = server.handler.run(requests())
    raw = json.dumps(body).encode()
    config = pb.ProtocolConfiguration(
        request_body_mode=MODES.BUFFERED, response_body_mode=MODES.STREAMED
    )
    head = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "x"}
    await inbox.put(
        pb.ProcessingRequest(request_headers=_headers(head, False), protocol_config=config)
    )
    await answers.__anext__()
    await inbox.put(pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True)))
    picked = await answers.__anext__()
    target = picked.request_body.response.header_mutation.set_headers[0].header.raw_value
    async with httpx.AsyncClient(transport=transport) as client:
        resp = await client.post(f"http://{target.decode()}/v1/chat/completions", content=raw)
    served = _metadata("envoy.lb", "x-gateway-destination-endpoint-served", target.decode())
    status = {":status": str(resp.status_code)}
    content = resp.content
    last: pb.ProcessingRequest
    if end == "headers_only":  # a body-less answer: the headers end the response
        last = pb.ProcessingRequest(
            response_headers=_headers(status, True), metadata_context=served
        )
    else:
        await inbox.put(
            pb.ProcessingRequest(response_headers=_headers(status, False), metadata_context=served)
        )
        await answers.__anext__()
        if end == "cut":
            content = content[: content.rindex(b"data: [DONE]")] if stream else content[:-5]
        pieces = [content[i : i + 97] for i in range(0, len(content), 97)]  # usage split up
        for piece in pieces:
            await inbox.put(pb.ProcessingRequest(response_body=pb.HttpBody(body=piece)))
            await answers.__anext__()
        if end in ("closed", "cut"):  # the client left after the answer: no end_of_stream
            if end == "cut":  # ... or before its last event: still a cancelled request
                await inbox.put(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"d")))
                await answers.__anext__()
            await inbox.put(None)
            with contextlib.suppress(StopAsyncIteration):
                await answers.__anext__()
            return recorded
        last = pb.ProcessingRequest(response_body=pb.HttpBody(end_of_stream=True))
        if end == "trailers":
            await inbox.put(last)
            await answers.__anext__()
            last = pb.ProcessingRequest(response_trailers=pb.HttpTrailers())
    await inbox.put(last)
    await answers.__anext__()
    await answers.aclose()  # the stream went away before the generator was resumed
    return recorded


@pytest.mark.parametrize("end", END)
@pytest.mark.parametrize("stream", [False, True])
async def test_the_response_end_is_settled_before_the_stream_goes(
    tmp_path: Any, end: str, stream: bool
) -> None:
    record = {"path": str(tmp_path / "rec.jsonl"), "salt": "t"}
    async with (
        fleet("both") as (transport, urls),
        picker(transport, [{"url": u} for u in urls], record=record) as server,
    ):
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "tell me a story " * 40}],
            "max_tokens": 6,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        recorded = await _drive(server, transport, body, end)
        assert len(recorded) == 1
        entry = recorded[0]
        if end == "cut" or (end == "closed" and not stream):  # not known to be answered
            assert (entry.outcome, entry.ok) == ("cancelled", False)
            assert not server.ledger.open and server.service.dispatcher.in_flight == {}
            return
        assert (entry.outcome, entry.ok) == ("ok", True)
        assert not server.ledger.open
        assert server.service.dispatcher.in_flight == {}
        if end != "headers_only":  # the usage came in the body, split over chunks
            assert entry.prompt is not None and entry.prompt > 0
            assert entry.output == 6 and entry.output_usage
