"""Parity under load, for every registered policy (``policy_names()``: new ones join by
themselves).

One open-loop run per policy (``load_harness``: 120 requests at 30 req/s on three
real-time emulated engines with small KV caches, shared system prompts, many
requests in flight) goes through ``kvgate serve`` with its decision log on.

* **Replay parity**: the gateway's log (every decide with its request, cluster
  view and clock; every hook in between, in order), fetched over HTTP and
  decoded in this process, replays into a fresh policy with no differing
  answer; and every client got the engine its recorded decision named. The
  gateway goes through the seam, and the policy is a function of what the seam
  hands it.
* **Live vs simulated**: the same arrivals through the simulator with the same
  engine model (token-exact prompts, the live engines' ids) give the same cache
  hit rate and per-engine request shares within the tolerances below.
* **Live vs simulated, request by request** (``load_harness.follow``): the live run's
  requests, at the times the gateway decided them and routed where it routed them, go
  through the simulator; at each one the policy (built from the log's spec) also decides
  on the simulated view. (a) The router's own in-flight count in the live view is never
  below the simulated one on any engine (the live engines run the same model in real
  time plus HTTP, so they cannot finish first): at most ``MAX_BELOW`` of the (request,
  engine) pairs. Measured 0.000 in every run (``python tests/parity/load_harness.py``,
  code 73e6e69, 6 policies x 2 live runs at load average 17-53, live runs up to 7.7x
  slower than scheduled); with the router's in-flight counts dropped from the views
  (``forwarder._view`` passing ``{}``) 0.30-0.80 (5 policies x 2 runs), and the test fails.
  The aggregate shares and the decisions below did not show that mutation (least_loaded's
  share gap 0.017 -> 0.050, its agreement 0.53-0.67 -> 0.60-0.63). (b) The policy decides
  alike on both views for at least ``MIN_AGREEMENT`` of the requests (the measured values
  beside it; the differences come from the router's pending-prefill estimate against the
  simulator's exact uncached tokens, and from the 1 s scrape's phase).

The simulator models what the gateway can see: its engines carry the live engines'
ids (hash rings place them alike) and policies see the engines' waiting, running
and KV-usage numbers as the gateway's 1 s scraper last read them
(``ClusterSpec.scrape_interval_s``). Without that model weighted_scorer's live
shares were 0.33-0.51 away from the simulated ones (the live gateway saw stale
zeros and broke ties at random; the simulator saw every engine's fresh KV usage);
with it, 0.05.

Tolerances, from the spread measured first (``python tests/parity/load_harness.py``:
3 seeds x 2 live runs per policy against one simulation each, on the shared 2-core
machine at load average 8-13; docs/evaluation.md#parity-under-load): the hit rate
within ``HIT_TOLERANCE`` (largest gap measured 0.027 alone, 0.053 in the fast suite with
another pytest-xdist worker on the second core); per-engine shares within
``SHARE_TOLERANCE`` (the largest live-vs-simulated gap measured per policy, plus a
margin of ~0.04). DualMap's shares are compared sorted: which of a prefix's two hash
candidates takes it flips with timing between two live runs too (live-vs-live 0.28),
while how concentrated the traffic is does not. Preble's too, since its load counts each
request's predicted decode time (from the engine's running batch, which moves with timing):
which engine first takes a hot prefix flipped between live and simulated runs (unsorted
gaps 0.28 and 0.18, sorted 0.02 and 0.05). A run outside the bounds is repeated
once with new arrivals (load spikes on the shared machine stall the live run).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_harness import (
    Cluster,
    Followed,
    LiveRun,
    N,
    Served,
    arrivals,
    follow,
    hit_rate,
    max_in_flight,
    run_live,
    run_sim,
    share_gap,
    shares,
    sim_workload,
    start_cluster,
)

from gateway.policies.recording import replay
from gateway.policies.recording_codec import decode_spec
from gateway.policies.registry import policy_names

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HIT_TOLERANCE = 0.07  # 0.053 measured in the fast suite beside another xdist worker
SHARE_TOLERANCE = {  # policy: (largest gap measured, see above) -> tolerance
    "round_robin": 0.02,  # 0.00: the same rotation
    "cache_aware": 0.20,  # 0.16 at load average 11 (in-flight counts run higher live)
    "cost_model": 0.20,  # 0.17
    "predicted_ttft": 0.15,  # 0.11
    "dualmap": 0.20,  # sorted shares: 0.17 (unsorted: live-vs-live 0.28)
}
DEFAULT_SHARE_TOLERANCE = 0.12  # least_loaded, power_of_two, weighted_scorer, preble, ...: <= 0.083
MAX_BELOW = 0.05
"""(request, engine) pairs whose live in-flight count is below the simulated one (0.000
measured; 0.30-0.80 with the router's counts dropped)."""
MIN_AGREEMENT = {  # policy: share of requests decided alike on the live and simulated views
    # (measured at 73e6e69-337bfec, load average 17-53: python tests/parity/load_harness.py
    # prints it as "follow", this test with -rA; a new policy gets DEFAULT_MIN_AGREEMENT)
    "round_robin": 0.99,  # 1.000 in every run (the views do not matter)
    "weighted_scorer": 0.85,  # 0.925-1.000 (5 runs)
    "cache_aware": 0.85,  # 0.967, 0.992
    "preble": 0.85,  # 1.000
    "length_heuristic": 0.45,  # 0.750
    "cost_model": 0.40,  # 0.483-0.717 (0.483 and 0.533 in the fast suite under xdist)
    "kv_cost": 0.5,  # 0.642-0.725 (3 runs)
    "power_of_two": 0.45,  # 0.625, 0.700
    "predicted_ttft": 0.40,  # 0.508-0.742 (the lower in the fast suite under xdist)
    "least_loaded": 0.4,  # 0.533-0.667 (5 runs)
    "dualmap": 0.35,  # 0.500
}
DEFAULT_MIN_AGREEMENT = 0.35
SORTED = {"dualmap", "preble"}
POLICIES = policy_names()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(tmp_path_factory.mktemp("parity-load"))
    try:
        yield c
    finally:
        c.stop()


_RUNS: dict[tuple[str, int], tuple[LiveRun, list[Served], Followed]] = {}


def loaded_run(
    cluster: Cluster, policy: str, seed: int = 0
) -> tuple[LiveRun, list[Served], Followed]:
    """The live run of ``policy``, its simulation, and the live run's requests and routing
    replayed through the simulator (``follow``), once per module, shared by the tests.

    Every run's prompts carry a tag of the same length, so runs share no prefix and
    the token counts match; blocks left by earlier runs are the oldest in each
    cache and are evicted first, as if the cache had started empty.
    """
    key = (policy, seed)
    if key not in _RUNS:
        plan = arrivals(f"p{POLICIES.index(policy):02d}s{seed}", seed=seed)
        live = run_live(cluster, policy, plan, tag=f"{policy}-{seed}")
        workload = sim_workload(cluster, plan)
        _RUNS[key] = (
            live,
            run_sim(policy, workload, cluster.urls),
            follow(workload, live, cluster.urls),
        )
    return _RUNS[key]


@pytest.mark.parametrize("policy", POLICIES)
def test_the_gateways_decision_log_replays_to_the_same_decisions(
    cluster: Cluster, policy: str
) -> None:
    live, _, _ = loaded_run(cluster, policy)
    assert not live.truncated
    decides = [c for c in live.calls if c.method == "decide"]
    assert {c.args[0].id for c in decides} == {s.rid for s in live.served}
    assert len(live.served) == N
    assert max_in_flight(live.calls) >= 6, "the run never had many requests in flight"
    # Every request's hooks are in the log, once each, naming the engine the client got.
    served_on = {s.rid: cluster.urls[s.engine] for s in live.served}
    everyone = Counter(served_on.keys())
    for hook in ("on_routed", "on_first_token", "on_finished"):
        calls = [c for c in live.calls if c.method == hook]
        ids = Counter(c.args[0].id for c in calls)
        missing = len(set(served_on) - set(ids))
        assert ids == everyone, (
            f"{hook}: {len(calls)} calls for {len(served_on)} requests ({missing} missing)"
        )
        if hook != "on_routed":
            wrong = [c.args[0].id for c in calls if c.args[1] != served_on[c.args[0].id]]
            assert not wrong, f"{hook} named another engine than the client's for {wrong[:3]}"
    assert all(c.args[3] for c in live.calls if c.method == "on_finished")  # all succeeded
    # Every view the policy got counts this router's own requests in flight on each engine:
    # those routed (or released from a router queue) and not yet finished, as the log says.
    open_: Counter[str] = Counter()
    for c in live.calls:
        if c.method == "decide":
            seen = {e.id: e.in_flight for e in c.args[1].engines}
            want = {e: open_[e] for e in seen}
            assert seen == want, f"view of {c.args[0].id} counts {seen}, in flight {want}"
        elif c.method == "on_routed" and not c.args[1].hold:
            open_[c.args[1].engine] += 1
        elif c.method == "can_dispatch" and c.result:
            open_[c.args[0].id] += 1
        elif c.method == "on_finished":
            open_[c.args[1]] -= 1
    # The engine each client got is the one the recorded decisions sent it to.
    final = {c.args[0].id: c.result for c in decides}
    moved = {m.request_id: m.target for c in live.calls if c.method == "rebalance"
             for m in c.result}  # fmt: skip
    for s in live.served:
        d = final[s.rid]
        want = moved.get(s.rid, d.engine) if d.hold else d.engine
        assert cluster.urls[s.engine] == want, (s.rid, d)
    mismatches = replay(live.calls, decode_spec(live.spec).build())
    assert not mismatches, f"{len(mismatches)} differing answers, first: {mismatches[:2]}"


@pytest.mark.parametrize("policy", POLICIES)
def test_live_and_simulated_routing_agree_under_load(cluster: Cluster, policy: str) -> None:
    tolerance = SHARE_TOLERANCE.get(policy, DEFAULT_SHARE_TOLERANCE)
    report = []
    agreement = MIN_AGREEMENT.get(policy, DEFAULT_MIN_AGREEMENT)
    for seed in (0, 1):  # a run outside the bounds is repeated once, with new arrivals
        live, sim, followed = loaded_run(cluster, policy, seed)
        hit_gap = abs(hit_rate(live.served) - hit_rate(sim))
        gap = share_gap(live.served, sim, ordered=policy in SORTED)
        report.append(
            f"seed {seed}: hit rate live {hit_rate(live.served):.3f} sim {hit_rate(sim):.3f}; "
            f"shares live {[round(x, 2) for x in shares(live.served)]} "
            f"sim {[round(x, 2) for x in shares(sim)]} (gap {gap:.3f}, bound {tolerance}); "
            f"per request: decided alike {followed.agreement:.3f} (bound {agreement}), "
            f"live in flight below the simulated {followed.below:.3f} (bound {MAX_BELOW}; "
            f"{followed.in_flight:.1f} in flight simulated, gap {followed.in_flight_gap:.1f})"
        )
        print(f"{policy} {report[-1]}")  # shown with -rA: the numbers the bounds rest on
        if (
            hit_gap <= HIT_TOLERANCE
            and gap <= tolerance
            and followed.agreement >= agreement
            and followed.below <= MAX_BELOW
        ):
            return
    pytest.fail(f"{policy}: live and simulated routing differ\n" + "\n".join(report))
