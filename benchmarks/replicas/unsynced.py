"""What do gateway replicas lose without replica sync? SLO attainment of one router against
``--replicas`` routers that each see only their own load, in the simulator.

    python -m benchmarks.replicas.unsynced SPEC RATES [--replicas 3] [--requests 300]
        [--preset P] [--instances 8] [--kv-events] [--policies a,b:knob=v;knob=v]

Without ``replica_sync.nats_url`` a replica's ``in_flight`` and ``pending_prefill_tokens``
count only the requests it routed itself (about 1/N of them, ``docs/deployment.md``, several
replicas); the engines' waiting and running counts and KV use come from the ``/metrics``
scrape, here every 1 s. Requests are dealt to the replicas in turn. ``--kv-events``: every
replica receives every engine's KV events (``kv_events: true``), so prefix state is shared
and only the load is not. SPEC is a simulator spec (a ``{seed}`` in it is replaced by
``--seed``), scaled to each of RATES (req/s, comma-separated). One line per policy and
replica count: attainment and the busiest engine's share of requests at each rate.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import cast

from benchmarks.common import benchmark_parser
from benchmarks.quality.diagnose import parse_policy
from gateway.core.types import ClusterView, Decision, EngineId, RequestInfo
from gateway.perfmodel.presets import DEFAULT_PRESET, load_preset
from gateway.policies.base import Policy, PolicyBase, PolicyContext
from gateway.policies.registry import create_policy
from gateway.sim.loop import ClusterSpec, Simulation
from gateway.sim.metrics import slo_attainment
from gateway.sim.workloads import Workload, WorkloadOptions, load_workload

SCRAPE_S = 1.0
"""The gateway's default ``health.interval_s``: how often engine-reported load is refreshed."""


class UnsyncedReplicas(PolicyBase):
    """``len(replicas)`` routers dealt requests in turn, each shown its own load only."""

    name = "unsynced_replicas"

    def __init__(self, replicas: Sequence[Policy]) -> None:
        if not replicas:
            raise ValueError("at least one replica")
        self.replicas = list(replicas)
        self.wants_cache_events = any(p.wants_cache_events for p in self.replicas)
        self._owner: dict[tuple[str, float], int] = {}  # requests in flight -> their replica
        self._dealt = 0
        self._flight: list[Counter[EngineId]] = [Counter() for _ in self.replicas]
        self._pending: list[Counter[EngineId]] = [Counter() for _ in self.replicas]
        self._prefill: dict[str, tuple[int, EngineId, int]] = {}  # not past its first token

    def owner(self, req: RequestInfo) -> int:
        """The replica that routes ``req`` (requests are dealt in turn, legs stay together)."""
        key = (req.id, req.arrival)
        if key not in self._owner:
            self._owner[key] = self._dealt % len(self.replicas)
            self._dealt += 1
        return self._owner[key]

    def own_view(self, replica: int, view: ClusterView) -> ClusterView:
        """``view`` with the router-side counts of ``replica``'s own requests only."""
        flight, pending = self._flight[replica], self._pending[replica]
        return ClusterView(
            tuple(
                replace(e, in_flight=flight[e.id], pending_prefill_tokens=pending[e.id])
                for e in view.engines
            )
        )

    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        r = self.owner(req)
        return self.replicas[r].decide(req, self.own_view(r, view), now)

    def on_routed(self, req: RequestInfo, decision: Decision, now: float) -> None:
        r = self.owner(req)
        uncached = max(0, req.prompt_tokens - decision.expected_hit_tokens)
        self._flight[r][decision.engine] += 1
        self._pending[r][decision.engine] += uncached
        self._prefill[req.id] = (r, decision.engine, uncached)
        self.replicas[r].on_routed(req, decision, now)

    def _prefilled(self, req: RequestInfo) -> None:
        held = self._prefill.pop(req.id, None)
        if held is not None:
            self._pending[held[0]][held[1]] -= held[2]

    def on_first_token(self, req: RequestInfo, engine: EngineId, now: float) -> None:
        self._prefilled(req)
        self.replicas[self.owner(req)].on_first_token(req, engine, now)

    def on_finished(self, req: RequestInfo, engine: EngineId, now: float, ok: bool) -> None:
        self._prefilled(req)
        r = self._owner.pop((req.id, req.arrival), None)
        if r is None:
            return
        self._flight[r][engine] -= 1
        self.replicas[r].on_finished(req, engine, now, ok)

    def on_cache_event(
        self, engine: EngineId, stored: Sequence[int], removed: Sequence[int]
    ) -> None:
        for p in self.replicas:
            if p.wants_cache_events:
                p.on_cache_event(engine, stored, removed)


def run(
    workload: Workload,
    cluster: ClusterSpec,
    make: Callable[[PolicyContext], Policy],
    replicas: int,
    *,
    kv_events: bool = False,
) -> tuple[float, float]:
    """(SLO attainment, the busiest engine's share of requests) through ``replicas`` routers."""
    ctx = PolicyContext(
        block_size=workload.block_size, perf=cluster.perf, pd=cluster.pd, kv_events=kv_events
    )
    policy = cast(Policy, UnsyncedReplicas([make(ctx) for _ in range(replicas)]))
    result = Simulation(cluster, policy, workload).run()
    shares = Counter(r.engine for r in result.records)
    busiest = max(shares.values()) / len(result.records) if result.records else 0.0
    return slo_attainment(result), busiest


def main() -> None:
    ap = benchmark_parser(__doc__, "benchmarks.replicas.unsynced")
    ap.add_argument("spec")
    ap.add_argument("rates", type=lambda s: [float(x) for x in s.split(",")])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--preset", default=DEFAULT_PRESET)
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--kv-events", action="store_true")
    ap.add_argument("--policies", default="predicted_ttft,least_loaded")
    args = ap.parse_args()
    spec = args.spec.replace("{seed}", str(args.seed))
    wl = load_workload(spec, WorkloadOptions(limit=args.requests, seed=args.seed))
    wl = wl.head(args.requests)
    cluster = ClusterSpec(args.instances, load_preset(args.preset), scrape_interval_s=SCRAPE_S)
    print(
        f"{spec}: {len(wl)} requests, {args.instances} × {args.preset}, load scraped every "
        f"{SCRAPE_S:g} s, KV events {'to every replica' if args.kv_events else 'off'}"
    )
    for text in args.policies.split(","):
        name, options = parse_policy(text)

        def make(
            ctx: PolicyContext, name: str = name, options: dict[str, str] | None = options
        ) -> Policy:
            return create_policy(name, ctx, options)

        for n in sorted({1, args.replicas}):
            cells = []
            for rate in args.rates:
                att, busiest = run(
                    wl.scaled(rate / wl.rate), cluster, make, n, kv_events=args.kv_events
                )
                cells.append(f"{rate:g} req/s {att:.3f} (busiest {busiest:.2f})")
            print(f"{text:32s} {n} replica{'s' if n > 1 else ' '}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
