"""Chained block hashes: the routing key of a prompt.

A prompt is cut into full blocks of ``block_size`` tokens. Block ``k``'s hash
covers tokens ``0 .. (k+1)*block_size`` (it is chained through its parent), so
two prompts share the hash at position ``k`` exactly when they share that whole
prefix. Partial blocks are never hashed, as in vLLM. Hashes are unsigned 64-bit
ints from xxhash's XXH3.

Three sources produce them:

* token ids (exact, what an engine sees),
* text, cut into fixed-size character chunks that approximate token blocks
  (what an HTTP gateway sees without a tokenizer),
* trace ``hash_ids`` (Mooncake traces: prefix hashes of 512-token blocks),
  expanded into engine blocks, and synthetic prompts made of segments.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import MutableMapping, Sequence

import xxhash

TRACE_BLOCK_TOKENS = 512
"""Mooncake traces hash prompts in blocks of this many tokens."""

_ROOT = 0x6B76676174650000  # "kvgate" tag: the parent of the first block
_TRACE_TAG = 0x7472616365000000
_PAIR = struct.Struct("<QQ")
_xxh = xxhash.xxh3_64_intdigest


def _mask(seed: int) -> int:
    return (_ROOT ^ seed) & 0xFFFFFFFFFFFFFFFF


def hashes_from_tokens(tokens: Sequence[int], block_size: int, seed: int = 0) -> tuple[int, ...]:
    """Chained hashes of the full ``block_size``-token blocks of ``tokens``."""
    _check_block_size(block_size)
    out: list[int] = []
    parent = _mask(seed)
    n_full = len(tokens) // block_size
    for k in range(n_full):
        chunk = array("q", tokens[k * block_size : (k + 1) * block_size]).tobytes()
        parent = _xxh(parent.to_bytes(8, "little") + chunk)
        out.append(parent)
    return tuple(out)


def hashes_from_text(text: str, chunk_chars: int, seed: int = 0) -> tuple[int, ...]:
    """Chained hashes of the full ``chunk_chars``-character chunks of ``text``.

    Without a tokenizer, a chunk of about ``block_size * chars_per_token``
    characters stands in for an engine block.
    """
    if chunk_chars <= 0:
        raise ValueError(f"chunk_chars must be positive, got {chunk_chars}")
    out: list[int] = []
    parent = _mask(seed)
    data = text.encode("utf-8", "surrogatepass")
    # Chunk on characters, not bytes, so multi-byte text cuts at the same places.
    if len(data) == len(text):
        for k in range(len(text) // chunk_chars):
            parent = _xxh(
                parent.to_bytes(8, "little") + data[k * chunk_chars : (k + 1) * chunk_chars]
            )
            out.append(parent)
        return tuple(out)
    for k in range(len(text) // chunk_chars):
        piece = text[k * chunk_chars : (k + 1) * chunk_chars].encode("utf-8", "surrogatepass")
        parent = _xxh(parent.to_bytes(8, "little") + piece)
        out.append(parent)
    return tuple(out)


def hashes_from_trace(
    hash_ids: Sequence[int],
    input_length: int,
    block_size: int,
    *,
    trace_block: int = TRACE_BLOCK_TOKENS,
    memo: MutableMapping[tuple[int, int, int], tuple[int, ...]] | None = None,
) -> tuple[int, ...]:
    """Engine-block hashes for a trace prompt given as ``trace_block``-token prefix ids.

    A trace id at position ``k`` already identifies the whole prefix up to the
    end of trace block ``k``, so engine block ``j`` is identified by the id of
    the trace block holding its last token and by ``j`` itself. Only engine
    blocks that lie wholly inside the prompt are returned. When ``block_size``
    divides ``trace_block``, the sub-block hashes of each trace id are cached in
    ``memo`` (shared prefixes are then expanded once).
    """
    _check_block_size(block_size)
    covered = min(input_length, len(hash_ids) * trace_block)
    n_full = covered // block_size
    if n_full == 0:
        return ()
    if trace_block % block_size == 0:
        per = trace_block // block_size
        out: list[int] = []
        full_trace_blocks, rest = divmod(n_full, per)
        for k in range(full_trace_blocks + (1 if rest else 0)):
            subs = _trace_subhashes(hash_ids[k], k, per, memo)
            out.extend(subs if k < full_trace_blocks else subs[:rest])
        return tuple(out)
    return tuple(
        _xxh(
            _PAIR.pack(_TRACE_TAG ^ (hash_ids[((j + 1) * block_size - 1) // trace_block] & _M64), j)
        )
        for j in range(n_full)
    )


_M64 = 0xFFFFFFFFFFFFFFFF


def _trace_subhashes(
    trace_id: int,
    position: int,
    per: int,
    memo: MutableMapping[tuple[int, int, int], tuple[int, ...]] | None,
) -> tuple[int, ...]:
    key = (trace_id, position, per)
    if memo is not None:
        cached = memo.get(key)
        if cached is not None:
            return cached
    base = per * position
    tag = _TRACE_TAG ^ (trace_id & _M64)
    subs = tuple(_xxh(_PAIR.pack(tag, base + i)) for i in range(per))
    if memo is not None:
        memo[key] = subs
    return subs


def hashes_from_segments(
    segments: Sequence[tuple[int, int]], block_size: int, seed: int = 0
) -> tuple[int, ...]:
    """Chained hashes for a synthetic prompt made of ``(segment_id, length)`` pieces.

    Segment ids stand for distinct token sequences: two prompts that start with
    the same segments share every block lying inside that common part.
    """
    _check_block_size(block_size)
    out: list[int] = []
    parent = _mask(seed)
    pieces: list[int] = []
    filled = 0
    for seg_id, length in segments:
        if length < 0:
            raise ValueError(f"segment length must be >= 0, got {length}")
        offset = 0
        while offset < length:
            take = min(block_size - filled, length - offset)
            pieces.extend((seg_id & _M64, offset, take))
            offset += take
            filled += take
            if filled == block_size:
                parent = _xxh(parent.to_bytes(8, "little") + array("Q", pieces).tobytes())
                out.append(parent)
                pieces.clear()
                filled = 0
    return tuple(out)


def _check_block_size(block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")


def partition_seed(seed: int, lora: str = "", cache_salt: str = "") -> int:
    """The hash seed of one cache partition: vLLM shares no block between LoRA adapters
    (the adapter enters every block's hash) nor between cache salts (the salt enters the
    first block's, hence every chained one). The base model without a salt keeps ``seed``."""
    if not lora and not cache_salt:
        return seed
    tag = ("lora\x00" + lora + "\x00salt\x00" + cache_salt).encode("utf-8", "surrogatepass")
    return (seed ^ _xxh(tag)) & _M64
