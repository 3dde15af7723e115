"""P/D disaggregation on the wire: vLLM's NIXL ``kv_transfer_params``, both ways.

A request whose ``kv_transfer_params.do_remote_decode`` is true is a *prefill
leg*: it runs with ``max_tokens=1`` and its reply carries the parameters a
decode engine needs (:func:`prefill_params`, vLLM 0.33's field set). A request
whose ``do_remote_prefill`` is true is a *decode leg* (:class:`DecodeLeg`):
its prompt KV is pulled from the engine named there. A leg the engine's role
does not play (a decode leg sent to a prefill-only engine, or the reverse) is
served as a plain request, which is also what plain requests get on any role.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from gateway.emulator.kvpins import Pin
from gateway.emulator.protocol import ApiError

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
RELEASE_PATH = "/kvgate/kv_release"
"""Where a decode engine tells the prefill engine its blocks were read."""

_PARAM = "kv_transfer_params"


@dataclass(frozen=True, slots=True)
class PrefillLeg:
    """``do_remote_decode``: compute the prompt, keep its KV for a decode engine."""


@dataclass(frozen=True, slots=True)
class DecodeLeg:
    """``do_remote_prefill``: where the prompt KV is and what the prefill engine said."""

    engine_id: str
    host: str
    port: int
    request_id: str | None
    num_tokens: int | None
    cached_tokens: int | None


Leg = PrefillLeg | DecodeLeg


@dataclass(frozen=True, slots=True)
class KvEndpoint:
    """Where a decode engine finds this engine's KV: the NIXL engine id and address."""

    engine_id: str
    host: str
    port: int


def _bad(message: str) -> ApiError:
    return ApiError(f"Invalid kv_transfer_params: {message}", param=_PARAM)


def _flag(params: dict[str, Any], name: str) -> bool:
    value = params.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"`{name}` must be a boolean, got {type(value).__name__}.")
    return value


def _int(params: dict[str, Any], name: str, *, low: int, high: int | None = None) -> int | None:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"`{name}` must be an integer, got {type(value).__name__}.")
    if value < low or (high is not None and value > high):
        top = "" if high is None else f"..{high}"
        raise _bad(f"`{name}` must be in {low}{top}, got {value}.")
    return value


def _str(params: dict[str, Any], name: str) -> str:
    value = params.get(name)
    if not isinstance(value, str) or not value:
        raise _bad(f"`{name}` must be a non-empty string.")
    return value


def _block_ids(params: dict[str, Any]) -> None:
    """``remote_block_ids``: a list of ints, or one list of ints per KV-cache group."""
    ids = params.get("remote_block_ids")
    if ids is None:
        return
    if not isinstance(ids, list):
        raise _bad("`remote_block_ids` must be a list.")
    for item in ids:
        group = item if isinstance(item, list) else [item]
        if any(isinstance(b, bool) or not isinstance(b, int) for b in group):
            raise _bad("`remote_block_ids` must hold integers or lists of integers.")


def parse_leg(params: Any, role: Role) -> Leg | None:
    """The P/D leg a request's ``kv_transfer_params`` asks for on an engine of ``role``.

    Raises a 400 :class:`ApiError` when the object is malformed.
    """
    if params is None:
        return None
    if not isinstance(params, dict):
        raise _bad(f"expected an object, got {type(params).__name__}.")
    remote_decode = _flag(params, "do_remote_decode")
    remote_prefill = _flag(params, "do_remote_prefill")
    if remote_decode and remote_prefill:
        raise _bad("`do_remote_decode` and `do_remote_prefill` cannot both be true.")
    if remote_decode:
        return PrefillLeg() if role != "decode" else None
    if not remote_prefill:
        return None
    _block_ids(params)
    _int(params, "tp_size", low=1)
    port = _int(params, "remote_port", low=1, high=65535)
    if port is None:
        raise _bad("`remote_port` is required.")
    has_id = params.get("remote_request_id") is not None  # absent in vLLM <= 0.11
    leg = DecodeLeg(
        engine_id=_str(params, "remote_engine_id"),
        host=_str(params, "remote_host"),
        port=port,
        request_id=_str(params, "remote_request_id") if has_id else None,
        num_tokens=_int(params, "remote_num_tokens", low=0),
        cached_tokens=_int(params, "remote_prefill_cached_tokens", low=0),
    )
    return leg if role != "prefill" else None


def prefill_params(pin: Pin, endpoint: KvEndpoint) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill leg's reply (vLLM NIXL, pull mode).

    ``remote_block_ids`` has one list per KV-cache group, as vLLM 0.32+ sends it.
    """
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(pin.block_ids)],
        "remote_engine_id": endpoint.engine_id,
        "remote_request_id": pin.id,
        "remote_host": endpoint.host,
        "remote_port": endpoint.port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": pin.prompt_tokens,
        "remote_blocks_expiry_time": pin.expires,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": pin.cached_tokens,
    }


def release_request(body: Any) -> tuple[str, str | None]:
    """``(remote_request_id, remote_engine_id)`` of a ``POST /kvgate/kv_release`` body."""
    if not isinstance(body, dict):
        raise ApiError("The request body must be a JSON object.")
    rid = body.get("remote_request_id")
    if not isinstance(rid, str) or not rid:
        raise ApiError("`remote_request_id` must be a non-empty string.", param="remote_request_id")
    engine = body.get("remote_engine_id")
    if engine is not None and not isinstance(engine, str):
        raise ApiError("`remote_engine_id` must be a string.", param="remote_engine_id")
    return rid, engine
