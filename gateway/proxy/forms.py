"""One field of a ``multipart/form-data`` body (audio uploads name their model there).

Parsed with python-multipart's streaming parser: the file parts are skipped, not
copied, so a 25 MB upload costs one pass over its bytes.
"""

from __future__ import annotations

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from gateway.proxy.errors import ApiError

_MAX_FIELD = 4096
"""Longest field value kept (a model name is far shorter)."""


def form_field(raw: bytes, content_type: str, name: str) -> str | None:
    """The value of the form field ``name`` (the first one), or None when absent; a 400 for
    a body that is not multipart/form-data."""
    kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise ApiError(400, "expected a multipart/form-data body with a boundary")
    wanted = name.encode()
    state: dict[str, bytes] = {"field": b"", "value": b"", "header": b""}
    current: list[bytes | None] = [None]
    found: list[str] = []

    def on_header_field(data: bytes, start: int, end: int) -> None:
        state["header"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        if state["header"].lower() == b"content-disposition":
            state["field"] += data[start:end]

    def on_header_end() -> None:
        state["header"] = b""

    def on_headers_finished() -> None:
        _, disposition = parse_options_header(state["field"])
        current[0] = disposition.get(b"name")
        state["field"] = b""
        state["value"] = b""

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if current[0] == wanted and len(state["value"]) < _MAX_FIELD:
            state["value"] += data[start:end]

    def on_part_end() -> None:
        if current[0] == wanted and not found:
            found.append(state["value"][:_MAX_FIELD].decode("utf-8", "replace"))
        current[0] = None

    parser = MultipartParser(
        boundary,
        {
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        },
    )
    try:
        parser.write(raw)
        parser.finalize()
    except MultipartParseError as exc:
        raise ApiError(400, f"malformed multipart/form-data body: {exc}") from None
    return found[0] if found else None
