"""Request schedules of the live routing benchmark, and the no-reuse capacity they are paced at.

Prompts are plain text for ``/v1/completions``. The emulator's tokenizer
(:class:`gateway.emulator.tokenizer.FakeTokenizer`) makes one token of every 4 characters plus a
BOS token, so a text of ``4 * n`` characters is exactly ``n + 1`` prompt tokens and two prompts
share a cached prefix exactly as far as they share characters (in whole 16-token blocks).

* ``shared`` (workload A): ``prefixes`` system prompts of ``system_tokens`` tokens, popularity
  Zipf(``zipf``), each followed by a unique question of ``question_tokens`` tokens.
* ``unique`` (workload B): the same sizes, every prompt unique from its first character.
* ``trace`` (workload C): any simulator workload spec (``gen:chat``, ``mooncake:PATH``, ...); the
  chained 16-token block hashes of each request become text, one 64-character piece per hash, so
  equal prefixes in the trace are equal strings here; the rest of a prompt (less than a block) is
  unique text.

Arrival times are in *model* seconds (the engines' time); the driver multiplies them by the
emulators' ``--time-scale``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.bench.loadgen import ReplayRequest
from gateway.perfmodel.engine import EngineCore, EngineRequest
from gateway.perfmodel.model import PerfModel
from gateway.sim.gen_common import zipf_cum_weights
from gateway.sim.workloads import WorkloadOptions, load_workload

CHARS_PER_TOKEN = 4
"""The emulator tokenizer's chunk size: one token per 4 characters (plus BOS)."""
_WORDS = ("cache", "prefix", "block", "engine", "route", "token", "batch", "queue", "decode")


def text_of(rng: random.Random, tokens: int, head: str = "") -> str:
    """Words (from ``rng``) after ``head``, cut to exactly ``tokens`` emulator tokens of text."""
    chars = tokens * CHARS_PER_TOKEN
    parts, size = [head], len(head)
    while size < chars:
        word = " " + rng.choice(_WORDS)
        parts.append(word)
        size += len(word)
    return "".join(parts)[:chars]


@dataclass(frozen=True, slots=True)
class SharedPrefixShape:
    """Workload A's (and B's) request shape."""

    prefixes: int = 8
    system_tokens: int = 1500
    question_tokens: int = 100
    output_tokens: int = 32
    zipf: float = 1.0

    @property
    def prompt_tokens(self) -> int:
        """Tokens the engine sees per prompt (text tokens plus BOS)."""
        return self.system_tokens + self.question_tokens + 1


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """``n`` Poisson arrival times (seconds from 0) at ``rate`` per second."""
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def shared_prefix_requests(
    shape: SharedPrefixShape, n: int, rate: float, seed: int
) -> list[ReplayRequest]:
    """Workload A: a Zipf-popular system prompt, then a unique question; Poisson arrivals."""
    rng = random.Random(f"{seed}:shared")
    systems = [
        text_of(random.Random(f"{seed}:system:{k}"), shape.system_tokens, f"System prompt {k}.")
        for k in range(shape.prefixes)
    ]
    weights = zipf_cum_weights(shape.prefixes, shape.zipf)
    out = []
    for i, t in enumerate(poisson_arrivals(n, rate, rng)):
        system = rng.choices(systems, cum_weights=weights)[0]
        question = text_of(rng, shape.question_tokens, f" Question {i}:")
        out.append(ReplayRequest(t, system + question, shape.output_tokens))
    return out


def unique_requests(
    shape: SharedPrefixShape, n: int, rate: float, seed: int
) -> list[ReplayRequest]:
    """Workload B: prompts of workload A's size, unique from the first character."""
    rng = random.Random(f"{seed}:unique")
    tokens = shape.system_tokens + shape.question_tokens
    return [
        ReplayRequest(t, text_of(rng, tokens, f"Unique {seed}-{i}."), shape.output_tokens)
        for i, t in enumerate(poisson_arrivals(n, rate, rng))
    ]


class BlockText:
    """Text for chained block hashes: one fixed 64-character piece per hash (memoised)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._pieces: dict[int, str] = {}  # bounded by the blocks of one replayed trace

    def piece(self, block_hash: int) -> str:
        text = self._pieces.get(block_hash)
        if text is None:
            text = text_of(random.Random(block_hash), self.block_size, f"{block_hash:x}")
            self._pieces[block_hash] = text
        return text

    def prompt(self, block_hashes: Sequence[int], tokens: int, tail: str) -> str:
        """``tokens`` tokens of text: the blocks' pieces, then unique text from ``tail``.

        The engine adds BOS, so ``tokens`` is one less than the trace's prompt; a prompt that
        ends on a block boundary loses its last character chunk, which keeps every engine block
        shared exactly as far as the trace's blocks are (BOS + 16 k - 1 tokens still fill k
        blocks of 16).
        """
        head = "".join(self.piece(h) for h in block_hashes)[: tokens * CHARS_PER_TOKEN]
        rest = tokens - len(head) // CHARS_PER_TOKEN
        return head + text_of(random.Random(tail), rest, tail) if rest > 0 else head


@dataclass(frozen=True, slots=True)
class TraceRequests:
    """A replayed trace: its requests (trace time) and their (prompt, output) token counts."""

    spec: str
    requests: list[ReplayRequest]
    sizes: list[tuple[int, int]]

    @property
    def duration(self) -> float:
        return self.requests[-1].arrival - self.requests[0].arrival if self.requests else 0.0


def trace_requests(
    spec: str, limit: int, seed: int, *, max_output: int | None = None
) -> TraceRequests:
    """The first ``limit`` requests of a simulator workload, as text (arrivals start at 0)."""
    workload = load_workload(spec, WorkloadOptions(block_size=16, seed=seed, limit=limit))
    text = BlockText(workload.block_size)
    start = workload.requests[0].arrival if workload.requests else 0.0
    out, sizes = [], []
    for r in workload.requests:
        tokens = max(1, r.prompt_tokens - 1)  # the emulator adds BOS
        output = min(r.output_tokens, max_output) if max_output else r.output_tokens
        prompt = text.prompt(r.block_hashes, tokens, f" [{seed}:{r.id}]")
        out.append(ReplayRequest(r.arrival - start, prompt, max(1, output)))
        sizes.append((tokens + 1, max(1, output)))
    return TraceRequests(spec, out, sizes)


def rescaled(requests: Sequence[ReplayRequest], factor: float) -> list[ReplayRequest]:
    """The same requests with every arrival time multiplied by ``factor``."""
    return [ReplayRequest(r.arrival * factor, r.prompt, r.output_tokens) for r in requests]


def no_reuse_capacity(perf: PerfModel, sizes: Sequence[tuple[int, int]]) -> float:
    """Requests per second one engine of ``perf`` completes when nothing is ever cached.

    The engine model (the one the emulators run) is given every request at time 0, without
    block hashes, and stepped to the end: capacity = requests / makespan. It counts prefill,
    decode steps, batching, and the KV limit on how many requests run at once.
    """
    engine = EngineCore("capacity", perf, max_decode_run=1)
    for i, (prompt, output) in enumerate(sizes):
        engine.submit(EngineRequest(str(i), prompt, (), output, 0.0))
    now = 0.0
    while engine.has_work:
        end = engine.start_step(now)
        if end is None:
            raise RuntimeError("the engine model stalled with work left")
        engine.finish_step()
        now = end
    return len(sizes) / now
