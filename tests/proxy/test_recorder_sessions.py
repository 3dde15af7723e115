"""Sessions survive recording and replay: salted like block ids, read back as sessions,
and the replay's requests carry them to the simulator's session affinity."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.core.types import RequestInfo
from gateway.perfmodel.presets import DEFAULT_PRESET, load_preset
from gateway.policies.base import PolicyContext
from gateway.policies.registry import create_policy
from gateway.policies.session_affinity import StickySettings
from gateway.proxy.exchange import Exchange
from gateway.proxy.recorder import Recorder, make_entry
from gateway.proxy.routing_key import RoutingKeyer
from gateway.sim.loop import ClusterSpec, Simulation
from gateway.sim.workloads import WorkloadOptions, load_workload

KEYER = RoutingKeyer(16)
TURNS = [("alice@example.com", 0.0), ("bob-7", 0.5), ("", 1.0), ("alice@example.com", 1.5)]


def exchange(i: int, session: str, started: float) -> Exchange:
    hashes, tokens = KEYER.key(f"history of {session or i} " * 40 + f"turn {i}")  # turns extend
    info = RequestInfo(f"r{i}", hashes, tokens, 0.0, model="m", session=session)
    return Exchange(
        route="completions",
        path="/v1/completions",
        raw=b"",
        info=info,
        model="m",
        stream=False,
        request_id=f"r{i}",
        started=started,
        engine="http://a:1",
    )


def record(path: Path, salt: str) -> list[dict[str, object]]:
    rec = Recorder(path, salt=salt, clock=lambda: 0.0)
    rec.start()
    for i, (session, t) in enumerate(TURNS):
        rec.put(make_entry(exchange(i, session, t), ok=True, outcome="ok", output=4))
    rec.close()
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_sessions_are_recorded_salted(tmp_path: Path) -> None:
    rows = record(tmp_path / "a.jsonl", "s1")
    ids = [r.get("session") for r in rows]
    assert ids[0] == ids[3] and ids[0] != ids[1] and ids[2] is None
    assert all(isinstance(x, str) and len(x) == 16 for x in (ids[0], ids[1]))
    assert "alice" not in (tmp_path / "a.jsonl").read_text()
    again = record(tmp_path / "b.jsonl", "s1")
    other = record(tmp_path / "c.jsonl", "s2")
    assert [r.get("session") for r in again] == ids  # same salt: same ids across recordings
    assert other[0]["session"] != ids[0]


def test_a_replay_keeps_the_recorded_sessions(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    rows = record(path, "s1")
    wl = load_workload(f"recorded:{path}", WorkloadOptions(block_size=16))
    assert [r.session for r in wl.requests] == [r.get("session") for r in rows]
    cluster = ClusterSpec(4, load_preset(DEFAULT_PRESET), sessions=StickySettings())
    run = Simulation(cluster, create_policy("round_robin", PolicyContext()), wl).run()
    assert [r.info.session for r in run.records] == [r.get("session") or "" for r in rows]
    engines = [r.engine for r in run.records]
    assert engines[3] == engines[0]  # alice's second turn: her engine, not round robin's next
    plain = ClusterSpec(4, load_preset(DEFAULT_PRESET))
    run = Simulation(plain, create_policy("round_robin", PolicyContext()), wl).run()
    assert run.records[3].engine != run.records[0].engine
