"""A minimal OpenAI-style engine for the overhead benchmark that times every request it serves.

Raw asyncio HTTP/1.1 (keep-alive, no framework), so its own cost is small and
steady. For each ``POST /v1/completions`` it notes, on the machine-wide
monotonic clock, when the request's head arrived and when its answer was
written, keyed by ``x-request-id``; ``GET /_spans`` returns them as JSON. With
those spans the benchmark computes each request's *own* added latency (client
time minus the engine's span), not a difference of two distributions' tails.

    python -m benchmarks.speed.overhead_stub PORT MODEL
"""

from __future__ import annotations

import asyncio
import json
import time

from benchmarks.common import benchmark_parser

_MODELS = '{{"object":"list","data":[{{"id":"{model}","object":"model","max_model_len":4096}}]}}'
_METRICS = (
    '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name="{m}"}} 0.0\n'
    '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name="{m}"}} 0.0\n'
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{{block_size="16",num_gpu_blocks="10000"}} 1.0\n'
)
_COMPLETION = (
    '{{"id":"cmpl-1","object":"text_completion","model":"{m}","choices":[{{"index":0,'
    '"text":" ok","finish_reason":"length"}}],"usage":{{"prompt_tokens":60,'
    '"completion_tokens":1,"total_tokens":61}}}}'
)
_CHUNK = (
    'data: {{"id":"cmpl-1","object":"text_completion","model":"{m}","choices":[{{"index":0,'
    '"text":" ok","finish_reason":"length"}}]}}\n\ndata: [DONE]\n\n'
)


class Stub:
    def __init__(self, model: str) -> None:
        self.model = model
        self.spans: dict[str, tuple[float, float]] = {}

    def _answer(self, path: str, stream: bool) -> tuple[bytes, bytes]:
        m = self.model
        if path == "/v1/models":
            return b"application/json", _MODELS.format(model=m).encode()
        if path == "/metrics":
            return b"text/plain; version=0.0.4", _METRICS.format(m=m).encode()
        if path == "/_spans":
            return b"application/json", json.dumps(self.spans).encode()
        if path == "/v1/completions":
            if stream:
                return b"text/event-stream", _CHUNK.format(m=m).encode()
            return b"application/json", _COMPLETION.format(m=m).encode()
        return b"application/json", b"{}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                t0 = time.monotonic()
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split(" ")[1]
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
                }
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                stream = b'"stream":true' in body.replace(b" ", b"")
                ctype, payload = self._answer(path, stream)
                if stream:
                    size = f"{len(payload):x}\r\n".encode()
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: " + ctype + b"\r\n"
                        b"transfer-encoding: chunked\r\n\r\n" + size + payload + b"\r\n0\r\n\r\n"
                    )
                else:
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: " + ctype
                        + f"\r\ncontent-length: {len(payload)}\r\n\r\n".encode() + payload
                    )  # fmt: skip
                await writer.drain()
                rid = headers.get("x-request-id")
                if path == "/v1/completions" and rid:
                    self.spans[rid] = (t0, time.monotonic())
        except (asyncio.IncompleteReadError, ConnectionError, IndexError, ValueError):
            pass
        finally:
            writer.close()


async def main(port: int, model: str) -> None:
    stub = Stub(model)
    server = await asyncio.start_server(stub.serve, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    ap = benchmark_parser(__doc__, "benchmarks.speed.overhead_stub")
    ap.add_argument("port", type=int, help="the 127.0.0.1 port to listen on")
    ap.add_argument("model", help="the model name it serves")
    args = ap.parse_args()
    asyncio.run(main(args.port, args.model))
