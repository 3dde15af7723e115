"""Which leading blocks of a prompt recent traffic shares: a sliding-window prefix count.

Each request routed is counted on every leading block of its prompt (its chained block
hashes, at most ``max_depth`` of them) over the last ``window`` requests. A prompt's
*shared depth* at a threshold is how many of its leading blocks at least that share of the
window's requests began with: a system prompt in front of every request is shared to its
last block, a conversation's own history is not. predicted_ttft's share penalty uses it to
tell a prefix that could pull all traffic onto one engine from a hit only one conversation
wants.

Memory: at most ``window`` prompts of at most ``max_depth`` hashes, and one count per
distinct hash among them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class PrefixTraffic:
    """Counts of the leading blocks of the last ``window`` requests' prompts."""

    def __init__(self, window: int, *, max_depth: int = 256) -> None:
        if window <= 0 or max_depth <= 0:
            raise ValueError("window and max_depth must be positive")
        self.window = window
        self.max_depth = max_depth
        self._prompts: deque[tuple[int, ...]] = deque()
        self._counts: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._prompts)

    def resize(self, window: int) -> None:
        """Keep the last ``window`` requests (the pool grew or shrank)."""
        if window <= 0:
            raise ValueError("window must be positive")
        self.window = window
        while len(self._prompts) > window:
            self._forget()

    def observe(self, hashes: Sequence[int]) -> None:
        """Count one routed request's prompt."""
        prompt = tuple(hashes[: self.max_depth])
        self._prompts.append(prompt)
        for h in prompt:
            self._counts[h] = self._counts.get(h, 0) + 1
        while len(self._prompts) > self.window:
            self._forget()

    def count(self, block_hash: int) -> int:
        """Requests of the window whose prompt holds ``block_hash`` among its leading blocks."""
        return self._counts.get(block_hash, 0)

    def shared_depth(self, hashes: Sequence[int], share: float) -> int:
        """Leading blocks of ``hashes`` each begun by at least ``share`` of the window's
        requests (0 on an empty window: nothing is known to be shared)."""
        if not self._prompts:
            return 0
        need = share * len(self._prompts)
        depth = 0
        for h in hashes[: self.max_depth]:
            if self._counts.get(h, 0) < need:
                break
            depth += 1
        return depth

    def _forget(self) -> None:
        for h in self._prompts.popleft():
            left = self._counts[h] - 1
            if left:
                self._counts[h] = left
            else:
                del self._counts[h]
