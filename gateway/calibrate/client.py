"""A small async client for the parts of an OpenAI-compatible (vLLM) engine calibration uses.

Every failure to reach the engine, and every error it answers, becomes a
one-line :class:`ConfigError` naming the URL.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.calibrate.frontend import LatencySums
from gateway.core.errors import ConfigError


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the engine says about itself (``None`` where it does not say)."""

    model: str
    max_model_len: int | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None


@dataclass(slots=True)
class StreamResult:
    """One streamed completion: when each token chunk arrived (``perf_counter`` seconds)."""

    sent: float
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    """Completion tokens received so far, at each entry of ``times``."""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def ttft(self) -> float:
        return self.times[0] - self.sent


_LATENCY = {
    "vllm:time_to_first_token_seconds_sum": "ttft_sum",
    "vllm:time_to_first_token_seconds_count": "ttft_count",
    "vllm:e2e_request_latency_seconds_sum": "e2e_sum",
    "vllm:e2e_request_latency_seconds_count": "e2e_count",
}


def _one_line(text: str, limit: int = 200) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _error_message(body: str) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return _one_line(body) or "(empty body)"
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        return _one_line(str(err.get("message", err)))
    if isinstance(data, dict) and "detail" in data:
        return _one_line(str(data["detail"]))
    return _one_line(body)


def _int_or_none(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


class EngineClient:
    """HTTP calls to one engine at ``base_url`` (use as an async context manager)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 120.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=5.0),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
            transport=transport,
        )
        self.model = ""
        self.requests = 0

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    def _unreachable(self, exc: httpx.HTTPError) -> ConfigError:
        why = _one_line(str(exc)) or type(exc).__name__
        return ConfigError(f"cannot reach {self.base_url}: {why}")

    def _answered(self, path: str, status: int, body: str) -> ConfigError:
        return ConfigError(f"{self.base_url}{path} answered HTTP {status}: {_error_message(body)}")

    async def _request(self, method: str, path: str, body: Any = None) -> httpx.Response:
        try:
            return await self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None

    async def _json(self, method: str, path: str, body: Any = None) -> Any:
        resp = await self._request(method, path, body)
        if resp.status_code >= 400:
            raise self._answered(path, resp.status_code, resp.text)
        try:
            return resp.json()
        except ValueError:
            raise ConfigError(f"{self.base_url}{path} did not answer JSON") from None

    async def discover(self, model: str | None) -> EngineFacts:
        """The served model (``model`` or the first listed), its context limit, its KV cache."""
        data = await self._json("GET", "/v1/models")
        cards = data.get("data") if isinstance(data, dict) else None
        if not isinstance(cards, list) or not cards:
            raise ConfigError(f"{self.base_url}/v1/models lists no model")
        card = next((c for c in cards if isinstance(c, dict) and c.get("id") == model), None)
        if model is not None and card is None:
            known = ", ".join(str(c.get("id")) for c in cards if isinstance(c, dict))
            raise ConfigError(f"{self.base_url} does not serve model {model!r} (serves: {known})")
        card = card or cards[0]
        self.model = str(card.get("id"))
        facts = EngineFacts(self.model, max_model_len=_int_or_none(card.get("max_model_len")))
        block, blocks = await self._cache_config()
        return EngineFacts(facts.model, facts.max_model_len, block, blocks)

    async def _cache_config(self) -> tuple[int | None, int | None]:
        """``block_size`` and ``num_gpu_blocks`` from vLLM's ``cache_config_info`` metric."""
        try:
            resp = await self._http.get("/metrics")
            if resp.status_code != 200:
                return None, None
            for family in text_string_to_metric_families(resp.text):
                if family.name.endswith("cache_config_info") and family.samples:
                    labels = family.samples[0].labels
                    return _int_or_none(labels.get("block_size")), _int_or_none(
                        labels.get("num_gpu_blocks")
                    )
        except (httpx.HTTPError, ValueError):
            pass
        return None, None

    async def latency_sums(self) -> LatencySums | None:
        """The engine's own TTFT and E2E histogram sums and counts (``None`` without them)."""
        try:
            resp = await self._http.get("/metrics")
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        got: dict[str, float] = {}
        try:
            families = list(text_string_to_metric_families(resp.text))
        except ValueError:
            return None
        for family in families:
            for s in family.samples:
                key = _LATENCY.get(s.name)
                if key is not None:
                    got[key] = got.get(key, 0.0) + s.value
        if len(got) < 4:
            return None
        return LatencySums(got["ttft_sum"], got["ttft_count"], got["e2e_sum"], got["e2e_count"])

    async def count_tokens(self, text: str) -> int | None:
        """Prompt tokens of ``text`` by ``/tokenize``; ``None`` when the engine lacks it."""
        resp = await self._request("POST", "/tokenize", {"model": self.model, "prompt": text})
        if resp.status_code in (404, 405):
            return None
        if resp.status_code >= 400:
            raise self._answered("/tokenize", resp.status_code, resp.text)
        return _int_or_none(resp.json().get("count"))

    async def round_trip(self, tokenize: bool) -> float:
        """Seconds for a request the engine answers without a model step."""
        started = time.perf_counter()
        if tokenize:
            await self._json("POST", "/tokenize", {"model": self.model, "prompt": "hi"})
        else:
            await self._json("GET", "/v1/models")
        return time.perf_counter() - started

    async def complete(self, prompt: str, max_tokens: int) -> StreamResult:
        """Stream a completion of exactly ``max_tokens`` tokens; note when each chunk arrives."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        path = "/v1/completions"
        self.requests += 1
        result = StreamResult(sent=time.perf_counter())
        try:
            async with self._http.stream("POST", path, json=body) as resp:
                if resp.status_code >= 400:
                    text = (await resp.aread()).decode("utf-8", "replace")
                    raise self._answered(path, resp.status_code, text)
                async for line in resp.aiter_lines():
                    self._on_line(line, result, time.perf_counter())
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None
        if not result.times:
            raise ConfigError(f"{self.base_url}{path} streamed no tokens")
        return result

    def _on_line(self, line: str, result: StreamResult, now: float) -> None:
        if not line.startswith("data:"):
            return
        payload = line[5:].strip()
        if not payload or payload == "[DONE]":
            return
        try:
            event = json.loads(payload)
        except ValueError:
            raise ConfigError(f"{self.base_url} streamed invalid JSON") from None
        if "error" in event:
            raise ConfigError(f"{self.base_url} streamed an error: {_error_message(payload)}")
        usage = event.get("usage") or {}
        if usage:
            result.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = _int_or_none(details.get("cached_tokens"))
        if not event.get("choices"):
            return
        before = result.tokens[-1] if result.tokens else 0
        done = _int_or_none(usage.get("completion_tokens"))
        text = event["choices"][0].get("text") or ""
        if done is None:
            done = before + 1 if text else before
        if done > before:
            result.times.append(now)
            result.tokens.append(done)
