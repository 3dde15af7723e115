"""gen:conversation: the conversation trace's shape (docs: gateway/sim/conversation.py).

Targets: one shared first 512-token block, ~30 % of requests continuing an earlier
conversation (prompt = earlier prompt + answer + new turn), mean prompt ≈ 12,035
and output ≈ 343 tokens, ~7 % of prompts above 45k tokens (no 5 s TTFT on one
A6000 even alone), 12,031 requests an hour. Tolerances cover seeds 0-2 at 1,500.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from itertools import pairwise

import pytest

from gateway.sim.workloads import WorkloadOptions, WorkloadRequest, load_workload

OPTIONS = WorkloadOptions()
FIRST_BLOCK = 512 // OPTIONS.block_size
TRACE_RATE = 12_031 / 3600


@pytest.fixture(scope="module", params=[0, 1, 2])
def requests(request: pytest.FixtureRequest) -> list[WorkloadRequest]:
    return load_workload(f"gen:conversation?n=1500&seed={request.param}", OPTIONS).requests


def _by_session(reqs: Sequence[WorkloadRequest]) -> dict[str, list[WorkloadRequest]]:
    out: dict[str, list[WorkloadRequest]] = defaultdict(list)
    for r in reqs:
        assert r.session is not None
        out[r.session].append(r)
    return out


def test_every_request_shares_the_first_512_tokens_and_no_more(
    requests: list[WorkloadRequest],
) -> None:
    assert len({r.block_hashes[:FIRST_BLOCK] for r in requests}) == 1
    assert all(r.prompt_tokens > 512 for r in requests)
    openings = [turns[0] for turns in _by_session(requests).values()]
    second = {r.block_hashes[FIRST_BLOCK] for r in openings if len(r.block_hashes) > FIRST_BLOCK}
    assert len(second) > 0.99 * len(openings)  # sessions share nothing past the first block


def test_about_thirty_percent_continue_an_earlier_prompt_and_its_answer(
    requests: list[WorkloadRequest],
) -> None:
    sessions = _by_session(requests)
    continued = 1 - len(sessions) / len(requests)
    assert 0.18 < continued < 0.35
    for turns in sessions.values():
        for a, b in pairwise(turns):
            assert b.arrival >= a.arrival
            assert b.prompt_tokens > a.prompt_tokens + a.output_tokens
            full = a.prompt_tokens // OPTIONS.block_size
            assert b.block_hashes[:full] == a.block_hashes[:full]


def test_means_and_rate_are_the_traces(requests: list[WorkloadRequest]) -> None:
    assert statistics.fmean(r.prompt_tokens for r in requests) == pytest.approx(12_035, rel=0.1)
    assert statistics.fmean(r.output_tokens for r in requests) == pytest.approx(343, rel=0.08)
    span = requests[-1].arrival - requests[0].arrival
    assert 0.85 * TRACE_RATE < len(requests) / span < 1.05 * TRACE_RATE


def test_prompts_are_long_tailed_with_a_share_no_engine_serves_within_5s(
    requests: list[WorkloadRequest],
) -> None:
    prompts = sorted(r.prompt_tokens for r in requests)
    assert 0.055 < sum(p > 45_000 for p in prompts) / len(prompts) < 0.09
    assert prompts[len(prompts) // 2] < 0.6 * statistics.fmean(prompts)
    assert prompts[-1] <= 131_072
