"""``kvgate epp`` in-process: emulated engines, the picker on a real gRPC port, and a client
that plays Envoy's part of the ext_proc protocol message by message.

Engines are kvgate's emulator apps (:mod:`gateway.emulator`) behind one httpx transport that
dispatches by host (``http://10.0.0.N:8000``); the picker's routing service probes and
scrapes them through it, and :class:`FakeEnvoy` forwards each picked request to the engine
the picker named, then streams the engine's response back to the picker as Envoy does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import httpx
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from gateway.config import load_settings
from gateway.emulator import EmulatorSettings, create_emulator_app
from gateway.epp import EppOptions, EppServer

MODEL = "kvgate-emulated"
EMBED = "kvgate-embed"
"""The model of the pooling engines :func:`fleet` adds."""
MODES = processing_mode_pb2.ProcessingMode.BodySendMode
FRONTEND = "python"
"""The front end :func:`picker` starts (``tests/epp/conftest.py`` runs each test with both)."""


class FleetTransport(httpx.AsyncBaseTransport):
    """Routes each request to the in-process app serving its ``host:port``."""

    def __init__(self) -> None:
        self.apps: dict[str, httpx.ASGITransport] = {}
        self.down: set[str] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        netloc = request.url.netloc.decode()
        if netloc in self.down or netloc not in self.apps:
            raise httpx.ConnectError(f"{netloc} refused", request=request)
        return await self.apps[netloc].handle_async_request(request)


@asynccontextmanager
async def fleet(*roles: str, pooling: int = 0) -> AsyncIterator[tuple[FleetTransport, list[str]]]:
    """Emulated engines (one per role, then ``pooling`` embedding engines) and their URLs."""
    transport = FleetTransport()
    urls: list[str] = []
    async with AsyncExitStack() as stack:
        specs = [(r, "generate") for r in roles] + [("both", "pooling")] * pooling
        for i, (role, runner) in enumerate(specs):
            settings = EmulatorSettings(
                model=EMBED if runner == "pooling" else MODEL,
                time_scale=0.005,
                seed=i,
                engine_index=str(i),
                role=role,  # type: ignore[arg-type]
                runner=runner,  # type: ignore[arg-type]
                host=f"10.0.0.{i + 1}",
                port=8000,
            )
            app = create_emulator_app(settings)
            await stack.enter_async_context(app.router.lifespan_context(app))
            transport.apps[f"10.0.0.{i + 1}:8000"] = httpx.ASGITransport(app=app)
            urls.append(f"http://10.0.0.{i + 1}:8000")
        yield transport, urls


@asynccontextmanager
async def picker(
    transport: FleetTransport,
    engines: list[dict[str, Any]],
    *,
    options: EppOptions | None = None,
    tracer_provider: Any = None,
    **settings: Any,
) -> AsyncIterator[EppServer]:
    """A started :class:`EppServer` on a free port (no /metrics port)."""
    cfg = load_settings(engines=engines, log_requests=False, **settings)
    options = replace(options or EppOptions(port=0, metrics_port=None), frontend=FRONTEND)
    server = EppServer(cfg, options, transport=transport, tracer_provider=tracer_provider)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@dataclass
class Exchanged:
    """What one request through :class:`FakeEnvoy` saw."""

    destination: str = ""
    metadata: str = ""
    set_headers: dict[str, str] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)
    immediate_status: int = 0
    immediate_body: dict[str, Any] = field(default_factory=dict)
    echoed: bytes = b""
    status: int = 0
    content: bytes = b""
    answers: list[pb.ProcessingResponse] = field(default_factory=list)
    call: Any = None
    """The open ext_proc stream when the response was not sent (``respond=False``)."""

    def json(self) -> Any:
        return json.loads(self.content)


def _headers(items: dict[str, str], end: bool) -> pb.HttpHeaders:
    values = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in items.items()]
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=values), end_of_stream=end)


def _metadata(namespace: str, key: str, value: Any) -> base_pb2.Metadata:
    inner = struct_pb2.Struct()
    if isinstance(value, list):
        inner.fields[key].list_value.extend(value)
    else:
        inner.fields[key].string_value = value
    md = base_pb2.Metadata()
    md.filter_metadata[namespace].CopyFrom(inner)
    return md


class FakeEnvoy:
    """Plays Envoy's ext_proc filter against the picker (``mode``: buffered or duplex)."""

    def __init__(self, server: EppServer, transport: FleetTransport, *, tls: Any = None):
        target = f"127.0.0.1:{server.port}"
        self.channel = (
            grpc.aio.secure_channel(target, tls) if tls is not None else
            grpc.aio.insecure_channel(target)
        )  # fmt: skip
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)
        self.engines = httpx.AsyncClient(transport=transport, timeout=30)

    async def aclose(self) -> None:
        await self.engines.aclose()
        await self.channel.close()

    async def send(
        self,
        path: str,
        body: Any = None,
        *,
        method: str = "POST",
        mode: str = "buffered",
        headers: dict[str, str] | None = None,
        subset: list[str] | None = None,
        chunk: int = 16384,
        respond: bool = True,
        served: str | None = None,
        close_after_pick: bool = False,
    ) -> Exchanged:
        """One request: headers and body to the picker, then (``respond``) the picked
        engine's response, forwarded by this client, back to the picker."""
        raw = (
            body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
        )
        duplex = mode == "duplex"
        config = pb.ProtocolConfiguration(
            request_body_mode=MODES.FULL_DUPLEX_STREAMED if duplex else MODES.BUFFERED,
            response_body_mode=MODES.FULL_DUPLEX_STREAMED if duplex else MODES.STREAMED,
        )
        head = {":method": method, ":path": path, ":authority": "gw", **(headers or {})}
        if raw:
            head.setdefault("content-type", "application/json")
        md = (
            _metadata("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", subset)
            if subset is not None
            else None
        )
        call = self.stub.Process()
        out = Exchanged()

        async def answer() -> pb.ProcessingResponse:
            msg = await asyncio.wait_for(call.read(), 20)  # a missing answer fails, not hangs
            assert msg is not grpc.aio.EOF, "the picker closed the stream"
            out.answers.append(msg)
            return msg

        first = pb.ProcessingRequest(
            request_headers=_headers(head, not raw),
            protocol_config=config,
            metadata_context=md,
        )
        await call.write(first)
        picked: pb.ProcessingResponse | None = None
        if not raw:
            picked = await answer()
        elif not duplex:
            msg = await answer()
            if msg.HasField("immediate_response"):
                picked = msg
            else:
                await call.write(
                    pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True))
                )
                picked = await answer()
        else:
            pieces = [raw[i : i + chunk] for i in range(0, len(raw), chunk)]
            for i, piece in enumerate(pieces):
                end = i == len(pieces) - 1
                await call.write(
                    pb.ProcessingRequest(request_body=pb.HttpBody(body=piece, end_of_stream=end))
                )
            picked = await answer()
            if not picked.HasField("immediate_response"):
                echoed: list[bytes] = []
                while True:
                    msg = await answer()
                    stream = msg.request_body.response.body_mutation.streamed_response
                    echoed.append(stream.body)
                    if stream.end_of_stream:
                        break
                out.echoed = b"".join(echoed)
        if picked.HasField("immediate_response"):
            imm = picked.immediate_response
            out.immediate_status = imm.status.code
            out.immediate_body = json.loads(imm.body) if imm.body else {}
            await call.done_writing()
            return out
        common = (
            picked.request_headers.response
            if picked.HasField("request_headers")
            else picked.request_body.response
        )
        for opt in common.header_mutation.set_headers:
            out.set_headers[opt.header.key] = opt.header.raw_value.decode()
        out.removed = list(common.header_mutation.remove_headers)
        out.destination = out.set_headers.get("x-gateway-destination-endpoint", "")
        lb = picked.dynamic_metadata.fields["envoy.lb"].struct_value
        out.metadata = lb.fields["x-gateway-destination-endpoint"].string_value
        if close_after_pick:
            call.cancel()
            return out
        if not respond:
            out.call = call
            return out
        names = out.destination.split(",")
        target = names[1] if served == "fallback" else served or names[0]
        upstream = {k: v for k, v in head.items() if not k.startswith(":")}
        upstream.update(out.set_headers)
        request = self.engines.build_request(
            method, f"http://{target}{path}", content=raw or None, headers=upstream
        )
        resp = await self.engines.send(request, stream=True)
        out.status = resp.status_code
        served_md = _metadata("envoy.lb", "x-gateway-destination-endpoint-served", target)
        await call.write(
            pb.ProcessingRequest(
                response_headers=_headers({":status": str(resp.status_code)}, False),
                metadata_context=served_md,
            )
        )
        await answer()
        body: list[bytes] = []
        async for piece in resp.aiter_raw():
            await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=piece)))
            msg = await answer()
            got = msg.response_body.response.body_mutation.streamed_response.body
            body.append(got if duplex else piece)
        await resp.aclose()
        await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(end_of_stream=True)))
        await answer()
        await call.done_writing()
        out.content = b"".join(body)
        return out
