"""Per-client rate limits (gateway/proxy/ratelimit.py): token buckets, 429s, bounded memory."""

from __future__ import annotations

import pytest
from fake_engines import FakeEngine
from inproc_gateway import A, client_of, running_app

from gateway.config import RateLimitConfig, load_settings
from gateway.core.errors import ConfigError
from gateway.proxy.errors import ApiError
from gateway.proxy.ratelimit import RateLimiter, TokenBuckets, build_limiter

BODY = {"model": "m", "prompt": "x"}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_bucket_allows_burst_then_the_rate() -> None:
    clock = Clock()
    buckets = TokenBuckets(2.0, 3, clock=clock)
    assert [buckets.take("c") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("c") == pytest.approx(0.5)  # one token comes back in 1/rate s
    clock.t += 0.5
    assert buckets.take("c") == 0.0
    assert buckets.take("c") == pytest.approx(0.5)
    clock.t += 100  # refills up to the burst, not beyond
    assert [buckets.take("c") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("c") > 0
    assert buckets.take("other") == 0.0  # buckets are per client


def test_refused_requests_take_no_token() -> None:
    clock = Clock()
    buckets = TokenBuckets(1.0, 1, clock=clock)
    assert buckets.take("c") == 0.0
    for _ in range(100):  # hammering while limited does not push the next slot further
        assert buckets.take("c") == pytest.approx(1.0 - (clock.t - 1000.0))
        clock.t += 0.001
    clock.t = 1001.0
    assert buckets.take("c") == 0.0


def test_memory_is_bounded_by_max_buckets() -> None:
    clock = Clock()
    buckets = TokenBuckets(1.0, 1, max_buckets=100, clock=clock)
    for i in range(10_000):
        buckets.take(f"ip:10.0.{i // 256}.{i % 256}")
    assert len(buckets) == 100 and buckets.evicted == 9_900
    # least recently seen first: a client seen again stays
    buckets.take("keep")
    for i in range(99):
        buckets.take(f"new{i}")
    assert buckets.take("keep") > 0  # still tracked, still limited


def test_retry_after_is_whole_seconds_and_error_is_openai_shaped() -> None:
    clock = Clock()
    limiter = RateLimiter(RateLimitConfig(requests_per_s=0.25, burst=1), keyed=False, clock=clock)
    limiter.check("ip:1", "chat")
    with pytest.raises(ApiError) as info:
        limiter.check("ip:1", "chat")
    exc = info.value
    assert exc.status == 429 and exc.error_type == "rate_limit_error"
    assert exc.headers["Retry-After"] == "4"


def test_config() -> None:
    assert build_limiter(RateLimitConfig(), keyed=True) is None  # off by default
    limiter = build_limiter(RateLimitConfig(requests_per_s=2.5), keyed=True)
    assert limiter is not None and limiter.buckets.burst == 3 and limiter.by_key
    ip = build_limiter(RateLimitConfig(requests_per_s=1, per="key"), keyed=False)
    assert ip is not None and not ip.by_key  # no client keys: per IP
    cfg = load_settings(rate_limit={"requests_per_s": 5, "burst": 10, "per": "ip"})
    assert cfg.rate_limit.per == "ip"
    for bad in ({"requests_per_s": 0}, {"requests_per_s": 1, "burst": 0}, {"per": "user"}):
        with pytest.raises(ConfigError, match="rate_limit"):
            load_settings(rate_limit=bad)


async def test_per_key_limits_through_the_gateway() -> None:
    a = FakeEngine(A)
    limits = {"requests_per_s": 0.001, "burst": 2}
    async with (
        running_app(a, api_keys=["k1", "k2"], rate_limit=limits) as app,
        client_of(app) as gw,
    ):
        k1 = {"authorization": "Bearer k1"}
        first = [await gw.post("/v1/completions", json=BODY, headers=k1) for _ in range(2)]
        limited = await gw.post("/v1/chat/completions", json=BODY, headers=k1)
        models = await gw.get("/v1/models", headers=k1)
        other = await gw.post("/v1/completions", json=BODY, headers={"authorization": "Bearer k2"})
        bad_key = await gw.post(
            "/v1/completions", json=BODY, headers={"authorization": "Bearer nope"}
        )
        health = [await gw.get("/health") for _ in range(5)]
        metrics = (await gw.get("/metrics")).text
    assert [r.status_code for r in first] == [200, 200]
    assert limited.status_code == 429 and models.status_code == 429
    err = limited.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == 429
    assert int(limited.headers["retry-after"]) >= 1
    assert other.status_code == 200  # another key, another bucket
    assert bad_key.status_code == 401  # unauthenticated requests spend no one's tokens
    assert all(r.status_code == 200 for r in health)  # only /v1 is limited
    assert 'kvgate_rate_limited_total{route="chat"} 1.0' in metrics
    assert 'kvgate_rate_limited_total{route="models"} 1.0' in metrics
    assert len(a.seen) == 3  # a refused request never reaches an engine


async def test_per_ip_limits_come_before_authentication() -> None:
    a = FakeEngine(A)
    limits = {"requests_per_s": 0.001, "burst": 1, "per": "ip"}
    async with (
        running_app(a, api_keys=["k1"], rate_limit=limits) as app,
        client_of(app, "10.1.1.1") as one,
        client_of(app, "10.1.1.2") as two,
    ):
        auth = {"authorization": "Bearer k1"}
        ok = await one.post("/v1/completions", json=BODY, headers=auth)
        limited = await one.post("/v1/completions", json=BODY, headers=auth)
        guessing = await one.post(
            "/v1/completions", json=BODY, headers={"authorization": "Bearer guess"}
        )
        other_ip = await two.post("/v1/completions", json=BODY, headers=auth)
    assert ok.status_code == 200 and other_ip.status_code == 200
    assert limited.status_code == 429
    assert guessing.status_code == 429  # key guessing is slowed down too
    assert len(a.seen) == 2


async def test_no_keys_configured_limits_per_ip() -> None:
    a = FakeEngine(A)
    async with (
        running_app(a, rate_limit={"requests_per_s": 0.001, "burst": 1}) as app,
        client_of(app, "10.0.0.7") as one,
        client_of(app, "10.0.0.8") as two,
    ):
        codes = [(await one.post("/v1/completions", json=BODY)).status_code for _ in range(2)]
        other = await two.post("/v1/completions", json=BODY)
    assert codes == [200, 429] and other.status_code == 200
