"""The cost model in a disaggregated pool: the P/D rule decides local vs remote, prices pick."""

from __future__ import annotations

from collections import Counter

from gateway.core.types import ClusterView, EngineRole, EngineView, RequestInfo
from gateway.perfmodel.presets import load_preset
from gateway.policies import Dispatcher, PolicyContext, create_policy
from gateway.policies.pd_rule import PDSettings

PERF = load_preset("mistral-7b-a6000")
BS = 16
P, D = EngineRole.PREFILL, EngineRole.DECODE


def request(rid: str, blocks: tuple[int, ...], arrival: float = 0.0) -> RequestInfo:
    return RequestInfo(
        id=rid, block_hashes=blocks, prompt_tokens=BS * len(blocks) + 5, arrival=arrival
    )


def cold(i: int, tokens: int) -> RequestInfo:
    return request(f"cold{i}", tuple(range(i * 10_000, i * 10_000 + tokens // BS)), float(i))


def view(**load: dict[str, int]) -> ClusterView:
    names = [("p0", P), ("p1", P), ("d0", D), ("d1", D)]
    return ClusterView(tuple(EngineView(n, role=r, **load.get(n, {})) for n, r in names))  # type: ignore[arg-type]


def policy(**options: object) -> Dispatcher:
    ctx = PolicyContext(perf=PERF, block_size=BS)
    return Dispatcher(create_policy("cost_model", ctx, options or None), perf=PERF)


def serve(d: Dispatcher, r: RequestInfo, v: ClusterView) -> tuple[str | None, str, str]:
    """Route ``r`` and let it finish before the next one (a request at a time)."""
    decision = d.route(r, v, r.arrival)
    if decision.prefill_engine is not None:
        d.prefill_done(r, decision.prefill_engine, r.arrival + 0.2, ok=True)
    d.finished(r, decision.engine, r.arrival + 0.5, ok=True)
    return decision.prefill_engine, decision.engine, decision.pd_reason


def test_a_long_cold_prompt_is_prefilled_on_the_idle_prefill_pool() -> None:
    """The issue's reproduction: before the rule, an idle decode engine looked cheaper."""
    assert serve(policy(), cold(0, 3000), view())[0] in {"p0", "p1"}
    overridden = serve(policy(follow_pd_rule=False), cold(0, 3000), view())
    assert overridden[0] is None and overridden[2] == "local_priced"


def test_cold_prompts_one_after_another_use_both_prefill_and_both_decode_engines() -> None:
    d = policy()
    legs = [serve(d, cold(i, 3000), view()) for i in range(8)]
    assert Counter(p for p, _, _ in legs) == {"p0": 4, "p1": 4}
    assert Counter(e for _, e, _ in legs) == {"d0": 4, "d1": 4}
    assert {reason for _, _, reason in legs} == {"remote_long"}


def test_a_chat_sequence_prefills_the_first_remotely_then_reuses_its_decode_engine() -> None:
    system = tuple(range(1, 45))  # a 704-token shared system prompt
    d = policy()
    legs = [
        serve(d, request(f"q{i}", system + tuple(range(100 * (i + 1), 100 * (i + 1) + 12))), view())
        for i in range(6)
    ]
    first, rest = legs[0], legs[1:]
    assert first[0] is not None and first[2] == "remote_uncached"
    # 204 uncached tokens on the engine that holds the prefix: local prefill there, each time
    assert {(p, e, reason) for p, e, reason in rest} == {(None, first[1], "local_cached")}


def test_decode_load_outweighs_decode_side_reuse() -> None:
    """The engine holding the prefix wins while idle; with requests decoding there, the
    other decode engine wins and the prefix is reused on the prefill engine instead."""
    system = tuple(range(1, 45))
    d = policy()
    p0, d0, _ = serve(d, request("q0", (*system, 7007, 7008)), view())
    assert p0 is not None
    ask = request("q1", (*system, 9009, 9010, 9011))
    idle = d.route(ask, view(), 1.0)
    assert (idle.engine, idle.prefill_engine, idle.pd_reason) == (d0, None, "local_cached")
    d.finished(ask, idle.engine, 1.5, ok=True)
    busy = {d0: {"num_running": 2, "in_flight": 2}}
    moved = d.route(request("q2", (*system, 1212, 1213)), view(**busy), 2.0)
    assert moved.engine != d0 and moved.prefill_engine == p0
    assert moved.pd_reason == "remote_uncached"


def test_a_saturated_prefill_pool_sends_long_prompts_to_local_prefill() -> None:
    backlog = int(2.0 * 1000 / PERF.prefill_b)  # ~2 s of queued prefill on each
    v = view(p0={"pending_prefill_tokens": backlog}, p1={"pending_prefill_tokens": backlog})
    prefill, _, reason = serve(policy(), cold(0, 3000), v)
    assert prefill is None and reason == "local_saturated"
    ctx = PolicyContext(perf=PERF, block_size=BS, pd=PDSettings(saturation_wait_s=5.0))
    patient = Dispatcher(create_policy("cost_model", ctx), perf=PERF, pd=ctx.pd)
    assert serve(patient, cold(0, 3000), v)[0] is not None


def test_the_prefill_engine_is_chosen_by_queued_work_and_cache() -> None:
    """A prefill engine holding 1,008 of the prompt's tokens (108 ms of prefill saved) wins
    over an idle one while its queue is shorter than that, and loses beyond."""
    doc = tuple(range(1, 64))
    for queued, cache_pays in ((500, True), (20_000, False)):
        d = policy()
        holder, _, _ = serve(d, request("doc", (*doc, *range(5000, 5140))), view())
        assert holder is not None
        other = "p1" if holder == "p0" else "p0"
        v = view(**{holder: {"pending_prefill_tokens": queued}})
        again = request("again", (*doc, *range(6000, 6140)), 1.0)
        assert serve(d, again, v)[0] == (holder if cache_pays else other)


def test_requests_in_flight_on_a_decode_engine_count_before_the_engine_reports_them() -> None:
    """A burst: three requests just routed to the engine holding the prefix (not yet in its
    scraped queues) outweigh the transfer its cached 1,008 tokens would save."""
    doc = tuple(range(1, 64))
    d = policy()
    _, holder, _ = serve(d, request("doc", (*doc, *range(5000, 5200))), view())
    other = "d1" if holder == "d0" else "d0"
    big = request("big", (*doc, *range(7000, 7200)), 1.0)  # 3,200 uncached: remote_long
    assert d.route(big, view(), 1.0).engine == holder  # idle: the transfer saved decides
    d.finished(big, holder, 1.5, ok=True)
    burst = view(**{holder: {"in_flight": 3}})
    assert d.route(request("big2", (*doc, *range(8000, 8200)), 2.0), burst, 2.0).engine == other
