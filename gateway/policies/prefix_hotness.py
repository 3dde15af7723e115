"""DualMap's adaptive hash prefix: how many leading blocks key a request.

Keys start at one block. Each routed request is counted on every prefix of
its key (its chained block hashes up to the key's depth) over a sliding
window of the last ``window`` requests. When a key's traffic share exceeds
``hot`` (2/n by default, n engines) it is *expanded*: later requests under it
are keyed one block deeper, so a hot prefix spreads over more engines. When
an expanded prefix's share falls under ``cold`` (1/n) the expansion is
dropped and its requests key on it again. Memory: the window, the counts of
keys in it, and at most ``max_expanded`` expansions.

A key that more than ``shared`` of all traffic uses (a system prompt in front of
every request) is never the final key, from the first request on: it is
extended without waiting for ``min_samples`` (the share counts the request
being keyed, so the very first request extends it too), and then kept like any
other expansion until it cools.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence


class PrefixHotness:
    """A lazy prefix table: which prefixes are split one block deeper."""

    def __init__(
        self,
        *,
        window: int = 200,
        min_samples: int = 20,
        hot: float | None = None,
        cold: float | None = None,
        max_expanded: int = 4096,
        max_depth: int = 256,
        shared: float | None = None,
    ) -> None:
        if window <= 0 or min_samples <= 0 or max_expanded <= 0 or max_depth <= 0:
            raise ValueError("window, min_samples, max_expanded and max_depth must be positive")
        self.window = window
        self.min_samples = min_samples
        self.hot_fixed = hot
        self.cold_fixed = cold
        self.max_expanded = max_expanded
        self.max_depth = max_depth
        self.shared = shared
        self.instances = 1
        self._window: deque[tuple[int, ...]] = deque()
        self._counts: dict[int, int] = {}
        self._expanded: OrderedDict[int, int] = OrderedDict()

    @property
    def hot(self) -> float:
        return self.hot_fixed if self.hot_fixed is not None else 2.0 / max(1, self.instances)

    @property
    def cold(self) -> float:
        """1/n by default, and never above half the hot threshold (else splits flap)."""
        if self.cold_fixed is not None:
            return self.cold_fixed
        return min(1.0 / max(1, self.instances), self.hot / 2)

    @property
    def expanded(self) -> int:
        return len(self._expanded)

    def count(self, prefix: int) -> int:
        """Requests of the window keyed on or below ``prefix``."""
        return self._counts.get(prefix, 0)

    def share(self, prefix: int) -> float:
        """Fraction of the window's requests keyed on or below ``prefix``."""
        return self._counts.get(prefix, 0) / len(self._window) if self._window else 0.0

    def depth(self, hashes: Sequence[int]) -> int:
        """Key depth (blocks) for a prompt; 0 for a prompt without a full block."""
        if not hashes:
            return 0
        d = 1
        limit = min(len(hashes), self.max_depth)
        while d < limit and (hashes[d - 1] in self._expanded or self._shared_now(hashes[d - 1])):
            d += 1
        return d

    def _shared_now(self, prefix: int) -> bool:
        """True when ``prefix`` is used by more than ``shared`` of the window and this request."""
        if self.shared is None:
            return False
        return (self._counts.get(prefix, 0) + 1) / (len(self._window) + 1) > self.shared

    def observe(self, hashes: Sequence[int], depth: int) -> None:
        """Count a routed request keyed at ``depth``; expand or collapse prefixes."""
        if depth <= 0:
            return
        counted = tuple(hashes[:depth])
        window, counts = self._window, self._counts
        window.append(counted)
        for h in counted:
            counts[h] = counts.get(h, 0) + 1
        if len(window) > self.window:
            for h in window.popleft():
                n = counts[h] - 1
                if n:
                    counts[h] = n
                else:
                    del counts[h]
        if self.shared is not None:  # shared keys we walked through stay split (hysteresis)
            for h in counted[:-1]:
                if (
                    h not in self._expanded
                    and self.share(h) > self.shared
                    and len(self._expanded) < self.max_expanded
                ):
                    self._expanded[h] = 0
        if len(window) < self.min_samples:
            return
        key = counted[-1]
        if (
            key not in self._expanded
            and depth < min(len(hashes), self.max_depth)
            and self.share(key) > self.hot
            and len(self._expanded) < self.max_expanded
        ):
            self._expanded[key] = depth
        for h in counted[:-1]:  # a cooled ancestor drops its split
            if h in self._expanded and self.share(h) < self.cold:
                del self._expanded[h]
        self._sweep_one()

    def _sweep_one(self) -> None:
        """Check the oldest expansion for cooling (amortised O(1) per request)."""
        if not self._expanded:
            return
        prefix = next(iter(self._expanded))
        if self.share(prefix) < self.cold:
            del self._expanded[prefix]
        else:
            self._expanded.move_to_end(prefix)
