"""Decision logs keep the request's session: through the JSON codec, and in replay."""

from __future__ import annotations

import json

from gateway.core.types import ClusterView, EngineView, RequestInfo
from gateway.policies import Dispatcher
from gateway.policies.base import PolicyContext
from gateway.policies.recording import PolicySpec, RecordingPolicy, replay
from gateway.policies.recording_codec import decode_call, encode, encode_call
from gateway.policies.registry import create_policy
from gateway.policies.session_affinity import SessionAffinity

VIEW = ClusterView(tuple(EngineView(e) for e in ("a", "b", "c")))


def test_a_decision_log_with_sessions_replays_exactly() -> None:
    ctx = PolicyContext()
    spec = PolicySpec.of("round_robin", ctx, None)
    recording = RecordingPolicy(create_policy("round_robin", ctx), spec)
    d = Dispatcher(recording, sessions=SessionAffinity())
    sessions = ["s1", "", "s2", "s1", "s2", "s1"]
    engines = [
        d.route(RequestInfo(f"r{i}", (len(s), i), 32, float(i), session=s), VIEW, float(i)).engine
        for i, s in enumerate(sessions)
    ]
    assert engines[3] == engines[5] == engines[0] and engines[4] == engines[2]
    calls = [decode_call(json.loads(json.dumps(encode_call(c)))) for c in recording.calls]
    decided = [c.args[0].session for c in calls if c.method == "decide"]
    assert decided == sessions
    assert replay(calls, spec.build()) == []


def test_a_log_written_before_sessions_decodes_without_one() -> None:
    data = encode(RequestInfo("r", (1,), 16, 0.0, session="s"))
    del data["f"]["session"]
    call = decode_call({"m": "on_routed", "a": {"T": [data]}, "r": None})
    assert call.args[0].session == ""
