"""The worked example of docs/disaggregation.md: the P/D rule and the cost model's pricing
on hand-built cluster views (printed by ``python -m benchmarks.disagg.evaluate example``)."""

from __future__ import annotations

from gateway.core.types import ClusterView, Decision, EngineRole, EngineView, RequestInfo
from gateway.perfmodel.model import PerfModel
from gateway.policies.base import PolicyContext
from gateway.policies.cost_model import CostModelPolicy
from gateway.policies.dispatcher import Dispatcher
from gateway.policies.pd_rule import PDRule, PDSettings, predicted_wait

P, D = EngineRole.PREFILL, EngineRole.DECODE


def _req(rid: str, prompt: int, blocks: tuple[int, ...] = ()) -> RequestInfo:
    return RequestInfo(id=rid, block_hashes=blocks, prompt_tokens=prompt, arrival=0.0)


def rule_table(perf: PerfModel) -> list[str]:
    rule = PDRule(PDSettings(), perf)
    backlog = 20_000
    cases = [
        ("cold 3,000-token document", 3000, 0, 0),
        ("first chat turn, 1,000 tokens", 1000, 0, 0),
        ("next turn, 1,100 tokens", 1100, 800, 0),
        ("long follow-up, 6,000 tokens", 6000, 3500, 0),
        ("cold 3,000 tokens, pool backlogged", 3000, 0, backlog),
        ("12-token question", 12, 0, 0),
    ]
    out = [
        "| request | cached on the decode engine | uncached (share) | prefill pool wait | "
        "decision |",
        "|---|---:|---:|---:|---|",
    ]
    for label, prompt, hit, queued in cases:
        pool = [EngineView("p0", role=P, pending_prefill_tokens=queued)]
        choice = rule.decide(_req(label, prompt), EngineView("d0", role=D), hit, pool)
        wait = rule.pool_wait(pool)
        out.append(
            f"| {label} | {hit:,} | {choice.uncached:,} ({choice.uncached / prompt:.0%}) | "
            f"{wait:.2f} s | {'remote' if choice.remote else 'local'}, `{choice.reason}` |"
        )
    e = EngineView("p0", role=P, pending_prefill_tokens=backlog)
    out.append(
        f"\nPredicted wait of {backlog:,} queued tokens: ceil({backlog:,} / "
        f"{perf.max_num_batched_tokens:,}) chunks x {perf.prefill_a} ms + {backlog:,} x "
        f"{perf.prefill_b} ms = {predicted_wait(perf, e):.2f} s."
    )
    return out


def reuse_table(perf: PerfModel) -> list[str]:
    """A decode engine d0 holding a 704-token system prompt, k requests decoding there; the
    prefill pool holds the prefix too (it prefilled the first turn), or it does not."""
    system = tuple(range(1, 45))
    first = _req("first", 16 * 46 + 5, (*system, 9001, 9002))
    ask = _req("ask", 16 * 63 + 5, (*system, *range(7000, 7019)))
    out = [
        "| prefill pool holds the prefix | requests decoding on d0 | d0, local prefill | "
        "d1, remote prefill | chosen |",
        "|---|---:|---:|---:|---|",
    ]
    for pool_holds in (True, False):
        for k in range(5):
            policy = CostModelPolicy(PolicyContext(perf=perf))
            d = Dispatcher(policy, perf=perf)
            names = [("p0", P), ("p1", P), ("d0", D), ("d1", D)]
            views = [EngineView(n, role=r) for n, r in names]
            if pool_holds:  # the first turn ran remote: p0 prefilled it, d0 loaded it
                seed = d.route(first, ClusterView(tuple(views)), 0.0)
                assert (seed.engine, seed.prefill_engine) == ("d0", "p0")
            else:  # d0 prefilled it itself (say the pool was saturated then)
                policy.on_routed(first, Decision(engine="d0"), 0.0)
            views[2] = EngineView("d0", role=D, num_running=k, in_flight=k)
            view = ClusterView(tuple(views))
            priced = {(dec, pre): cost for dec, pre, cost, _ in policy.explain(ask, view)}
            remote = min(c for (dec, pre), c in priced.items() if dec == "d1")
            chosen = d.route(ask, view, 1.0)
            where = f"{chosen.engine}, {chosen.prefill_engine or 'local'} (`{chosen.pd_reason}`)"
            out.append(
                f"| {'yes' if pool_holds else 'no'} | {k} | {priced[('d0', 'local')]:.3f} s | "
                f"{remote:.3f} s | {where} |"
            )
    return out


def print_example(perf: PerfModel) -> None:
    print(f"\n### The P/D rule on six requests ({perf.name})\n")
    print("\n".join(rule_table(perf)))
    print(
        f"\n### Decode-side reuse against decode load (cost_model, {perf.name}): a "
        "1,013-token chat turn whose 704-token system prompt is cached on d0\n"
    )
    print("\n".join(reuse_table(perf)))
