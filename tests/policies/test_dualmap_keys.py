"""DualMap's defaults: 512-token key units, shared keys never final, overflow, KV events.

tests/policies/test_dualmap.py pins the paper's mechanisms with single-block keys; these
tests check what the defaults add, on the same exact perf model (1024 prefill tokens/s).
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from gateway.core.blocks import hashes_from_segments
from gateway.core.types import ClusterView, EngineView, RequestInfo
from gateway.perfmodel.model import PerfModel
from gateway.policies import Dispatcher, PolicyContext, create_policy
from gateway.policies.dualmap import DualMapPolicy

BS = 16
UNIT = 512 // BS  # blocks per key unit
PERF = PerfModel(name="test", prefill_a=0.0, prefill_b=1000 / 1024, decode_e0=1.0, block_size=BS)
E8 = tuple(f"e{i}" for i in range(8))
_segs = itertools.count(5_000_000)
_ids = itertools.count()


def make(kv_events: bool = False, **options: object) -> tuple[DualMapPolicy, Dispatcher]:
    ctx = PolicyContext(block_size=BS, perf=PERF, kv_events=kv_events)
    policy = create_policy("dualmap", ctx, options or None)
    assert isinstance(policy, DualMapPolicy)
    policy.on_membership(E8)
    return policy, Dispatcher(policy)


def prompt(*segments: tuple[int, int], extra: int = 1) -> RequestInfo:
    """A request of ``(segment id, tokens)`` pieces (tokens a multiple of the block)."""
    hashes = hashes_from_segments(list(segments), BS)
    return RequestInfo(
        id=f"q{next(_ids)}",
        block_hashes=hashes,
        prompt_tokens=sum(n for _, n in segments) + extra,
        arrival=0.0,
        block_size=BS,
    )


def view(**stats: dict[str, object]) -> ClusterView:
    return ClusterView(tuple(EngineView(id=e, **stats.get(e, {})) for e in E8))  # type: ignore[arg-type]


def test_key_units_are_512_tokens_and_the_last_may_be_partial() -> None:
    policy, _ = make()
    r = prompt((1, 1024), (2, 160))  # 64 + 10 blocks: two whole units and a partial one
    h = r.block_hashes
    assert policy.key_units(r) == (h[UNIT - 1], h[2 * UNIT - 1], h[-1])
    short = prompt((3, 160))  # under one unit: its last full block is its unit
    assert policy.key_units(short) == (short.block_hashes[-1],)
    assert policy.key(short) == (short.block_hashes[-1], 1)


def test_a_system_prompt_shared_by_all_traffic_is_never_the_final_key() -> None:
    """Every request starts with the same 512 tokens: from the first request on, requests key
    on their first divergent unit, so they spread over the ring instead of two engines."""
    policy, d = make()
    system = next(_segs)
    picks: Counter[str] = Counter()
    for _ in range(64):
        r = prompt((system, 512), (next(_segs), 512))
        key, depth = policy.key(r)
        assert depth == 2 and key == r.block_hashes[2 * UNIT - 1]
        decision = d.route(r, view(), 0.0)
        picks[decision.engine] += 1
        d.finished(r, decision.engine, 0.0, True)
    assert len(picks) >= 6, picks  # two candidates would be 2 engines


def test_without_the_shared_rule_the_shared_prompt_pins_two_engines_until_hot() -> None:
    # tpot_aware off in both tests: on this model's slow prefill (1 s per 1,024 tokens) the
    # routed prefill's duty cycle alone breaches TPOT (tested below on a real preset)
    _, d = make(shared_share=0, tpot_aware=False)
    system = next(_segs)
    first = [d.route(prompt((system, 512), (next(_segs), 512)), view(), 0.0) for _ in range(15)]
    assert len({x.engine for x in first}) <= 2  # the warm-up collapse the rule prevents


def test_a_short_prompt_behind_a_shared_prompt_keys_on_its_partial_unit() -> None:
    policy, _ = make()
    system = next(_segs)
    for _ in range(3):
        r = prompt((system, 512), (next(_segs), 96))
        key, depth = policy.key(r)
        assert (key, depth) == (r.block_hashes[-1], 2)
        policy.on_routed(r, policy.decide(r, view(), 0.0), 0.0)


def test_overflow_goes_anywhere_when_both_candidates_breach_and_is_found_again() -> None:
    policy, d = make(queueing=False, rebalance=False, tpot_aware=False)
    doc = prompt((next(_segs), 2048))
    first = d.route(doc, view(), 0.0)
    cands = first.candidates
    d.finished(doc, first.engine, 0.0, True)
    # both candidates 6 s behind (6144 tokens queued), everything else idle
    busy = {c: {"pending_prefill_tokens": 6144} for c in cands}
    again = RequestInfo(
        id="again",
        block_hashes=doc.block_hashes,
        prompt_tokens=doc.prompt_tokens,
        arrival=0.0,
        block_size=BS,
    )
    decision = d.route(again, view(**busy), 1.0)
    assert decision.reason == "dualmap:overflow"
    spill = decision.engine
    assert spill not in cands
    d.finished(again, spill, 1.0, True)
    # the spill engine holds the whole document now: it joins the candidates and wins
    third = RequestInfo(
        id="third",
        block_hashes=doc.block_hashes,
        prompt_tokens=doc.prompt_tokens,
        arrival=0.0,
        block_size=BS,
    )
    decision = d.route(third, view(**busy), 2.0)
    assert (decision.engine, decision.expected_hit_tokens) == (spill, 2048)  # overflow again
    d.finished(third, spill, 2.0, True)
    # once the first candidate forgot it, the holder joins the candidates: plain affinity
    policy.cache.remove(first.engine, doc.block_hashes)
    fourth = RequestInfo(
        id="fourth",
        block_hashes=doc.block_hashes,
        prompt_tokens=doc.prompt_tokens,
        arrival=0.0,
        block_size=BS,
    )
    decision = d.route(fourth, view(**busy), 3.0)
    assert (decision.engine, decision.reason) == (spill, "dualmap:affinity")


def test_overflow_off_keeps_the_two_candidates() -> None:
    _, d = make(queueing=False, rebalance=False, overflow=False)
    doc = prompt((next(_segs), 2048))
    cands = d.route(doc, view(), 0.0).candidates
    busy = {c: {"pending_prefill_tokens": 6144} for c in cands}
    assert d.route(doc, view(**busy), 1.0).engine in cands


def test_a_first_seen_key_balances_at_a_quarter_of_the_slo() -> None:
    """The preferred candidate (lower KV usage; the paper's tie-break) is 2 s behind, the other
    idle: a first-seen key moves (2 s > 0.25 x 5 s); a key seen in the window keeps affinity
    (2 s < 5 s)."""
    two = {"queueing": False, "rebalance": False, "tie_by_estimate": False, "fresh_spread": False}
    policy, d = make(**two)
    r = prompt((next(_segs), 1024))
    a, b = policy.candidates(policy.key(r)[0], view())
    stats = {a.id: {"pending_prefill_tokens": 2048, "kv_usage": 0.1}, b.id: {"kv_usage": 0.5}}
    decision = d.route(r, view(**stats), 0.0)
    assert (decision.engine, decision.reason) == (b.id, "dualmap:slo")
    seen = RequestInfo(
        id="seen", block_hashes=r.block_hashes, prompt_tokens=r.prompt_tokens, arrival=0.0
    )
    # same key, now in the window; no cached blocks on either (forget b's copy)
    policy.cache.remove_engine(b.id)
    assert d.route(seen, view(**stats), 1.0).engine == a.id
    paper_policy, paper = make(**two, fresh_headroom=1.0)
    fresh = prompt((next(_segs), 1024))
    pa, pb = paper_policy.candidates(paper_policy.key(fresh)[0], view())
    stats = {pa.id: {"pending_prefill_tokens": 2048, "kv_usage": 0.1}, pb.id: {"kv_usage": 0.5}}
    assert paper.route(fresh, view(**stats), 0.0).engine == pa.id


@pytest.mark.parametrize(("tie_by_estimate", "idle_wins"), [(True, True), (False, False)])
def test_equal_hits_go_to_the_lower_estimate_before_kv_usage(
    tie_by_estimate: bool, idle_wins: bool
) -> None:
    """Nothing cached on either candidate; the one with lower (scraped, maybe stale) KV usage
    has 64 tokens of prefill queued by this router (1/16 s; both stay below the fresh-key
    breach): the queue decides, unless the paper's tie-break (KV usage) is asked for."""
    policy, d = make(
        queueing=False, rebalance=False, tie_by_estimate=tie_by_estimate, fresh_spread=False
    )
    r = prompt((next(_segs), 1024))
    a, b = policy.candidates(policy.key(r)[0], view())
    stats = {a.id: {"pending_prefill_tokens": 64, "kv_usage": 0.1}, b.id: {"kv_usage": 0.5}}
    decision = d.route(r, view(**stats), 0.0)
    assert decision.engine == (b.id if idle_wins else a.id)
    assert decision.reason == "dualmap:affinity"


def test_kv_events_feed_the_prompt_lru() -> None:
    """With KV events, blocks another replica put on an engine count as cached there."""
    policy, d = make(kv_events=True, queueing=False, rebalance=False)
    assert policy.wants_cache_events
    r = prompt((next(_segs), 2048))
    _, b = policy.candidates(policy.key(r)[0], view())
    d.cache_event(b.id, r.block_hashes, ())
    decision = d.route(r, view(), 0.0)
    assert decision.engine == b.id and decision.expected_hit_tokens == 2048
    d.cache_event(b.id, (), r.block_hashes)
    d.cache_reset(b.id)
    assert make()[0].wants_cache_events is False


def test_a_candidate_whose_decodes_would_miss_tpot_breaches() -> None:
    """``tpot_aware``: the engine holding the prompt was just sent ~9 s of prefill (duty
    cycle ~0.9 over 10 s): with 40 decodes running there, a step carrying a prefill chunk
    takes ~0.3 s, so the request's predicted TPOT misses 0.1 s and it goes to its other
    candidate; with the check off it stays on the holder (its TTFT estimate is fine)."""
    from gateway.perfmodel.presets import load_preset

    a6000 = load_preset("mistral-7b-a6000")
    for aware, stays in ((True, False), (False, True)):
        ctx = PolicyContext(block_size=BS, perf=a6000)
        policy = create_policy("dualmap", ctx, {"tpot_aware": aware})
        assert isinstance(policy, DualMapPolicy)
        policy.on_membership(E8)
        d = Dispatcher(policy)
        seg = next(_segs)
        r = prompt((seg, 1024))
        holder = d.route(r, view(), 0.0).engine
        d.finished(r, holder, 0.1, True)
        only = {e: {"healthy": e == holder} for e in E8}
        for _ in range(10):  # cold 8k-token documents: ~0.9 s of prefill each
            big = prompt((next(_segs), 8192))
            assert d.route(big, view(**only), 0.2).engine == holder
            d.finished(big, holder, 0.3, True)
        stats = {holder: {"num_running": 40, "kv_usage": 0.5, "kv_capacity_blocks": 14_000}}
        again = d.route(prompt((seg, 1024)), view(**stats), 1.0)  # the same prompt again
        assert (again.engine == holder) is stays, (aware, again.reason)


def test_a_prompt_with_nothing_cached_anywhere_goes_to_the_lowest_estimate_anywhere() -> None:
    """Unique prompts (``fresh_spread``): both ring candidates 0.25 s behind (0.75 s with
    the prompt: under the fresh-key breach at 1.25 s), six engines idle: a prompt no engine
    holds a block of goes to an idle engine; with two candidates only it stays on one of
    them (power of two choices, which trails least loaded on unique prompts). A prompt
    sharing a cached block keeps its two candidates, and on an idle cluster the spread
    follows the ring."""
    opts = {"queueing": False, "rebalance": False, "tpot_aware": False}
    policy, d = make(**opts)
    r = prompt((next(_segs), 512))
    a, b = policy.candidates(policy.key(r)[0], view())
    busy = {a.id: {"pending_prefill_tokens": 256}, b.id: {"pending_prefill_tokens": 256}}
    decision = d.route(r, view(**busy), 0.0)
    assert decision.reason == "dualmap:spread" and decision.engine not in (a.id, b.id)
    assert decision.candidates == (a.id, b.id)
    _, two = make(**opts, fresh_spread=False)
    assert two.route(r, view(**busy), 0.0).engine in (a.id, b.id)
    # a cached first block (16 tokens of a system prompt, say): the paper's two candidates
    head = next(_segs)
    first = prompt((head, 16), (next(_segs), 496))
    d.finished(first, d.route(first, view(), 1.0).engine, 1.0, True)
    shared = prompt((head, 16), (next(_segs), 496))
    sa, sb = policy.candidates(policy.key(shared)[0], view())
    busy = {sa.id: {"pending_prefill_tokens": 256}, sb.id: {"pending_prefill_tokens": 256}}
    assert d.route(shared, view(**busy), 2.0).engine in (sa.id, sb.id)
    # nothing loaded anywhere: the ring's first candidate, as the paper's rings place it
    idle = prompt((next(_segs), 1024))
    assert d.route(idle, view(), 3.0).engine == policy.candidates(policy.key(idle)[0], view())[0].id
