"""Per-client rate limits: a token bucket per client API key, or per client IP.

Each client gets a bucket of ``burst`` tokens refilled at ``requests_per_s``;
a request takes one token or is answered 429 ``rate_limit_error`` with
``Retry-After`` (whole seconds until a token is back). Buckets live in an LRU
map of at most ``max_buckets`` entries: the least recently seen client is
dropped first. A bucket untouched for ``burst / requests_per_s`` seconds is
full again anyway, so dropping it forgets nothing unless more than
``max_buckets`` clients are active within that time — memory stays bounded
whatever the number of clients or addresses.

Identity: with ``per: key`` and client keys configured, the key a client
authenticated with (its position in ``api_keys``, so no secret is held here);
otherwise the client's IP as the server saw it (``scope["client"]``, which
uvicorn rewrites from ``X-Forwarded-For`` only for ``--forwarded-allow-ips``
peers). Per-IP limits apply before authentication, so they also slow down
key guessing; per-key limits apply after it.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

from prometheus_client import Counter

from gateway.config import RateLimitConfig
from gateway.proxy.errors import ApiError


class TokenBuckets:
    """Token buckets by client identity, LRU-bounded."""

    def __init__(
        self,
        rate: float,
        burst: int,
        *,
        max_buckets: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate <= 0 or burst < 1 or max_buckets < 1:
            raise ValueError("rate must be > 0, burst and max_buckets >= 1")
        self.rate = rate
        self.burst = float(burst)
        self.max_buckets = max_buckets
        self.clock = clock
        self.evicted = 0
        """Buckets dropped to stay within ``max_buckets``."""
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()  # id -> [tokens, at]

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, client: str) -> float:
        """Take a token for ``client``: 0.0 if it may go now, else seconds until it may."""
        now = self.clock()
        bucket = self._buckets.get(client)
        if bucket is None:
            if len(self._buckets) >= self.max_buckets:
                self._buckets.popitem(last=False)
                self.evicted += 1
            bucket = [self.burst, now]
            self._buckets[client] = bucket
        else:
            self._buckets.move_to_end(client)
            bucket[0] = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
            bucket[1] = now
        if bucket[0] >= 1.0:
            bucket[0] -= 1.0
            return 0.0
        return (1.0 - bucket[0]) / self.rate


class RateLimiter:
    """``rate_limit`` of the settings, applied to one request at a time."""

    def __init__(
        self,
        config: RateLimitConfig,
        *,
        keyed: bool,
        counter: Counter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        rate = config.requests_per_s
        if rate is None:
            raise ValueError("rate_limit.requests_per_s is not set")
        burst = config.burst if config.burst is not None else max(1, math.ceil(rate))
        self.by_key = config.per == "key" and keyed
        """True: identity is the client key (checked after auth); False: the client IP."""
        self.buckets = TokenBuckets(rate, burst, max_buckets=config.max_buckets, clock=clock)
        self.counter = counter

    def check(self, client: str, route: str) -> None:
        """Take a token for ``client`` or raise the 429."""
        wait = self.buckets.take(client)
        if wait <= 0.0:
            return
        if self.counter is not None:
            self.counter.labels(route).inc()
        raise ApiError(
            429,
            "rate limit exceeded for this client; retry after the time in Retry-After",
            headers={"Retry-After": str(max(1, math.ceil(wait)))},
            error_type="rate_limit_error",
        )


def build_limiter(
    config: RateLimitConfig, *, keyed: bool, counter: Counter | None = None
) -> RateLimiter | None:
    """The limiter of ``config``, or None when rate limiting is off."""
    if config.requests_per_s is None:
        return None
    return RateLimiter(config, keyed=keyed, counter=counter)


def client_ip(client: tuple[str, int] | list[object] | None) -> str:
    """The identity of an ASGI ``scope["client"]`` (None when the server gave none)."""
    if not client:
        return "ip:unknown"
    return f"ip:{client[0]}"
