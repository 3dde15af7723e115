"""Bounds on request heads for ``kvgate serve``'s HTTP server (uvicorn).

uvicorn's httptools protocol (the one ``uvicorn[standard]`` picks) puts no limit
on the request line and headers: a client can send megabytes of headers, or
trickle them forever, and the server buffers them. :func:`limited_protocol`
returns a subclass that answers 431 (headers larger than ``max_header_bytes``
or more than ``max_headers`` of them), 414 (a request target larger than
``max_header_bytes``) or 408 (a head not complete within ``header_timeout_s``)
and closes the connection. Bodies are bounded by the app (``max_body_bytes``).
Without httptools, uvicorn's h11 protocol is used with
``h11_max_incomplete_event_size`` set to the same byte bound (h11 answers 431).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

MAX_HEADERS = 256
"""Most header fields in one request."""
HEADER_TIMEOUT_S = 30.0
"""Longest a request head may take to arrive, from its first byte."""
LINGER_S = 1.0
"""After refusing a head, how long the rest of the client's bytes are read and dropped."""


class _HeadTooLargeError(Exception):
    """Raised from a parser callback to stop parsing a refused request."""


def _answer(status: int, message: str) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": status,
            }
        }
    ).encode()
    from http import HTTPStatus

    return b"".join(
        [
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode(),
            b"content-type: application/json\r\n",
            b"content-length: " + str(len(body)).encode() + b"\r\n",
            b"connection: close\r\n\r\n",
            body,
        ]
    )


def limited_protocol(
    max_header_bytes: int,
    *,
    max_headers: int = MAX_HEADERS,
    header_timeout_s: float = HEADER_TIMEOUT_S,
) -> type[asyncio.Protocol]:
    """An httptools protocol class that refuses oversized or slow request heads."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        _head_bytes = 0
        _header_count = 0
        _parsed_bytes = 0
        _in_body = False
        _refused = False
        _head_timer: asyncio.TimerHandle | None = None

        # -- byte counting: everything received while a head is incomplete counts, so
        # httptools never buffers more than one read beyond the bound
        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if not self._in_body:
                self._head_bytes += len(data)
                if self._head_timer is None:
                    self._head_timer = self.loop.call_later(header_timeout_s, self._too_slow)
            super().data_received(data)
            if not self._in_body and not self._refused and self._head_bytes > max_header_bytes:
                self._refuse(431, f"request headers are larger than {max_header_bytes} bytes")

        def on_message_begin(self) -> None:
            self._header_count = 0
            self._parsed_bytes = 0
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            super().on_url(url)
            if len(self.url) > max_header_bytes:
                self._refuse(414, f"request target is longer than {max_header_bytes} bytes")
                raise _HeadTooLargeError

        def on_header(self, name: bytes, value: bytes) -> None:
            # exact count of what was parsed (a head that came in one read escapes the
            # byte count of data_received)
            self._header_count += 1
            self._parsed_bytes += len(name) + len(value) + 4
            if self._header_count > max_headers:
                self._refuse(431, f"more than {max_headers} header fields")
                raise _HeadTooLargeError
            if self._parsed_bytes + len(self.url) > max_header_bytes:
                self._refuse(431, f"request headers are larger than {max_header_bytes} bytes")
                raise _HeadTooLargeError
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_body = True
            self._head_bytes = 0
            self._cancel_timer()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_body = False
            super().on_message_complete()

        def send_400_response(self, msg: str) -> None:
            if not self._refused:  # after a refusal the parser error is ours: answered
                super().send_400_response(msg)

        def _unsupported_upgrade_warning(self) -> None:
            # ws is "none": an Upgrade request is served as plain HTTP, which is no news
            self.logger.debug("ignored an Upgrade header")

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_timer()
            super().connection_lost(exc)

        # -- helpers
        def _too_slow(self) -> None:
            self._head_timer = None
            if not self._in_body and not self._refused:
                self._refuse(408, f"request headers not received within {header_timeout_s:g} s")

        def _cancel_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _refuse(self, status: int, message: str) -> None:
            """Answer, half-close, and close after a short linger: what the client still
            sends meanwhile is read and dropped, so its TCP stack does not get a reset that
            would discard the answer before the client read it."""
            self._refused = True
            self._cancel_timer()
            self.logger.warning("refused a request head: %s", message)
            transport = self.transport
            if not transport.is_closing():
                transport.write(_answer(status, message))
                if transport.can_write_eof():
                    transport.write_eof()
                    self.loop.call_later(LINGER_S, transport.close)
                else:  # pragma: no cover - TCP transports can
                    transport.close()

    return LimitedHttpToolsProtocol


def server_options(max_header_bytes: int) -> dict[str, Any]:
    """uvicorn options bounding request heads: the limited httptools protocol when httptools
    is installed, else h11 with its incomplete-event bound; no WebSocket upgrades."""
    options: dict[str, Any] = {"ws": "none", "h11_max_incomplete_event_size": max_header_bytes}
    try:
        import httptools  # noqa: F401
    except ImportError:  # pragma: no cover - uvicorn[standard] installs it
        options["http"] = "h11"
    else:
        options["http"] = limited_protocol(max_header_bytes)
    return options
