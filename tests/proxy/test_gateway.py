"""The gateway app against fake engines: proxying, validation, retries, auth, admin."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from fake_engines import FakeCluster, FakeEngine

from gateway.config import load_settings
from gateway.proxy.app import create_app
from tests.promtext import sample_sum

A, B, C = "http://a:1", "http://b:1", "http://c:1"


@asynccontextmanager
async def gateway(*engines: FakeEngine, **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    cluster = FakeCluster(*engines)
    cfg = load_settings(
        engines=[{"url": e.url} for e in engines],
        retries={"max_attempts": 3, "backoff_s": 0.0},
        log_requests=False,
        **settings,
    )
    app = create_app(cfg, transport=cluster.transport())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield client


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi " * 100}]}


async def test_completion_is_forwarded_byte_for_byte() -> None:
    a = FakeEngine(A)
    async with gateway(a) as gw:
        raw = b'{"model":"m","prompt":"hello world","max_tokens":3,"unknown_field":[1,2]}'
        r = await gw.post(
            "/v1/completions",
            content=raw,
            headers={"content-type": "application/json", "x-request-id": "abc-1"},
        )
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == f"hello from {A}"
    assert a.raw == [raw]
    assert a.headers[0]["x-request-id"] == "abc-1"
    assert "authorization" not in a.headers[0]
    assert r.headers["x-request-id"] == "abc-1"
    assert r.headers["x-kvgate-engine"] == A


async def test_stream_passes_sse_through_intact() -> None:
    async with gateway(FakeEngine(A)) as gw:
        r = await gw.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 3
    assert len(events) == 5


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"", 400, "empty"),
        (b"[1,2]", 400, "must be a JSON object"),
        (b'{"model":"m"}', 400, "messages: field required"),
        (b'{"model":"m","messages":[]}', 400, "messages"),
        (b'{"model":"m","messages":[{"role":"user","content":"x"}],"stream":"yes"}', 400, "stream"),
        (b'{"model":"m","messages":[{"role":"user","content":5}]}', 400, "content"),
        (b'{"model":"m","messages":[{"content":"x"}]}', 400, "role"),
        (b'{"model":"nope","messages":[{"role":"user","content":"x"}]}', 404, "nope"),
        (
            b'{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":-1}',
            400,
            "max_tokens",
        ),
        (b"\xff\xfe", 400, "UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
    ],
)
async def test_bad_input_is_a_4xx_and_never_forwarded(
    body: bytes, status: int, message: str
) -> None:
    a = FakeEngine(A)
    async with gateway(a) as gw:
        r = await gw.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"]
    assert err["code"] == status and err["type"]
    assert a.seen == []


async def test_oversized_body_is_413() -> None:
    a = FakeEngine(A)
    async with gateway(a, max_body_bytes=2048) as gw:
        r = await gw.post("/v1/completions", json={"model": "m", "prompt": "x" * 5000})
    assert r.status_code == 413
    assert a.seen == []


@pytest.mark.parametrize("mode", ["status503", "status500", "refuse"])
async def test_failure_before_first_byte_is_retried_elsewhere(mode: str) -> None:
    bad, good = FakeEngine(A), FakeEngine(B)
    async with gateway(bad, good, policy={"name": "round_robin"}) as gw:
        bad.mode = mode  # healthy at start-up, failing afterwards
        results = [
            await gw.post("/v1/completions", json={"model": "m", "prompt": f"p{i}"})
            for i in range(4)
        ]
        metrics = (await gw.get("/metrics")).text
        engines = (await gw.get("/admin/engines")).json()["engines"]
    assert [r.status_code for r in results] == [200] * 4
    assert all(r.headers["x-kvgate-engine"] == B for r in results)
    assert 1 <= len(bad.seen) <= 2 or mode == "refuse"
    assert len(good.seen) == 4
    assert sample_sum(metrics, "kvgate_retries_total", route="completions") >= 1
    assert engines[0]["health"] == "unhealthy" and engines[0]["last_error"]


async def test_client_errors_from_the_engine_are_not_retried() -> None:
    a = FakeEngine(A, mode="status400")
    b = FakeEngine(B, mode="status400")
    async with gateway(a, b) as gw:
        r = await gw.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "fake 400"
    assert len(a.seen) + len(b.seen) == 1


async def test_all_engines_failing_gives_503_with_retry_after() -> None:
    a, b = FakeEngine(A), FakeEngine(B)
    async with gateway(a, b) as gw:
        a.mode = b.mode = "status503"
        r = await gw.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    # three attempts (the configured maximum): both engines, then one of them again
    assert "after 3 attempt" in r.json()["error"]["message"]
    assert sorted((len(a.seen), len(b.seen))) == [1, 2]


async def test_no_engine_up_is_503_and_not_ready() -> None:
    async with gateway(FakeEngine(A, mode="refuse")) as gw:
        ready = await gw.get("/ready")
        r = await gw.post("/v1/completions", json={"model": "m", "prompt": "x"})
        health = await gw.get("/health")
    assert ready.status_code == 503
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "service_unavailable"
    assert health.status_code == 200


async def test_mid_stream_failure_ends_with_error_event_and_done() -> None:
    async with gateway(FakeEngine(A, mode="midstream")) as gw:
        r = await gw.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2][6:])["error"]
    assert "mid-stream" in err["message"]
    assert events[0].startswith("data: {")


async def test_models_union_and_unknown_model() -> None:
    async with gateway(FakeEngine(A, model="m1"), FakeEngine(B, model="m2")) as gw:
        models = (await gw.get("/v1/models")).json()
        missing = await gw.post("/v1/completions", json={"prompt": "x"})
        routed = await gw.post("/v1/completions", json={"model": "m2", "prompt": "x"})
    assert [m["id"] for m in models["data"]] == ["m1", "m2"]
    assert missing.status_code == 400 and "model is required" in missing.json()["error"]["message"]
    assert routed.headers["x-kvgate-engine"] == B


async def test_client_api_keys() -> None:
    async with gateway(FakeEngine(A), api_keys=["k1", "k2"]) as gw:
        none = await gw.post("/v1/completions", json={"model": "m", "prompt": "x"})
        wrong = await gw.post(
            "/v1/completions",
            json={"model": "m", "prompt": "x"},
            headers={"authorization": "Bearer k3"},
        )
        right = await gw.post(
            "/v1/completions",
            json={"model": "m", "prompt": "x"},
            headers={"authorization": "Bearer k2"},
        )
        health = await gw.get("/health")
    assert none.status_code == 401 and wrong.status_code == 401
    assert none.json()["error"]["type"] == "authentication_error"
    assert right.status_code == 200 and health.status_code == 200


async def test_admin_membership_and_admin_key() -> None:
    a, b = FakeEngine(A), FakeEngine(B)
    cluster = FakeCluster(a, b)
    cfg = load_settings(engines=[{"url": A}], admin_key="sekret", log_requests=False)
    app = create_app(cfg, transport=cluster.transport())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as gw:
            denied = await gw.get("/admin/engines")
            auth = {"authorization": "Bearer sekret"}
            added = await gw.post("/admin/engines", json={"url": B}, headers=auth)
            dup = await gw.post("/admin/engines", json={"url": B}, headers=auth)
            bad = await gw.post("/admin/engines", json={"url": "ftp://x"}, headers=auth)
            listed = (await gw.get("/admin/engines", headers=auth)).json()
            removed = await gw.delete("/admin/engines", params={"url": A}, headers=auth)
            after = (await gw.get("/admin/engines", headers=auth)).json()
            routed = await gw.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert denied.status_code == 401
    assert added.status_code == 201 and added.json()["health"] == "healthy"
    assert dup.status_code == 409 and bad.status_code == 400
    assert [e["id"] for e in listed["engines"]] == [A, B]
    assert listed["engines"][0]["metrics"]["waiting"] == 0
    assert removed.status_code == 200
    assert [e["id"] for e in after["engines"]] == [B]
    assert routed.headers["x-kvgate-engine"] == B


async def test_admin_without_key_is_loopback_only() -> None:
    cluster = FakeCluster(FakeEngine(A))
    app = create_app(load_settings(engines=[{"url": A}]), transport=cluster.transport())
    async with app.router.lifespan_context(app):
        for host, status in (("127.0.0.1", 200), ("10.1.2.3", 403)):
            transport = httpx.ASGITransport(app=app, client=(host, 5000))
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as gw:
                assert (await gw.get("/admin/engines")).status_code == status


async def test_shared_prefix_follows_the_engine_that_has_it() -> None:
    engines = [FakeEngine(u) for u in (A, B, C)]
    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    # the older SMG rule sends a miss to the smallest tree: the different prompt then
    # lands elsewhere (today's rule would send it to the least loaded, here any engine)
    policy = {"name": "cache_aware", "options": {"miss": "smallest_tree"}}
    async with gateway(*engines, policy=policy) as gw:
        picks = []
        for i in range(6):
            body = {"model": "m", "messages": [system, {"role": "user", "content": f"q{i}"}]}
            r = await gw.post("/v1/chat/completions", json=body)
            picks.append(r.headers["x-kvgate-engine"])
        other = await gw.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "system", "content": "Different. " * 80}]},
        )
    assert len(set(picks)) == 1
    assert other.headers["x-kvgate-engine"] != picks[0]


async def test_metrics_endpoint_exports_kvgate_series() -> None:
    """The series move with the requests: counts by the number served, routed prompt tokens
    by each request's tokens, expected hits once a prompt repeats."""
    async with gateway(FakeEngine(A)) as gw:
        await gw.post("/v1/completions", json={"model": "m", "prompt": "x" * 300})
        before = (await gw.get("/metrics")).text
        long = {"model": "m", "prompt": "x" * 600}  # twice the first prompt, asked twice
        for _ in range(2):
            assert (await gw.post("/v1/completions", json=long)).status_code == 200
        after = (await gw.get("/metrics")).text

    def moved(name: str, **labels: str) -> float:
        return sample_sum(after, name, **labels) - sample_sum(before, name, **labels)

    one_prompt = sample_sum(before, "kvgate_routed_prompt_tokens_total")
    assert one_prompt > 0
    assert moved("kvgate_routed_prompt_tokens_total") == pytest.approx(4 * one_prompt, rel=0.05)
    assert moved("kvgate_requests_total", outcome="ok", route="completions") == 2
    assert sample_sum(before, "kvgate_requests_total", outcome="ok") == 1
    for name in (
        "kvgate_routing_decision_seconds_count",
        "kvgate_time_to_first_token_seconds_count",
        "kvgate_e2e_request_latency_seconds_count",
        "kvgate_routing_decisions_total",
    ):
        assert moved(name) == 2, name
    assert moved("kvgate_routing_decision_seconds_bucket", le="+Inf") == 2
    assert moved("kvgate_time_to_first_token_seconds_sum") > 0
    assert sample_sum(before, "kvgate_routed_expected_hit_tokens_total") == 0  # cold
    # the long prompt's second time: at least the short prompt's part was expected cached
    assert moved("kvgate_routed_expected_hit_tokens_total") >= 0.5 * one_prompt
    assert sample_sum(after, "kvgate_engine_healthy", engine=A) == 1
    assert sample_sum(after, "kvgate_engine_in_flight", engine=A) == 0  # all finished
    assert "kvgate_engine_waiting_requests" in after


@pytest.mark.parametrize(("configured", "expected"), [(None, 32), (16, 16)])
async def test_block_size_follows_the_engines_unless_configured(
    configured: int | None, expected: int
) -> None:
    engine = FakeEngine(A, block_size=32)
    cluster = FakeCluster(engine)
    cfg = load_settings(engines=[{"url": A}], block_size=configured, log_requests=False)
    app = create_app(cfg, transport=cluster.transport())
    async with app.router.lifespan_context(app):
        assert app.state.gateway.keyer.block_size == expected
        assert app.state.gateway.keyer.chunk_chars == expected * 4


async def test_dualmap_holds_requests_in_router_queues_and_releases_them() -> None:
    import asyncio

    a, b = FakeEngine(A, delay=0.2), FakeEngine(B, delay=0.2)
    policy = {"name": "dualmap", "options": {"dispatch_pending_tokens": 10}}
    async with gateway(a, b, policy=policy) as gw:
        body = {"model": "m", "prompt": "the same long shared prefix " * 20}
        results = await asyncio.gather(*(gw.post("/v1/completions", json=body) for _ in range(4)))
        metrics = (await gw.get("/metrics")).text
        admin = (await gw.get("/admin/engines")).json()
    assert [r.status_code for r in results] == [200] * 4
    held = [ln for ln in metrics.splitlines() if ln.startswith("kvgate_router_held_total")]
    assert held and float(held[0].split()[-1]) >= 2  # more than one waited behind the first
    assert admin["router_queued"] == 0
    # every held request observed its wait (a family with no sample would read 0)
    assert sample_sum(metrics, "kvgate_router_queue_wait_seconds_count") == float(
        held[0].split()[-1]
    )


async def test_full_router_queue_answers_429_with_retry_after() -> None:
    import asyncio

    a = FakeEngine(A, delay=0.3)
    policy = {"name": "dualmap", "options": {"dispatch_pending_tokens": 10}}
    async with gateway(a, policy=policy, max_queued=1) as gw:
        body = {"model": "m", "prompt": "x" * 400}
        results = await asyncio.gather(*(gw.post("/v1/completions", json=body) for _ in range(3)))
    codes = sorted(r.status_code for r in results)
    assert codes == [200, 200, 429]
    refused = next(r for r in results if r.status_code == 429)
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"


LONG = "a long prompt that is worth a remote prefill " * 60


@asynccontextmanager
async def pd_gateway(
    prefill: FakeEngine, decode: FakeEngine, **settings: Any
) -> AsyncIterator[httpx.AsyncClient]:
    cluster = FakeCluster(prefill, decode)
    cfg = load_settings(
        engines=[{"url": prefill.url, "role": "prefill"}, {"url": decode.url, "role": "decode"}],
        retries={"max_attempts": 3, "backoff_s": 0.0},
        log_requests=False,
        **settings,
    )
    app = create_app(cfg, transport=cluster.transport())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield client


@pytest.mark.parametrize("stream", [False, True])
async def test_disaggregated_request_runs_both_legs_like_the_nixl_proxy(stream: bool) -> None:
    p, d = FakeEngine(A), FakeEngine(B)
    body = {
        "model": "m",
        "prompt": LONG,
        "max_tokens": 20,
        "min_tokens": 3,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    async with pd_gateway(p, d) as gw:
        r = await gw.post("/v1/completions", json=body, headers={"x-request-id": "pd-1"})
        metrics = (await gw.get("/metrics")).text
    assert r.status_code == 200
    assert r.headers["x-kvgate-engine"] == B
    assert len(p.seen) == 1 and len(d.seen) == 1
    leg = p.seen[0]
    assert leg["kv_transfer_params"]["do_remote_decode"] is True
    assert leg["kv_transfer_params"]["do_remote_prefill"] is False
    assert leg["max_tokens"] == 1 and leg["stream"] is False
    assert "stream_options" not in leg and "min_tokens" not in leg
    dec = d.seen[0]
    assert dec["kv_transfer_params"]["remote_engine_id"] == A  # the prefill reply's params
    assert dec["max_tokens"] == 20 and dec["min_tokens"] == 3 and dec["stream"] is stream
    assert p.headers[0]["x-request-id"] == d.headers[0]["x-request-id"] == "pd-1"
    assert 'kvgate_pd_requests_total{mode="remote"} 1.0' in metrics


@pytest.mark.parametrize("mode", ["refuse", "status503", "no_params"])
async def test_failed_prefill_leg_falls_back_to_a_local_prefill(mode: str) -> None:
    p, d = FakeEngine(A), FakeEngine(B)
    async with pd_gateway(p, d) as gw:
        p.mode = mode
        r = await gw.post("/v1/completions", json={"model": "m", "prompt": LONG})
        metrics = (await gw.get("/metrics")).text
        admin = (await gw.get("/admin/engines")).json()
    assert r.status_code == 200
    assert len(d.seen) == 1 and "kv_transfer_params" not in d.seen[0]
    assert 'kvgate_pd_requests_total{mode="fallback"} 1.0' in metrics
    assert all(
        e["in_flight"] == 0 and e["pending_prefill_tokens_est"] == 0 for e in admin["engines"]
    )  # nothing left half-done


async def test_prefill_engine_client_error_is_answered_and_decode_never_called() -> None:
    p, d = FakeEngine(A, mode="status400"), FakeEngine(B)
    async with pd_gateway(p, d) as gw:
        r = await gw.post("/v1/completions", json={"model": "m", "prompt": LONG})
        admin = (await gw.get("/admin/engines")).json()
    assert r.status_code == 400
    assert d.seen == []
    assert all(e["in_flight"] == 0 for e in admin["engines"])


async def test_short_uncached_prompts_prefill_on_the_decode_engine() -> None:
    p, d = FakeEngine(A), FakeEngine(B)
    async with pd_gateway(p, d, pd={"min_uncached_tokens": 256}) as gw:
        short = await gw.post("/v1/completions", json={"model": "m", "prompt": "short prompt"})
        long = await gw.post("/v1/completions", json={"model": "m", "prompt": LONG})
    assert short.status_code == long.status_code == 200
    assert len(p.seen) == 1  # only the long prompt went to the prefill engine
    assert len(d.seen) == 2


async def test_slo_class_header_is_validated() -> None:
    async with gateway(FakeEngine(A)) as gw:
        ok = await gw.post(
            "/v1/completions",
            json={"model": "m", "prompt": "x"},
            headers={"x-kvgate-slo-class": "interactive"},
        )
        bad = await gw.post(
            "/v1/completions",
            json={"model": "m", "prompt": "x"},
            headers={"x-kvgate-slo-class": "gold"},
        )
    assert ok.status_code == 200
    assert bad.status_code == 400 and "unknown SLO class 'gold'" in bad.json()["error"]["message"]
