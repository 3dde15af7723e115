"""gateway.core.vllm_hash against vLLM itself, and the chain's properties.

``data/vllm_hash_vectors.json`` was written by ``make_vllm_hash_vectors.py`` running
vLLM 0.32's own block hasher (sha256 and sha256_cbor, block sizes 16 and 32, with and
without a PYTHONHASHSEED seed; plain prompts, and requests with a LoRA adapter, a
cache_salt or both); regenerate it with ``.venv-vllm/bin/python
tests/core/make_vllm_hash_vectors.py``.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.vllm_hash import (
    ALGORITHMS,
    LoraKey,
    block_digests,
    block_ids,
    cbor,
    event_extra_keys,
    event_id,
    extra_keys,
    hash_value,
    none_hash,
)

DATA = Path(__file__).with_name("data") / "vllm_hash_vectors.json"


@cache
def vectors() -> list[dict[str, Any]]:
    doc = json.loads(DATA.read_text(encoding="utf-8"))
    out: list[dict[str, Any]] = doc["vectors"]
    return out


def _id(v: dict[str, Any]) -> str:
    return f"{v['algo']}-seed={v['seed']}-bs{v['block_size']}-{v['name']}"


def _keys(v: dict[str, Any]) -> dict[str, Any]:
    """The vector's request keys as ``block_ids`` takes them."""
    lora = v.get("lora")
    return {
        "lora": None if lora is None else LoraKey(lora["name"], lora["path"]),
        "cache_salt": v.get("cache_salt"),
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(x) for x in value]
    return value


def keyed() -> list[dict[str, Any]]:
    return [v for v in vectors() if "lora" in v]


# -- golden vectors from vLLM ------------------------------------------------------------
def test_the_vectors_cover_what_they_claim() -> None:
    vs = vectors()
    assert {v["algo"] for v in vs} == set(ALGORITHMS)
    assert {v["block_size"] for v in vs} == {16, 32}
    assert None in {v["seed"] for v in vs} and len({v["seed"] for v in vs}) >= 2
    assert sum(len(v["digests"]) for v in vs) > 100  # not a file of empty chains
    ks = keyed()
    assert any(v["lora"] and not v["cache_salt"] for v in ks)
    assert any(v["cache_salt"] and not v["lora"] for v in ks)
    assert any(v["lora"] and v["cache_salt"] for v in ks)
    assert {v["algo"] for v in ks} == set(ALGORITHMS)
    assert sum(len(v["digests"]) for v in ks) > 100


@pytest.mark.parametrize("v", vectors(), ids=_id)
def test_matches_vllm(v: dict[str, Any]) -> None:
    tokens, bs, algo, seed = v["tokens"], v["block_size"], v["algo"], v["seed"]
    assert none_hash(algo, seed).hex() == v["none_hash"]
    keys = _keys(v)
    digests = block_digests(tokens, bs, algo=algo, seed=seed, **keys)
    assert [d.hex() for d in digests] == v["digests"]
    assert list(block_ids(tokens, bs, algo=algo, seed=seed, **keys)) == v["event_ids"]


@pytest.mark.parametrize("v", keyed(), ids=_id)
def test_extra_keys_match_what_vllm_hashed_and_published(v: dict[str, Any]) -> None:
    n = len(v["digests"])
    keys = _keys(v)
    assert [_jsonable(extra_keys(k, **keys)) for k in range(n)] == v["hashed_extra_keys"]
    assert _jsonable(event_extra_keys(n, **keys)) == v["event_extra_keys"]


def test_salt_and_adapter_partition_the_cache_as_vllm_does() -> None:
    """The facts the vectors pin: a salt changes only the first block's own hash (and so
    every later id, through the chain), a LoRA name or path changes every block, the
    adapter's int id and an empty salt change nothing."""
    by_name = {
        v["name"]: v
        for v in vectors()
        if v["algo"] == "sha256" and v["seed"] is None and v["block_size"] == 16
    }
    plain = by_name["range_64"]["event_ids"]
    for name in ("salt", "lora", "lora_other_path", "lora_salt", "salt_unicode"):
        ids = by_name[f"{name}-range_64"]["event_ids"]
        assert all(a != b for a, b in zip(ids, plain, strict=True)), name
    assert by_name["salt_empty-range_64"]["event_ids"] == plain
    assert by_name["lora_other_id-range_64"]["event_ids"] == by_name["lora-range_64"]["event_ids"]
    assert by_name["lora_other_path-range_64"]["event_ids"] != by_name["lora-range_64"]["event_ids"]


def test_defaults_keep_plain_ids() -> None:
    tokens = list(range(40))
    assert block_ids(tokens, 16) == block_ids(tokens, 16, lora=None, cache_salt=None)
    assert block_ids(tokens, 16) == block_ids(tokens, 16, cache_salt="")
    assert extra_keys(0) is None and extra_keys(3, cache_salt="s") is None
    assert event_extra_keys(0, cache_salt="s") is None
    assert event_extra_keys(2) == [None, None]
    assert event_extra_keys(2, start=1, cache_salt="s", lora=LoraKey("a", "/p")) == [
        ("a",),
        ("a",),
    ]


def test_event_ids_are_the_low_64_bits_of_the_digests() -> None:
    for v in vectors():
        for digest, eid in zip(v["digests"], v["event_ids"], strict=True):
            assert event_id(bytes.fromhex(digest)) == eid
            assert eid == int(digest[-16:], 16)


def test_documented_check_value() -> None:
    # docs: NONE_HASH[:8] = 066b1e8987e02713, first block of tokens 0..15 = 3262291359910021016
    assert none_hash().hex().startswith("066b1e8987e02713")
    assert block_ids(list(range(16)), 16)[0] == 3262291359910021016


def test_the_default_seed_is_not_an_unset_seed() -> None:
    assert none_hash("sha256", None) == none_hash("sha256", "vllm-none-hash")
    assert none_hash("sha256", "0") != none_hash("sha256", None)
    assert none_hash("sha256") != none_hash("sha256_cbor")


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unsupported"):
        hash_value(1, "xxhash")
    with pytest.raises(ValueError, match="block_size"):
        block_digests([1, 2, 3], 0)
    with pytest.raises(TypeError):
        cbor(1.5)


def test_canonical_cbor_encodings() -> None:
    # RFC 8949 appendix A examples (canonical = shortest heads)
    assert cbor(0) == bytes.fromhex("00")
    assert cbor(23) == bytes.fromhex("17")
    assert cbor(24) == bytes.fromhex("1818")
    assert cbor(1000) == bytes.fromhex("1903e8")
    assert cbor(1000000) == bytes.fromhex("1a000f4240")
    assert cbor(1000000000000) == bytes.fromhex("1b000000e8d4a51000")
    assert cbor(-1) == bytes.fromhex("20")
    assert cbor(-1000) == bytes.fromhex("3903e7")
    assert cbor(None) == bytes.fromhex("f6")
    assert cbor(True) == bytes.fromhex("f5") and cbor(False) == bytes.fromhex("f4")
    assert cbor(b"\x01\x02\x03\x04") == bytes.fromhex("4401020304")
    assert cbor("IETF") == bytes.fromhex("6449455446")
    assert cbor((1, [2, 3], (4, 5))) == bytes.fromhex("8301820203820405")
    with pytest.raises(ValueError):
        cbor(1 << 64)


# -- properties ---------------------------------------------------------------------------
TOKENS = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=200)
BLOCK = st.sampled_from([1, 2, 3, 16, 32])
ALGO = st.sampled_from(ALGORITHMS)
SEED = st.one_of(st.none(), st.text(max_size=8))


@settings(max_examples=60, deadline=None)
@given(tokens=TOKENS, cut=st.integers(min_value=0, max_value=200), bs=BLOCK, algo=ALGO)
def test_a_prefix_hashes_to_a_prefix(tokens: list[int], cut: int, bs: int, algo: str) -> None:
    full = block_digests(tokens, bs, algo=algo)
    head = block_digests(tokens[:cut], bs, algo=algo)
    assert head == full[: len(head)]
    assert len(head) == min(cut, len(tokens)) // bs


@settings(max_examples=60, deadline=None)
@given(tokens=TOKENS, tail=TOKENS, bs=BLOCK, algo=ALGO)
def test_a_partial_last_block_is_ignored(
    tokens: list[int], tail: list[int], bs: int, algo: str
) -> None:
    whole = tokens[: len(tokens) // bs * bs]
    partial = tail[: bs - 1]
    assert block_ids(whole + partial, bs, algo=algo) == block_ids(whole, bs, algo=algo)
    assert len(block_ids(whole + partial, bs, algo=algo)) == len(whole) // bs


@settings(max_examples=40, deadline=None)
@given(tokens=TOKENS, bs=BLOCK, algo=ALGO, seed=SEED)
def test_deterministic(tokens: list[int], bs: int, algo: str, seed: str | None) -> None:
    a = block_ids(tokens, bs, algo=algo, seed=seed)
    assert a == block_ids(list(tokens), bs, algo=algo, seed=seed)
    assert a == block_ids(tuple(tokens), bs, algo=algo, seed=seed)
    assert all(0 <= x < 2**64 for x in a)


@settings(max_examples=40, deadline=None)
@given(tokens=TOKENS, bs=BLOCK, algo=ALGO)
def test_each_block_chains_on_its_parent(tokens: list[int], bs: int, algo: str) -> None:
    digests = block_digests(tokens, bs, algo=algo)
    parent = none_hash(algo)
    for k, digest in enumerate(digests):
        block = tuple(tokens[k * bs : (k + 1) * bs])
        assert digest == hash_value((parent, block, None), algo)
        parent = digest


@settings(max_examples=40, deadline=None)
@given(tokens=TOKENS.filter(lambda t: len(t) >= 16), pos=st.integers(min_value=0), algo=ALGO)
def test_changing_a_token_changes_its_block_and_every_later_one(
    tokens: list[int], pos: int, algo: str
) -> None:
    bs = 4
    pos %= len(tokens) // bs * bs
    other = list(tokens)
    other[pos] += 1
    a, b = block_ids(tokens, bs, algo=algo), block_ids(other, bs, algo=algo)
    k = pos // bs
    assert a[:k] == b[:k]
    assert all(x != y for x, y in zip(a[k:], b[k:], strict=True))
