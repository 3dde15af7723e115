"""Property tests for chained block hashing (gateway/core/blocks.py)."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gateway.core.blocks import (
    TRACE_BLOCK_TOKENS,
    hashes_from_segments,
    hashes_from_text,
    hashes_from_tokens,
    hashes_from_trace,
)

FAST = settings(max_examples=60, deadline=None)

block_sizes = st.sampled_from([1, 2, 3, 4, 7, 16])
tokens_st = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=120)
small_tokens_st = st.lists(st.integers(min_value=0, max_value=3), max_size=80)
# Text: ASCII-heavy, plus multi-byte characters (2, 3 and 4 UTF-8 bytes) and a lone surrogate.
text_alphabet = st.one_of(
    st.characters(min_codepoint=32, max_codepoint=126),
    st.sampled_from(["é", "ß", "日", "本", "€", "😀", "\U0001f680", "\ud800"]),
)
texts = st.text(alphabet=text_alphabet, max_size=80)


def _is_u64(h: int) -> bool:
    return isinstance(h, int) and 0 <= h < 2**64


# --------------------------------------------------------------------------- tokens


@FAST
@given(tokens=tokens_st, bs=block_sizes)
def test_tokens_full_blocks_only(tokens: list[int], bs: int) -> None:
    hashes = hashes_from_tokens(tokens, bs)
    assert isinstance(hashes, tuple)
    assert len(hashes) == len(tokens) // bs
    assert all(_is_u64(h) for h in hashes)
    # A partial tail never contributes a hash, nor changes the full ones.
    full = tokens[: len(hashes) * bs]
    assert hashes_from_tokens(full, bs) == hashes


@FAST
@given(tokens=tokens_st, bs=block_sizes, seed=st.integers(0, 2**64 - 1))
def test_tokens_deterministic_and_input_type_agnostic(
    tokens: list[int], bs: int, seed: int
) -> None:
    a = hashes_from_tokens(tokens, bs, seed)
    assert a == hashes_from_tokens(list(tokens), bs, seed)
    assert a == hashes_from_tokens(tuple(tokens), bs, seed)


@FAST
@given(a=small_tokens_st, b=small_tokens_st, bs=block_sizes)
def test_tokens_prefix_property(a: list[int], b: list[int], bs: int) -> None:
    """Hash k is shared iff the first (k+1)*B tokens are shared."""
    ha, hb = hashes_from_tokens(a, bs), hashes_from_tokens(b, bs)
    for k in range(min(len(ha), len(hb))):
        same_prefix = a[: (k + 1) * bs] == b[: (k + 1) * bs]
        assert (ha[k] == hb[k]) == same_prefix, k


@FAST
@given(
    prefix=tokens_st,
    tail_a=tokens_st,
    tail_b=tokens_st,
    bs=block_sizes,
)
def test_tokens_common_prefix_gives_equal_leading_hashes(
    prefix: list[int], tail_a: list[int], tail_b: list[int], bs: int
) -> None:
    ha = hashes_from_tokens(prefix + tail_a, bs)
    hb = hashes_from_tokens(prefix + tail_b, bs)
    n = len(prefix) // bs
    assert ha[:n] == hb[:n]
    assert ha[:n] == hashes_from_tokens(prefix, bs)


@FAST
@given(
    tokens=st.lists(st.integers(0, 1000), min_size=1, max_size=120), bs=block_sizes, data=st.data()
)
def test_tokens_change_invalidates_every_later_hash(tokens: list[int], bs: int, data) -> None:
    p = data.draw(st.integers(0, len(tokens) - 1), label="position")
    changed = list(tokens)
    changed[p] = tokens[p] + 1 + data.draw(st.integers(0, 5), label="delta")
    ha, hb = hashes_from_tokens(tokens, bs), hashes_from_tokens(changed, bs)
    first = p // bs
    assert ha[:first] == hb[:first]
    for k in range(first, len(ha)):
        assert ha[k] != hb[k], (p, k)


@FAST
@given(
    tokens=st.lists(st.integers(0, 1000), min_size=1, max_size=64),
    bs=block_sizes,
    s1=st.integers(0, 2**64 - 1),
    s2=st.integers(0, 2**64 - 1),
)
def test_tokens_seed_changes_hashes(tokens: list[int], bs: int, s1: int, s2: int) -> None:
    assume(s1 != s2)
    assume(len(tokens) >= bs)
    a, b = hashes_from_tokens(tokens, bs, s1), hashes_from_tokens(tokens, bs, s2)
    assert len(a) == len(b) >= 1
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_tokens_block_order_matters() -> None:
    # Same blocks in a different order: chaining makes every hash differ.
    a = hashes_from_tokens([1, 1, 2, 2], 2)
    b = hashes_from_tokens([2, 2, 1, 1], 2)
    assert a[0] != b[0] and a[1] != b[1]
    assert a[0] != b[1] and a[1] != b[0]


@pytest.mark.parametrize("bad", [0, -1, -16])
def test_invalid_block_size_raises(bad: int) -> None:
    with pytest.raises(ValueError):
        hashes_from_tokens([1, 2, 3], bad)
    with pytest.raises(ValueError):
        hashes_from_trace([1, 2], 1024, bad)
    with pytest.raises(ValueError):
        hashes_from_segments([(1, 10)], bad)
    with pytest.raises(ValueError):
        hashes_from_text("hello world", bad)
    # Even with nothing to hash, a bad block size is an error.
    with pytest.raises(ValueError):
        hashes_from_tokens([], bad)
    with pytest.raises(ValueError):
        hashes_from_trace([], 0, bad)


# --------------------------------------------------------------------------- text


@FAST
@given(text=texts, chunk=st.integers(1, 9))
def test_text_chunks_by_characters(text: str, chunk: int) -> None:
    hashes = hashes_from_text(text, chunk)
    assert len(hashes) == len(text) // chunk
    assert all(_is_u64(h) for h in hashes)
    assert hashes == hashes_from_text(text, chunk)  # deterministic
    assert hashes_from_text(text[: len(hashes) * chunk], chunk) == hashes


@FAST
@given(
    a=st.text(alphabet="aé日😀", max_size=40),
    b=st.text(alphabet="aé日😀", max_size=40),
    chunk=st.integers(1, 6),
)
def test_text_prefix_property(a: str, b: str, chunk: int) -> None:
    ha, hb = hashes_from_text(a, chunk), hashes_from_text(b, chunk)
    for k in range(min(len(ha), len(hb))):
        assert (ha[k] == hb[k]) == (a[: (k + 1) * chunk] == b[: (k + 1) * chunk]), k


@FAST
@given(
    prefix=st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=60),
    tail=st.text(alphabet=text_alphabet, min_size=1, max_size=30),
    chunk=st.integers(1, 8),
)
def test_text_ascii_and_unicode_paths_agree(prefix: str, tail: str, chunk: int) -> None:
    """An ASCII prefix hashes the same whether the rest of the text is ASCII or not."""
    tail = tail + "é"  # force the non-ASCII path for the long text
    n = len(prefix) // chunk
    assert hashes_from_text(prefix + tail, chunk)[:n] == hashes_from_text(prefix, chunk)[:n]


def test_text_non_ascii_counts_characters_not_bytes() -> None:
    text = "日本語のテキスト😀é" * 3  # 10 characters, 28 UTF-8 bytes each
    assert len(text) == 30
    assert len(hashes_from_text(text, 10)) == 3
    assert len(hashes_from_text(text, 7)) == 4
    # Different multi-byte characters with the same length hash differently.
    assert hashes_from_text("日日", 2) != hashes_from_text("本本", 2)
    assert hashes_from_text("é", 1) != hashes_from_text("e", 1)
    # A lone surrogate is accepted.
    assert len(hashes_from_text("a\ud800b\udfff", 2)) == 2


@FAST
@given(
    text=st.text(alphabet=text_alphabet, min_size=4, max_size=40),
    chunk=st.integers(1, 4),
    s1=st.integers(0, 2**64 - 1),
    s2=st.integers(0, 2**64 - 1),
)
def test_text_seed_changes_hashes(text: str, chunk: int, s1: int, s2: int) -> None:
    assume(s1 != s2)
    a, b = hashes_from_text(text, chunk, s1), hashes_from_text(text, chunk, s2)
    assert all(x != y for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------- segments


def _virtual_tokens(segments: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """A segment ``(id, n)`` stands for the tokens ``(id, 0) .. (id, n-1)``."""
    return [(seg, i) for seg, n in segments for i in range(n)]


segments_st = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 12)), max_size=8)


@FAST
@given(segs=segments_st, bs=block_sizes)
def test_segments_full_blocks_only(segs: list[tuple[int, int]], bs: int) -> None:
    hashes = hashes_from_segments(segs, bs)
    assert len(hashes) == sum(n for _, n in segs) // bs
    assert all(_is_u64(h) for h in hashes)
    assert hashes == hashes_from_segments(list(segs), bs)


@FAST
@given(a=segments_st, b=segments_st, bs=block_sizes)
def test_segments_prefix_property(
    a: list[tuple[int, int]], b: list[tuple[int, int]], bs: int
) -> None:
    ha, hb = hashes_from_segments(a, bs), hashes_from_segments(b, bs)
    va, vb = _virtual_tokens(a), _virtual_tokens(b)
    for k in range(min(len(ha), len(hb))):
        assert (ha[k] == hb[k]) == (va[: (k + 1) * bs] == vb[: (k + 1) * bs]), k


@FAST
@given(common=segments_st, a=segments_st, b=segments_st, bs=block_sizes)
def test_segments_common_segments_share_blocks(
    common: list[tuple[int, int]], a: list[tuple[int, int]], b: list[tuple[int, int]], bs: int
) -> None:
    n = sum(length for _, length in common) // bs
    ha = hashes_from_segments(common + a, bs)
    hb = hashes_from_segments(common + b, bs)
    assert ha[:n] == hb[:n] == hashes_from_segments(common, bs)


def test_segments_seed_and_errors() -> None:
    segs = [(7, 40), (9, 8)]
    assert hashes_from_segments(segs, 16, seed=1) != hashes_from_segments(segs, 16, seed=2)
    assert hashes_from_segments(segs, 16) == hashes_from_segments(segs, 16, seed=0)
    # Zero-length segments contribute nothing.
    assert hashes_from_segments([(1, 0), (7, 40), (3, 0), (9, 8)], 16) == hashes_from_segments(
        segs, 16
    )
    with pytest.raises(ValueError):
        hashes_from_segments([(1, 16), (2, -1)], 16)


# --------------------------------------------------------------------------- traces


def _trace_ids(path: list[int]) -> list[int]:
    """Prefix ids the Mooncake way: the id at k names the whole path up to k."""
    out, code = [], 1
    for step in path:
        code = code * 4 + step  # injective: distinct prefixes get distinct ids
        out.append(code)
    return out


trace_paths = st.lists(st.integers(0, 2), max_size=6)


@FAST
@given(path=trace_paths, data=st.data())
def test_trace_block_counts_b16(path: list[int], data) -> None:
    ids = _trace_ids(path)
    length = data.draw(st.integers(0, len(ids) * TRACE_BLOCK_TOKENS + 700), label="input_length")
    hashes = hashes_from_trace(ids, length, 16)
    covered = min(length, len(ids) * TRACE_BLOCK_TOKENS)
    assert len(hashes) == covered // 16
    full_trace_blocks = covered // TRACE_BLOCK_TOKENS
    # 32 engine blocks per full trace block, a partial trace block only its full engine blocks.
    assert len(hashes) == 32 * full_trace_blocks + (covered % TRACE_BLOCK_TOKENS) // 16
    assert all(_is_u64(h) for h in hashes)
    assert len(set(hashes)) == len(hashes)


def test_trace_partial_last_block_examples() -> None:
    ids = [11, 22, 33]
    assert len(hashes_from_trace(ids, 3 * 512, 16)) == 96
    assert len(hashes_from_trace(ids, 2 * 512 + 100, 16)) == 64 + 6
    assert len(hashes_from_trace(ids, 2 * 512 + 15, 16)) == 64
    assert len(hashes_from_trace(ids, 15, 16)) == 0
    assert hashes_from_trace([], 10_000, 16) == ()
    # input_length beyond the ids: only what the ids cover.
    assert len(hashes_from_trace(ids, 10_000, 16)) == 96
    # A partial trace block is a prefix of the full one.
    full = hashes_from_trace(ids, 3 * 512, 16)
    assert hashes_from_trace(ids, 2 * 512 + 100, 16) == full[:70]


@FAST
@given(
    a=trace_paths,
    b=trace_paths,
    bs=st.sampled_from([16, 32, 64, 48, 100, 7, 512, 600]),
    data=st.data(),
)
def test_trace_prefix_property(a: list[int], b: list[int], bs: int, data) -> None:
    """Engine block e is shared iff its tokens lie wholly inside the shared trace blocks."""
    ids_a, ids_b = _trace_ids(a), _trace_ids(b)
    la = data.draw(st.integers(0, len(ids_a) * 512), label="len_a")
    lb = data.draw(st.integers(0, len(ids_b) * 512), label="len_b")
    ha = hashes_from_trace(ids_a, la, bs)
    hb = hashes_from_trace(ids_b, lb, bs)
    assert len(ha) == min(la, len(ids_a) * 512) // bs
    shared = 0
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    shared_tokens = shared * 512
    for e in range(min(len(ha), len(hb))):
        assert (ha[e] == hb[e]) == ((e + 1) * bs <= shared_tokens), (e, shared)


@FAST
@given(
    paths=st.lists(trace_paths, min_size=1, max_size=6),
    bs=st.sampled_from([16, 32, 64, 128, 512, 48, 100]),
    data=st.data(),
)
def test_trace_memo_matches_no_memo(paths: list[list[int]], bs: int, data) -> None:
    memo: dict[int, tuple[int, ...]] = {}
    for path in paths:
        ids = _trace_ids(path)
        length = data.draw(st.integers(0, len(ids) * 512 + 50), label="len")
        with_memo = hashes_from_trace(ids, length, bs, memo=memo)
        assert with_memo == hashes_from_trace(ids, length, bs)
        # Asking again with a warm memo changes nothing.
        assert hashes_from_trace(ids, length, bs, memo=memo) == with_memo


@pytest.mark.parametrize("bs", [48, 100, 7, 1000])
def test_trace_block_size_not_dividing_512(bs: int) -> None:
    ids = [101, 202, 303]
    hashes = hashes_from_trace(ids, 3 * 512, bs)
    assert len(hashes) == 3 * 512 // bs
    assert hashes == hashes_from_trace(ids, 3 * 512, bs)
    # Diverging at trace block 1: blocks ending by token 512 are shared, the rest differ.
    other = hashes_from_trace([101, 999, 888], 3 * 512, bs)
    for e, (x, y) in enumerate(zip(hashes, other, strict=True)):
        assert (x == y) == ((e + 1) * bs <= 512), e


def test_trace_custom_trace_block() -> None:
    ids = [5, 6]
    assert len(hashes_from_trace(ids, 10_000, 16, trace_block=64)) == 8
    assert len(hashes_from_trace(ids, 100, 16, trace_block=64)) == 6
    a = hashes_from_trace([5, 6], 128, 16, trace_block=64)
    b = hashes_from_trace([5, 7], 128, 16, trace_block=64)
    assert a[:4] == b[:4]
    assert all(x != y for x, y in zip(a[4:], b[4:], strict=True))


def test_trace_memo_shared_across_block_sizes() -> None:
    memo: dict[int, tuple[int, ...]] = {}
    ids = [1, 2]
    assert len(hashes_from_trace(ids, 1024, 16, memo=memo)) == 64
    # Same memo, block size 32: 32 engine blocks expected.
    assert hashes_from_trace(ids, 1024, 32, memo=memo) == hashes_from_trace(ids, 1024, 32)


def test_trace_memo_same_id_other_position() -> None:
    memo: dict[int, tuple[int, ...]] = {}
    hashes_from_trace([7], 512, 16, memo=memo)
    assert hashes_from_trace([3, 7], 1024, 16, memo=memo) == hashes_from_trace([3, 7], 1024, 16)


def test_partitions_share_no_block() -> None:
    """Adapters and cache salts each get their own hash chain; the base model keeps its seed
    (breaking partition_seed to return ``seed`` makes the salted keys equal and this fails)."""
    from gateway.core.blocks import partition_seed

    tokens = list(range(64))
    base = hashes_from_tokens(tokens, 16, partition_seed(0))
    assert base == hashes_from_tokens(tokens, 16, 0)
    keys = {
        base,
        hashes_from_tokens(tokens, 16, partition_seed(0, cache_salt="a")),
        hashes_from_tokens(tokens, 16, partition_seed(0, cache_salt="b")),
        hashes_from_tokens(tokens, 16, partition_seed(0, lora="x")),
        hashes_from_tokens(tokens, 16, partition_seed(0, lora="x", cache_salt="a")),
    }
    assert len(keys) == 5
    firsts = {k[0] for k in keys}
    assert len(firsts) == 5  # not even the first block is shared
