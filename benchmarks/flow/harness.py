"""One overload scenario, run through the gateway (in front of in-process emulated engines)
and through the simulator with the same flow-control settings and the same arrivals.

Arrivals: open loop, ``rate`` requests/s for ``seconds``; each request is ``interactive``
(priority 0) with probability ``interactive``, else ``batch`` (priority 10); its tenant is
drawn with weights ``tenant_weights`` (the last tenant floods). Every prompt is unique
(``prompt_tokens`` tokens, no cache hits) and asks for one output token, so a request's
latency is its TTFT. Tenants are API keys; the gateway hashes them, the simulator is
given the same hashes.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.config import load_settings
from gateway.config_flow import FlowControlConfig
from gateway.core.types import SloClass
from gateway.emulator import EmulatorSettings, create_emulator_app
from gateway.flow import key_tenant
from gateway.perfmodel.presets import load_preset
from gateway.policies.base import PolicyContext
from gateway.policies.registry import create_policy
from gateway.proxy.app import create_app
from gateway.sim.loop import ClusterSpec, Simulation
from gateway.sim.workloads import Workload, WorkloadRequest

MODEL = "kvgate-emulated"
PRESET = "mistral-7b-a6000"
POLICY = "least_loaded"
CLASSES = {
    "interactive": (0, SloClass("interactive", 1.0, 0.05)),
    "batch": (10, SloClass("batch", 60.0, 0.5)),
}
FLOW: dict[str, Any] = {}
"""The flow-control settings the scenario runs with (``flow_control:`` keys): the shipped
defaults (``python -m benchmarks.flow.overload --max-ttft S --protect-ttft S`` changes them)."""


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float
    index: int
    tenant_key: str
    klass: str
    prompt_tokens: int

    @property
    def priority(self) -> int:
        return CLASSES[self.klass][0]

    @property
    def tenant(self) -> str:
        return key_tenant(self.tenant_key)


@dataclass(slots=True)
class Result:
    arrival: Arrival
    status: int = 0
    latency: float | None = None
    retry_after: str | None = None
    answered_at: float | None = None
    """Seconds from the run's start until it was answered (served requests)."""
    error: str = ""


@dataclass(slots=True)
class Scenario:
    seconds: float = 8.0
    rate: float = 26.0
    interactive: float = 0.2
    tenant_weights: tuple[float, ...] = (1.0, 1.0, 10.0)
    prompt_tokens: int = 1000
    engines: int = 2
    seed: int = 7
    flow: dict[str, Any] = field(default_factory=lambda: dict(FLOW))

    def arrivals(self) -> list[Arrival]:
        rng = random.Random(self.seed)
        keys = [f"tenant-{chr(ord('a') + i)}-key" for i in range(len(self.tenant_weights))]
        out: list[Arrival] = []
        t = 0.0
        while True:
            t += rng.expovariate(self.rate)
            if t >= self.seconds:
                return out
            klass = "interactive" if rng.random() < self.interactive else "batch"
            key = rng.choices(keys, self.tenant_weights)[0]
            out.append(Arrival(t, len(out), key, klass, self.prompt_tokens))


def prompt(a: Arrival) -> str:
    """A unique prompt of about ``a.prompt_tokens`` tokens (the emulator: 4 characters each)."""
    head = f"request {a.index:06d} of tenant {a.tenant_key}: "
    filler = "lorem ipsum dolor sit amet " * (a.prompt_tokens * 4 // 27 + 1)
    return (head + filler)[: a.prompt_tokens * 4 - 4]


class _Hosts(httpx.AsyncBaseTransport):
    def __init__(self, apps: dict[str, httpx.ASGITransport]) -> None:
        self.apps = apps

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.apps[f"http://{request.url.netloc.decode()}"].handle_async_request(
            request
        )


@asynccontextmanager
async def gateway(scenario: Scenario, flow: dict[str, Any]) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway (policy least_loaded, ``flow``) before ``scenario.engines`` emulators that
    run the preset in real time; a client on it."""
    urls = [f"http://e{i}:8000" for i in range(scenario.engines)]
    async with AsyncExitStack() as stack:
        apps = {}
        for i, url in enumerate(urls):
            app = create_emulator_app(
                EmulatorSettings(preset=PRESET, time_scale=1.0, engine_index=str(i))
            )
            await stack.enter_async_context(app.router.lifespan_context(app))
            apps[url] = httpx.ASGITransport(app=app)
        cfg = load_settings(
            engines=[{"url": u, "model": MODEL} for u in urls],
            policy={"name": POLICY},
            preset=PRESET,
            log_requests=False,
            health={"interval_s": 0.2},
            slo_classes={
                n: {"ttft_s": c.ttft_s, "tpot_s": c.tpot_s} for n, (_, c) in CLASSES.items()
            },
            default_slo_class="batch",
            flow_control=flow,
        )
        gw = create_app(cfg, transport=_Hosts(apps))
        await stack.enter_async_context(gw.router.lifespan_context(gw))
        transport = httpx.ASGITransport(app=gw, client=("127.0.0.1", 5000))
        yield await stack.enter_async_context(
            httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=120.0)
        )


async def _send(client: httpx.AsyncClient, a: Arrival, t0: float, out: Result) -> None:
    await asyncio.sleep(max(0.0, t0 + a.at - time.perf_counter()))
    body = {"model": MODEL, "prompt": prompt(a), "max_tokens": 1}
    headers = {
        "authorization": f"Bearer {a.tenant_key}",
        "x-kvgate-priority": str(a.priority),
        "x-kvgate-slo-class": a.klass,
    }
    start = time.perf_counter()
    try:
        r = await client.post("/v1/completions", json=body, headers=headers)
    except Exception as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return
    out.status = r.status_code
    out.retry_after = r.headers.get("retry-after")
    if r.status_code == 200:
        out.latency = time.perf_counter() - start
        out.answered_at = time.perf_counter() - t0


async def run_live(
    scenario: Scenario,
    arrivals: Sequence[Arrival],
    flow: dict[str, Any] | None = None,
    *,
    metrics: list[str] | None = None,
) -> list[Result]:
    """Send ``arrivals`` through the gateway; every request's answer (or its error). With
    ``metrics``, the gateway's ``/metrics`` text at the end is appended to it."""
    results = [Result(a) for a in arrivals]
    async with gateway(scenario, scenario.flow if flow is None else flow) as client:
        t0 = time.perf_counter()
        await asyncio.gather(
            *(_send(client, a, t0, r) for a, r in zip(arrivals, results, strict=True))
        )
        if metrics is not None:
            metrics.append((await client.get("/metrics")).text)
    return results


def workload(arrivals: Sequence[Arrival]) -> Workload:
    """The same arrivals as a simulator workload (unique block hashes, one output token)."""
    reqs = []
    for a in arrivals:
        blocks = a.prompt_tokens // 16
        hashes = tuple(hash((a.index, b)) & 0x7FFFFFFFFFFFFFFF for b in range(blocks))
        reqs.append(
            WorkloadRequest(
                id=f"r{a.index}",
                arrival=a.at,
                prompt_tokens=a.prompt_tokens,
                output_tokens=1,
                block_hashes=hashes,
                slo=CLASSES[a.klass][1],
                tenant=a.tenant,
                priority=a.priority,
            )
        )
    return Workload(name="flow-overload", requests=tuple(reqs), block_size=16)


def run_sim(
    scenario: Scenario, arrivals: Sequence[Arrival], flow: dict[str, Any] | None = None
) -> list[Result]:
    """The same arrivals and flow-control settings in the simulator."""
    cfg = FlowControlConfig(**(scenario.flow if flow is None else flow))
    perf = load_preset(PRESET)
    cluster = ClusterSpec(
        instances=scenario.engines,
        perf=perf,
        flow=cfg.flow_settings() if cfg.enabled else None,
        saturation=cfg.saturation_settings(),
    )
    policy = create_policy(POLICY, PolicyContext(seed=0, perf=perf), {})
    run = Simulation(cluster, policy, workload(arrivals)).run()
    out = []
    for a, rec in zip(arrivals, run.records, strict=True):
        res = Result(a)
        if rec.rejected is None and rec.ttft is not None:
            res.status, res.latency = 200, rec.ttft
            res.answered_at = a.at + rec.ttft
        else:
            res.status = 503 if rec.rejected == "timeout" else 429
            res.retry_after = "1"
        out.append(res)
    return out


@dataclass(frozen=True, slots=True)
class Summary:
    interactive_p99: float
    interactive_served: float
    batch_served: float
    jain: float
    lost: int
    refused: int
    refused_without_retry_after: int


def p99(values: Sequence[float]) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")


def fair_shares(capacity: float, demands: Sequence[float]) -> list[float]:
    """Max-min fair split of ``capacity`` over ``demands`` (water filling)."""
    share = [0.0] * len(demands)
    left = capacity
    open_ = sorted(range(len(demands)), key=lambda i: demands[i])
    while open_ and left > 1e-9:
        each = left / len(open_)
        i = open_[0]
        if demands[i] <= each:
            share[i] = demands[i]
            left -= demands[i]
            open_.pop(0)
        else:
            for j in open_:
                share[j] = each
            left = 0.0
    return share


def jain(values: Sequence[float]) -> float:
    if not values or not any(values):
        return float("nan")
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def summarize(results: Sequence[Result], window_s: float) -> Summary:
    """The targets' numbers: interactive latency p99, shares served, Jain's index of the
    tenants' work served during the arrivals (each over its max-min fair share), lost."""
    inter = [r for r in results if r.arrival.klass == "interactive"]
    batch = [r for r in results if r.arrival.klass == "batch"]
    tenants = sorted({r.arrival.tenant_key for r in results})
    demand = [
        float(sum(r.arrival.prompt_tokens for r in results if r.arrival.tenant_key == t))
        for t in tenants
    ]
    served = [
        float(
            sum(
                r.arrival.prompt_tokens
                for r in results
                if r.arrival.tenant_key == t
                and r.answered_at is not None
                and r.answered_at <= window_s
            )
        )
        for t in tenants
    ]
    shares = fair_shares(sum(served), demand)
    ratios = [s / f for s, f in zip(served, shares, strict=True) if f > 0]
    refused = [r for r in results if r.status in (429, 503)]
    return Summary(
        interactive_p99=p99([r.latency for r in inter if r.latency is not None]),
        interactive_served=sum(r.status == 200 for r in inter) / max(1, len(inter)),
        batch_served=sum(r.status == 200 for r in batch) / len(batch) if batch else float("nan"),
        jain=jain(ratios),
        lost=sum(r.status not in (200, 429, 503) for r in results),
        refused=len(refused),
        refused_without_retry_after=sum(not r.retry_after for r in refused),
    )
