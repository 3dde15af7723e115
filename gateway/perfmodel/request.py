"""The records an :class:`~gateway.perfmodel.engine.EngineCore` keeps and returns: a request
inside an engine with the scheduler's state for it, and what one step (or decode run) produced.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class EngineRequest:
    """A request inside an engine, with the state the scheduler keeps for it."""

    id: str
    prompt_tokens: int
    block_hashes: tuple[int, ...]
    output_tokens: int
    arrival: float
    payload: object = None
    remote_tokens: int = 0
    """Prompt tokens whose KV arrives from a prefill engine (P/D): loaded, not computed."""
    lora: str = ""
    """The LoRA adapter the request runs with, "" for the base model (its block hashes are
    expected partitioned by adapter already: ``gateway.core.blocks.partition_seed``)."""
    # scheduler state
    num_computed: int = 0
    num_output: int = 0
    held: list[int] = field(default_factory=list)
    anon: int = 0
    next_block: int = 0
    est_uncached: int = 0
    prefill_pending: int = 0
    pending_blocks: int = 0
    """Leading prompt blocks this request counts in the engine's pending prefix set."""
    hit_ratio: float = 0.0
    preemptions: int = 0
    aborted: bool = False
    # results
    cached_tokens: int | None = None
    external_tokens: int = 0
    first_scheduled: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    client_delay_first: float = 0.0
    """Seconds the first token took from the engine to the client (the frontend term)."""
    client_delay_last: float = 0.0
    """The same for the last token."""

    @property
    def client_first_token_time(self) -> float | None:
        """When the client saw the first token (engine time plus the frontend delay)."""
        t = self.first_token_time
        return None if t is None else t + self.client_delay_first

    @property
    def client_finish_time(self) -> float | None:
        """When the client saw the last token."""
        t = self.finish_time
        return None if t is None else t + self.client_delay_last

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.num_output

    @property
    def num_blocks(self) -> int:
        return len(self.held) + self.anon

    @property
    def decoding(self) -> bool:
        return self.num_output > 0 and self.num_computed == self.total_tokens - 1

    @property
    def prefill_left(self) -> int:
        left = self.total_tokens - self.num_computed
        return 0 if self.num_output > 0 and left <= 1 else left


@dataclass(slots=True)
class StepOutcome:
    """What one step (or decode run) produced."""

    start: float
    end: float
    steps: int = 1
    tokens: list[tuple[EngineRequest, int]] = field(default_factory=list)
    first_tokens: list[EngineRequest] = field(default_factory=list)
    finished: list[EngineRequest] = field(default_factory=list)
    preempted: list[EngineRequest] = field(default_factory=list)
    aborted: list[EngineRequest] = field(default_factory=list)
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_tokens: int = 0
