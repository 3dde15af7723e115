"""Flow control's tenant and priority survive recording and replay: the tenant salted, the
priority as sent, both read back by ``recorded:`` into the simulator's flow control."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.core.types import RequestInfo
from gateway.flow import FlowSettings, key_tenant
from gateway.perfmodel.presets import DEFAULT_PRESET, load_preset
from gateway.policies.base import PolicyContext
from gateway.policies.registry import create_policy
from gateway.proxy.exchange import Exchange
from gateway.proxy.recorder import Recorder, make_entry
from gateway.proxy.routing_key import RoutingKeyer
from gateway.sim.loop import ClusterSpec, Simulation
from gateway.sim.workloads import WorkloadOptions, load_workload

KEYER = RoutingKeyer(16)
SENT = [(key_tenant("sk-alice"), 0), (key_tenant("sk-bob"), 10), ("anonymous", 0)]


def exchange(i: int, tenant: str, priority: int) -> Exchange:
    hashes, tokens = KEYER.key(f"prompt {i} " * 40)
    info = RequestInfo(f"r{i}", hashes, tokens, 0.0, model="m", tenant=tenant, priority=priority)
    return Exchange(
        route="completions",
        path="/v1/completions",
        raw=b"",
        info=info,
        model="m",
        stream=False,
        request_id=f"r{i}",
        started=0.1 * i,
        engine="http://a:1",
    )


def test_tenant_and_priority_are_recorded_and_replayed(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    rec = Recorder(path, salt="s1", clock=lambda: 0.0)
    rec.start()
    for i, (tenant, priority) in enumerate(SENT):
        rec.put(make_entry(exchange(i, tenant, priority), ok=True, outcome="ok", output=4))
    rec.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r.get("priority", 0) for r in rows] == [0, 10, 0]
    tenants = [r["tenant"] for r in rows]
    assert len(set(tenants)) == 3 and not any(t in path.read_text() for t, _ in SENT)
    wl = load_workload(f"recorded:{path}", WorkloadOptions(block_size=16))
    assert [(r.tenant, r.priority) for r in wl.requests] == list(
        zip(tenants, [0, 10, 0], strict=True)
    )
    cluster = ClusterSpec(2, load_preset(DEFAULT_PRESET), flow=FlowSettings())
    run = Simulation(cluster, create_policy("round_robin", PolicyContext()), wl).run()
    assert [(r.info.tenant, r.info.priority) for r in run.records] == [
        (r.tenant, r.priority) for r in wl.requests
    ]
