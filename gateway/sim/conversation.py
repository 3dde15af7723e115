"""``gen:conversation``: shaped like Mooncake's FAST'25 conversation trace, long uploads included.

Sessions as in :mod:`gateway.sim.production` (about ``follow`` of the requests
continue a conversation: the earlier prompt + its answer + a new turn). Every
prompt opens with one ``system_tokens`` block. A first message is, with
probability ``doc_share``, a long upload (lognormal: mean ``doc_tokens``, log-σ
``doc_sigma``), else a chat message (lognormal: ``user_tokens``, ``user_sigma``);
follow-ups are lognormal (``followup_*``), outputs lognormal (``output_*``).
Poisson session starts (``arrival=gamma&cv=…`` for bursts), 3-second ticks.

The mixture is what a single law cannot give: the trace's mean prompt (12,035
tokens) together with the share of prompts too long for a 5 s TTFT on one A6000
even alone (~7 %, above ~45k tokens). A lognormal of mean 12,035 puts at most
5.3 % above 45k (at log-σ 1.62), a Pareto of that mean under 3 %.

============  ==========================================================  =====
generator     parameters (defaults)                                       rate
============  ==========================================================  =====
conversation  system_tokens=512 user_tokens=6400 user_sigma=1.0           3.34
              doc_share=0.085 doc_tokens=62000 doc_sigma=0.3
              followup_tokens=1200 followup_sigma=1.2 output_tokens=343
              output_sigma=0.8 follow=0.3 think=90 tick=3 max_len=131072
============  ==========================================================  =====
"""

from __future__ import annotations

from gateway.core.errors import WorkloadError
from gateway.sim.gen_common import Draft, Piece, Setup, lognormal_len
from gateway.sim.production import _SESSION_DEFAULTS, CHAT_RATE, _sessions, _shape

CONVERSATION_DEFAULTS: dict[str, int | float] = {
    **_SESSION_DEFAULTS,
    "system_tokens": 512,
    "user_tokens": 6400,
    "user_sigma": 1.0,
    "doc_share": 0.085,
    "doc_tokens": 62000,
    "doc_sigma": 0.3,
    "followup_tokens": 1200,
    "followup_sigma": 1.2,
    "output_tokens": 343,
    "think": 90.0,
    "tick": 3.0,
}
CONVERSATION_RATE = CHAT_RATE
"""12,031 requests in one hour, the conversation trace's rate."""


def conversation(s: Setup) -> list[Draft]:
    """Chat sessions behind one shared first block; chat messages mixed with long uploads."""
    shape = _shape(s)
    system: Piece = (s.ids.fresh(), s.get_int("system_tokens"))
    if system[1] >= shape.max_len - 1:
        raise WorkloadError("parameter system_tokens must leave room below max_len")
    doc_share = s.get_fraction("doc_share")
    doc, doc_sigma = s.get_int("doc_tokens"), s.get_float("doc_sigma")
    user, user_sigma = s.get_int("user_tokens"), s.get_float("user_sigma")
    follow_mean, follow_sigma = s.get_int("followup_tokens"), s.get_float("followup_sigma")

    def opening(budget: int) -> list[Piece]:
        mean, sigma = (doc, doc_sigma) if s.rng.random() < doc_share else (user, user_sigma)
        first = lognormal_len(s.rng, mean, sigma, max(1, budget - system[1]))
        return [system, (s.ids.fresh(), first)]

    def next_piece() -> int:
        return lognormal_len(s.rng, follow_mean, follow_sigma, shape.max_len)

    return _sessions(s, shape, opening, next_piece)
