"""vLLM-compatible prefix-cache block hashes, computed outside the engine.

vLLM (>= 0.30, V1 engine) hashes a prompt's full blocks in a chain::

    NONE_HASH = H(seed)                       # seed: $PYTHONHASHSEED, else "vllm-none-hash"
    h_i = H((h_{i-1} or NONE_HASH, tuple(block_token_ids), extra_keys))

with ``extra_keys = None`` for plain text, and ``H`` chosen by
``--prefix-caching-hash-algo``: ``sha256`` (SHA-256 of a protocol-5 pickle, the
default) or ``sha256_cbor`` (SHA-256 of canonical CBOR). KV events carry the
low 64 bits of each digest (``int.from_bytes(digest, "big") & (2**64 - 1)``).
Token ids must be the engine's own (BOS and chat template included, as
``/tokenize`` returns them). The ``xxhash`` variants are seeded randomly per
process unless ``PYTHONHASHSEED`` is set, so they cannot be reproduced.

Extra keys (vLLM 0.32, ``generate_block_hash_extra_keys``): a block's
``extra_keys`` is the tuple ``lora + mm + cache_salt + prompt_embeds``, or
``None`` when that is empty, each entry tagged with its source:

* LoRA, on every block: ``("lora", lora_name, lora_path)``; the path is the one
  the adapter was loaded from, which ``/v1/models`` lists as the adapter's
  ``root`` (the int ``lora_int_id`` is not hashed) -- :class:`LoraKey`;
* ``cache_salt``, on the first block only and only when non-empty:
  ``("cache_salt", salt)``;
* multimodal ``("mm", identifier, offset_in_block)`` on blocks overlapping a
  placeholder, and ``("prompt_embeds", sha256)``: not reproduced here; a router
  in token-exact mode keys such requests by text.

KV events publish these keys untagged (``to_event_extra_keys``):
``BlockStored.lora_name`` is the adapter name (``lora_id`` its int id, both
``None`` without one) and ``extra_keys`` holds one entry per stored block:
``(lora_name,)`` on a LoRA block, ``(lora_name, salt)`` / ``(salt,)`` on a
salted first block, ``None`` on a block without keys (so a plain request's
events carry ``[None, None, ...]``). The adapter path is not published, so the ids
are only reproducible with the path ``/v1/models`` reports --
:func:`event_extra_keys` gives the published form.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ALGORITHMS = ("sha256", "sha256_cbor")
DEFAULT_SEED = "vllm-none-hash"
_M64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class LoraKey:
    """What vLLM hashes of a request's LoRA adapter: its name and the path it was loaded from."""

    name: str
    path: str

    def hash_key(self) -> tuple[str, str, str]:
        """The adapter's entry in every block's ``extra_keys``."""
        return ("lora", self.name, self.path)


def _cbor_head(major: int, value: int) -> bytes:
    if value < 24:
        return bytes([major << 5 | value])
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * size):
            return bytes([major << 5 | extra]) + value.to_bytes(size, "big")
    raise ValueError("integer too large for CBOR")


def cbor(value: Any) -> bytes:
    """Canonical CBOR (RFC 8949 §4.2) for the types block hashing uses."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        return b"\xf5" if value else b"\xf4"
    if isinstance(value, int):
        return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        data = value.encode("utf-8")
        return _cbor_head(3, len(data)) + data
    if isinstance(value, list | tuple):
        return _cbor_head(4, len(value)) + b"".join(cbor(v) for v in value)
    raise TypeError(f"cannot CBOR-encode {type(value).__name__}")


def hash_value(value: Any, algo: str = "sha256") -> bytes:
    """``H(value)`` as vLLM computes it."""
    if algo == "sha256":
        return hashlib.sha256(pickle.dumps(value, protocol=5)).digest()
    if algo == "sha256_cbor":
        return hashlib.sha256(cbor(value)).digest()
    raise ValueError(f"unsupported prefix-caching hash algorithm {algo!r} (use {ALGORITHMS})")


def none_hash(algo: str = "sha256", seed: str | None = None) -> bytes:
    """The parent of a prompt's first block."""
    return hash_value(seed if seed is not None else DEFAULT_SEED, algo)


def extra_keys(
    index: int, *, lora: LoraKey | None = None, cache_salt: str | None = None
) -> tuple[tuple[str, ...], ...] | None:
    """The ``extra_keys`` vLLM hashes into the block at ``index`` (0 = the prompt's first)."""
    keys: list[tuple[str, ...]] = []
    if lora is not None:
        keys.append(lora.hash_key())
    if index == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def event_extra_keys(
    n_blocks: int, *, start: int = 0, lora: LoraKey | None = None, cache_salt: str | None = None
) -> list[tuple[str, ...] | None] | None:
    """``BlockStored.extra_keys`` for blocks ``start .. start + n_blocks - 1`` (untagged)."""
    if n_blocks <= 0:
        return None
    out: list[tuple[str, ...] | None] = []
    for k in range(start, start + n_blocks):
        keys = extra_keys(k, lora=lora, cache_salt=cache_salt)
        out.append(None if keys is None else tuple(key[1] for key in keys))
    return out


def block_digests(
    tokens: Sequence[int],
    block_size: int,
    *,
    algo: str = "sha256",
    seed: str | None = None,
    lora: LoraKey | None = None,
    cache_salt: str | None = None,
) -> list[bytes]:
    """Full 32-byte digests of the prompt's full blocks (for ``lora`` / ``cache_salt`` if given)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    parent = none_hash(algo, seed)
    out = []
    for k in range(len(tokens) // block_size):
        block = tuple(tokens[k * block_size : (k + 1) * block_size])
        keys = extra_keys(k, lora=lora, cache_salt=cache_salt)
        parent = hash_value((parent, block, keys), algo)
        out.append(parent)
    return out


def event_id(digest: bytes) -> int:
    """The 64-bit block id vLLM's KV events publish for a digest."""
    return int.from_bytes(digest, "big") & _M64


def block_ids(
    tokens: Sequence[int],
    block_size: int,
    *,
    algo: str = "sha256",
    seed: str | None = None,
    lora: LoraKey | None = None,
    cache_salt: str | None = None,
) -> tuple[int, ...]:
    """The KV-event ids of a prompt's full blocks: kvgate's routing key in token-exact mode."""
    digests = block_digests(
        tokens, block_size, algo=algo, seed=seed, lora=lora, cache_salt=cache_salt
    )
    return tuple(event_id(d) for d in digests)
