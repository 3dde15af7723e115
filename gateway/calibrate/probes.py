"""The calibration probe set and the async runner that measures it against an engine.

One *round* sends every probe once; rounds repeat ``repeats`` times (or until
the time budget runs out) and each probe's samples are reduced to their median.

* **cold** — a prompt of fresh random text (nothing cached), ``max_tokens=1``:
  its time to first token is one prefill chunk ``a + b*extend``.
* **cached** — a prefix ``P`` is sent once, then ``P + extension`` with a fresh
  extension every round: ``ctx = |P|`` cached tokens (as the engine reports
  them), ``extend = |extension|``, which separates ``c`` and ``d``.
* **decode** — ``k`` concurrent streams of the same prompt size, ``ignore_eos``:
  in the window where every stream is decoding and none has finished, each
  stream's elapsed time over tokens received is one decode step of batch ``k``
  (median over streams). A slope over the window, not the gap between chunks:
  a busy API server flushes several steps' tokens at once, and the gaps inside
  such a burst are microseconds.

The round trip of a request without a model step (``/tokenize``, else
``/v1/models``) is the HTTP floor, subtracted from every client-side time to
first token. Around each probe the engine's own latency histograms are read
too (:mod:`gateway.calibrate.frontend`): prefill times as the engine measured
them, and the frontend samples (client minus engine time); after the rounds,
idle-gap probes measure the idle wake.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import string
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from gateway.calibrate.client import EngineClient, EngineFacts, StreamResult
from gateway.calibrate.fit import DecodeSample, PrefillSample
from gateway.calibrate.frontend import WAKE_GAPS_S, FrontendSample, LatencySums, WakeSample
from gateway.core.errors import ConfigError

Say = Callable[[str], None]
Kind = Literal["cold", "cached", "decode"]


@dataclass(frozen=True, slots=True)
class Probe:
    """One measurement point: ``tokens`` is the prompt (cold, decode) or extension size."""

    kind: Kind
    tokens: int
    prefix: int = 0
    streams: int = 1

    def label(self) -> str:
        if self.kind == "cold":
            return f"prefill cold   extend={self.tokens}"
        if self.kind == "cached":
            return f"prefill cached extend={self.tokens} on ctx={self.prefix}"
        return f"decode  batch={self.streams} prompt={self.tokens}"


@dataclass(frozen=True, slots=True)
class ProbePlan:
    """Sizes (in tokens) of the probes of one round, and how many rounds."""

    max_batched_tokens: int
    cold: tuple[int, ...]
    prefixes: tuple[int, ...]
    extends: tuple[int, ...]
    decode_prompts: tuple[tuple[int, tuple[int, ...]], ...]
    """(prompt tokens per stream, concurrency levels) pairs."""
    decode_tokens: int = 16
    room: int | None = None
    """Longest prompt probed (max_model_len less room for the answer); None: no limit."""
    repeats: int = 3
    floor_samples: int = 10
    warmup: int = 3

    @classmethod
    def default(cls, max_batched_tokens: int, max_model_len: int, repeats: int) -> ProbePlan:
        """Prompts up to ~``max_batched_tokens`` (one chunk), contexts up to twice that."""
        m = max_batched_tokens
        room = max_model_len - 64

        def fit(sizes: list[int]) -> tuple[int, ...]:
            return tuple(sorted({s for s in sizes if 8 <= s <= room}))

        extends = fit([m // 16, m // 4, int(0.9 * m)])
        # cached contexts that leave room for at least the smallest extension (a short
        # max_model_len, 2048 say, still gets two, so c and d are measured, not assumed)
        shortest = min(extends, default=0)
        prefixes = [p for p in (m // 2, 2 * m) if p + shortest <= room]
        if len(prefixes) < 2:
            prefixes += [p for p in (room // 4, room // 2) if p + shortest <= room]
        prefixes = list(fit(prefixes))
        long_prompt = min(m, room // 2)
        return cls(
            max_batched_tokens=m,
            cold=fit([8, m // 64, m // 16, m // 4, m // 2, int(0.9 * m)]),
            prefixes=tuple(prefixes),
            room=room,
            extends=extends,
            decode_prompts=((32, (1, 2, 4, 8, 16)), (long_prompt, (1, 4))),
            repeats=repeats,
        )

    def round(self) -> list[Probe]:
        """The probes of one round, in the order they run."""
        out = [Probe("cold", n) for n in self.cold]
        out += [
            Probe("cached", e, prefix=p)
            for p in self.prefixes
            for e in self.extends
            if self.room is None or p + e <= self.room
        ]
        for prompt, levels in self.decode_prompts:
            out += [Probe("decode", prompt, streams=k) for k in levels]
        return out


class TextSource:
    """Fresh random lowercase words: nothing sent twice, so nothing is cached by accident."""

    def __init__(self, rng: random.Random, chars_per_token: float = 4.0) -> None:
        self.rng = rng
        self.chars_per_token = chars_per_token

    def chars(self, tokens: int) -> int:
        return max(4, round(tokens * self.chars_per_token))

    def words(self, n_chars: int) -> str:
        """Exactly ``n_chars`` characters of words, starting and ending with a letter."""
        letters = self.rng.choices(string.ascii_lowercase, k=n_chars)
        pos = 0
        while True:
            pos += self.rng.randint(3, 9)
            if pos >= n_chars - 1:
                return "".join(letters)
            letters[pos] = " "

    def prefix(self, tokens: int) -> str:
        """A prefix whose length is a multiple of 4 characters (token-aligned for 4-char
        tokenizers; ends on a word, so BPE tokenizers keep its tokens too)."""
        return self.words(4 * math.ceil(self.chars(tokens) / 4))

    def extension(self, tokens: int) -> str:
        return " " + self.words(self.chars(tokens) - 1)


@dataclass(slots=True)
class Measurements:
    """Medians per probe, and what the run was like."""

    facts: EngineFacts
    prefill: list[PrefillSample] = field(default_factory=list)
    """Client TTFT minus the HTTP floor."""
    prefill_engine: list[PrefillSample] = field(default_factory=list)
    """The engine's own TTFT (where it exports ``time_to_first_token_seconds``)."""
    decode: list[DecodeSample] = field(default_factory=list)
    frontend: list[FrontendSample] = field(default_factory=list)
    wake: list[WakeSample] = field(default_factory=list)
    http_floor_ms: float = 0.0
    chars_per_token: float = 4.0
    tokenize: bool = False
    requests: int = 0
    rounds: int = 0
    elapsed_s: float = 0.0
    stopped_early: bool = False


def _median_samples(groups: dict[Probe, list[PrefillSample]]) -> list[PrefillSample]:
    med = statistics.median
    return [
        PrefillSample(med(s.extend for s in g), med(s.ctx for s in g), med(s.ms for s in g))
        for g in groups.values()
    ]


class Runner:
    """Runs a :class:`ProbePlan` with a client until done or ``budget_s`` is spent."""

    def __init__(
        self,
        client: EngineClient,
        plan: ProbePlan,
        facts: EngineFacts,
        *,
        block_size: int,
        budget_s: float,
        say: Say,
        rng: random.Random | None = None,
    ) -> None:
        self.client = client
        self.plan = plan
        self.block_size = block_size
        self.say = say
        self.text = TextSource(rng or random.Random())
        self.out = Measurements(facts)
        self._start = time.perf_counter()
        self._deadline = self._start + budget_s
        self._prefill: dict[Probe, list[PrefillSample]] = {}
        self._prefill_engine: dict[Probe, list[PrefillSample]] = {}
        self._decode: dict[Probe, list[DecodeSample]] = {}
        self._prefixes: dict[int, tuple[str, int]] = {}

    def _elapsed(self) -> float:
        return time.perf_counter() - self._start

    async def run(self) -> Measurements:
        """Warm up, measure the floor and the tokenizer, then run rounds of probes."""
        out = self.out
        for _ in range(self.plan.warmup):
            await self.client.complete("warm up " + self.text.words(64), 2)
        await self._measure_tokenizer()
        trips = [await self.client.round_trip(out.tokenize) for _ in range(self.plan.floor_samples)]
        out.http_floor_ms = 1000.0 * statistics.median(trips)
        route = "/tokenize" if out.tokenize else "/v1/models"
        self.say(f"HTTP floor {out.http_floor_ms:.2f} ms ({route} round trip)")
        probes = self.plan.round()
        last_round = 0.0
        for r in range(self.plan.repeats):
            began = time.perf_counter()
            if r and began + last_round > self._deadline:
                out.stopped_early = True
                break
            for i, probe in enumerate(probes, 1):
                if time.perf_counter() > self._deadline:
                    out.stopped_early = True
                    break
                shown = await self._run_probe(probe)
                self.say(
                    f"[{self._elapsed():6.1f} s] round {r + 1}/{self.plan.repeats} "
                    f"probe {i:2d}/{len(probes)} {probe.label()}: {shown}"
                )
            if out.stopped_early:
                break
            out.rounds += 1
            last_round = time.perf_counter() - began
        await self._wake_points()
        out.prefill = _median_samples(self._prefill)
        out.prefill_engine = _median_samples(self._prefill_engine)
        med = statistics.median
        for g in self._decode.values():
            out.decode.append(
                DecodeSample(g[0].batch, med(s.ctx_total for s in g), med(s.ms for s in g))
            )
        out.requests = self.client.requests
        out.elapsed_s = self._elapsed()
        return out

    async def _measure_tokenizer(self) -> None:
        """Characters per token of :class:`TextSource` text, by ``/tokenize`` when it exists."""
        sample = self.text.words(8000)
        full = await self.client.count_tokens(sample)
        half = await self.client.count_tokens(sample[:4000]) if full is not None else None
        if full is None or half is None or full <= half:
            self.say("no /tokenize: assuming 4 characters per token")
            return
        self.out.tokenize = True
        self.out.chars_per_token = self.text.chars_per_token = 4000 / (full - half)
        self.say(f"tokenizer: {self.out.chars_per_token:.2f} characters per token")

    async def _prompt_tokens(self, res: StreamResult, prompt: str) -> int:
        if res.prompt_tokens is not None:
            return res.prompt_tokens
        counted = await self.client.count_tokens(prompt) if self.out.tokenize else None
        return counted if counted is not None else round(len(prompt) / self.text.chars_per_token)

    async def _wake_points(self) -> None:
        """TTFT of a small probe after each idle gap, ``repeats`` times as the budget allows."""
        need = sum(WAKE_GAPS_S) + 0.5 * len(WAKE_GAPS_S)
        for r in range(self.plan.repeats):
            if time.perf_counter() + need > self._deadline:
                self.out.stopped_early = True
                self.say(f"idle-wake probes: {r} round(s), the time budget is spent")
                return
            for gap in WAKE_GAPS_S:
                await self.client.complete(self.text.words(40), 1)
                await asyncio.sleep(gap)
                res = await self.client.complete(self.text.words(self.text.chars(32)), 1)
                self.out.wake.append(WakeSample(gap, 1000.0 * res.ttft))
            shown = ", ".join(f"{w.gap_s:g} s {w.ms:.1f} ms" for w in self.out.wake[-5:])
            self.say(f"[{self._elapsed():6.1f} s] idle-wake round {r + 1}: TTFT after {shown}")

    def _frontend(self, streams: int, client: tuple[float, float], engine: object) -> str:
        """Note client-minus-engine samples; ``engine`` is the engine's (TTFT, E2E) or None."""
        if not isinstance(engine, tuple):
            return ""
        for i, e2e in ((0, False), (1, True)):
            self.out.frontend.append(FrontendSample(streams, client[i], engine[i], e2e))
        return f"; engine {engine[0]:.1f} / {engine[1]:.1f} ms"

    async def _engine_means(
        self, before: LatencySums | None, requests: int
    ) -> tuple[float, float] | None:
        """The engine's mean (TTFT, E2E) ms of the ``requests`` just answered. Its histograms
        are updated after the answer goes out, so wait (up to 2 s) until they count them:
        an early read would pair this probe with the previous one's times."""
        if before is None:
            return None
        deadline = time.perf_counter() + 2.0
        while True:
            after = await self.client.latency_sums()
            if after is None:
                return None
            done = min(after.ttft_count - before.ttft_count, after.e2e_count - before.e2e_count)
            if done >= requests:
                return after.since(before) if done == requests else None
            if time.perf_counter() > deadline:
                return None
            await asyncio.sleep(0.02)

    async def _prefill_point(self, key: Probe, prompt: str, prefix_tokens: int) -> str:
        before = await self.client.latency_sums()
        res = await self.client.complete(prompt, 1)
        engine = await self._engine_means(before, 1)
        total = await self._prompt_tokens(res, prompt)
        if res.cached_tokens is not None:
            ctx = res.cached_tokens
        else:  # the engine does not report it: whole blocks of the prefix, as vLLM caches
            ctx = min(prefix_tokens, total - 1) // self.block_size * self.block_size
        extend = total - ctx
        ms = 1000.0 * res.ttft - self.out.http_floor_ms
        one_chunk = extend <= self.plan.max_batched_tokens  # one prefill step: usable
        if one_chunk:
            self._prefill.setdefault(key, []).append(PrefillSample(extend, ctx, ms))
            if engine is not None:
                sample = PrefillSample(extend, ctx, engine[0])
                self._prefill_engine.setdefault(key, []).append(sample)
        note = "" if one_chunk else "; several chunks, not fitted"
        client = (1000.0 * res.ttft, 1000.0 * (res.times[-1] - res.sent))
        seen = self._frontend(1, client, engine)
        return f"TTFT {1000.0 * res.ttft:.1f} ms ({extend} new on {ctx} cached{note}){seen}"

    async def _run_probe(self, probe: Probe) -> str:
        text = self.text
        if probe.kind == "cold":
            return await self._prefill_point(probe, text.words(text.chars(probe.tokens)), 0)
        if probe.kind == "cached":
            if probe.prefix not in self._prefixes:
                prefix = text.prefix(probe.prefix)
                res = await self.client.complete(prefix, 1)
                self._prefixes[probe.prefix] = (prefix, await self._prompt_tokens(res, prefix))
            prefix, prefix_tokens = self._prefixes[probe.prefix]
            prompt = prefix + text.extension(probe.tokens)
            return await self._prefill_point(probe, prompt, prefix_tokens)
        return await self._decode_point(probe)

    async def _decode_point(self, probe: Probe) -> str:
        k, n = probe.streams, probe.tokens
        # enough tokens that every stream decodes together for decode_tokens steps
        steps_to_admit = math.ceil(k * n / self.plan.max_batched_tokens)
        max_tokens = self.plan.decode_tokens + steps_to_admit + 1
        prompts = [self.text.words(self.text.chars(n)) for _ in range(k)]
        before = await self.client.latency_sums()
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self.client.complete(p, max_tokens)) for p in prompts]
        except* ConfigError as errors:  # report the first failure, not an exception group
            raise errors.exceptions[0] from None
        results = [t.result() for t in tasks]
        engine = await self._engine_means(before, k)
        client = (
            1000.0 * statistics.mean(r.ttft for r in results),
            1000.0 * statistics.mean(r.times[-1] - r.sent for r in results),
        )
        self._frontend(k, client, engine)
        start = max(r.times[0] for r in results)
        end = min(r.times[-1] for r in results)
        step = decode_step_seconds(results, start, end)
        if step is None:
            return "no steady decode window (skipped)"
        mid = (start + end) / 2
        ctx = 0
        for r, p in zip(results, prompts, strict=True):
            got = max((c for t, c in zip(r.times, r.tokens, strict=True) if t <= mid), default=1)
            ctx += await self._prompt_tokens(r, p) + got - 1
        ms = 1000.0 * step
        self._decode.setdefault(probe, []).append(DecodeSample(k, ctx, ms))
        return f"ITL {ms:.2f} ms ({ctx} context tokens)"


def decode_step_seconds(results: list[StreamResult], start: float, end: float) -> float | None:
    """Median over streams of seconds per token inside ``[start, end]``; ``None`` if empty.

    Each stream contributes (last - first chunk time) / (tokens between them)
    over its chunks in the window, so tokens delivered in bursts still count
    at the rate the engine produced them.
    """
    slopes: list[float] = []
    for r in results:
        inside = [(t, n) for t, n in zip(r.times, r.tokens, strict=True) if start <= t <= end]
        if len(inside) < 2:
            continue
        (t0, n0), (t1, n1) = inside[0], inside[-1]
        if n1 > n0 and t1 > t0:
            slopes.append((t1 - t0) / (n1 - n0))
    return statistics.median(slopes) if slopes else None
