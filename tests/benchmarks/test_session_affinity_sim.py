"""The session affinity simulation: the same requests under every session scheme."""

from __future__ import annotations

from benchmarks.live.workloads import SharedPrefixShape
from benchmarks.quality.session_affinity import MODES, shared_workload, without_sessions


def test_session_schemes_share_one_request_stream() -> None:
    shape = SharedPrefixShape()
    loads = {m: shared_workload(shape, 400, 10.0, 3, m) for m in MODES}
    streams = {m: [(r.arrival, r.block_hashes) for r in w.requests] for m, w in loads.items()}
    assert all(s == streams["none"] for s in streams.values())
    sessions = {m: {r.session for r in w.requests} for m, w in loads.items()}
    assert sessions["none"] == {None} and len(sessions["prompt"]) == shape.prefixes
    assert len(sessions["agents"]) == 4 * shape.prefixes and len(sessions["random"]) == 16
    first = loads["prompt"].requests[0]
    assert first.session == f"p{first.block_hashes[0] // 1000 - 1}"  # its system prompt's
    unique = shared_workload(shape, 50, 10.0, 3, "agents", unique=True)
    assert len({r.block_hashes[0] for r in unique.requests}) == 50
    assert {r.session for r in without_sessions(loads["agents"]).requests} == {None}
