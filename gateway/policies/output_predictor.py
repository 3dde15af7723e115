"""An online output-length predictor: recent completions grouped by prefix and SLO class.

Requests sharing their first prompt block (a system prompt, a tool preamble)
and SLO class tend to produce similar output lengths. The predictor keeps an
exponentially weighted mean per group, falls back to the class's mean and
then a global one, and caps the prediction at the request's ``max_tokens``.
Memory: at most ``max_groups`` groups (least recently updated go first).
"""

from __future__ import annotations

from collections import OrderedDict

from gateway.core.types import RequestInfo


class OutputPredictor:
    """Predicted output tokens for a request."""

    def __init__(
        self, *, default: float = 128.0, alpha: float = 0.2, max_groups: int = 4096
    ) -> None:
        self.default = default
        self.alpha = alpha
        self.max_groups = max_groups
        self._groups: OrderedDict[tuple[int, str], float] = OrderedDict()
        self._classes: dict[str, float] = {}
        self._global = default

    @staticmethod
    def group(req: RequestInfo) -> tuple[int, str]:
        return (req.block_hashes[0] if req.block_hashes else 0, req.slo.name)

    def predict(self, req: RequestInfo) -> float:
        value = self._groups.get(self.group(req))
        if value is None:
            value = self._classes.get(req.slo.name, self._global)
        if req.max_tokens is not None:
            value = min(value, float(req.max_tokens))
        return max(1.0, value)

    def observe(self, req: RequestInfo, output_tokens: int) -> None:
        key = self.group(req)
        a = self.alpha
        old = self._groups.pop(key, None)
        self._groups[key] = output_tokens if old is None else old + a * (output_tokens - old)
        while len(self._groups) > self.max_groups:
            self._groups.popitem(last=False)
        cls = self._classes.get(req.slo.name)
        self._classes[req.slo.name] = (
            float(output_tokens) if cls is None else cls + a * (output_tokens - cls)
        )
        self._global += a * (output_tokens - self._global)
