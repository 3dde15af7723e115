"""``kvgate demo --pd`` sample requests: which engine did each leg, and why.

Four requests go through the gateway one at a time — a cold ~3,000-token document, a chat
turn with a new ~800-token system prompt, a second turn under the same system prompt, and
a short question. Before and after each, the engines' own ``vllm:request_success_total``
says which prefill engine ran a prefill leg (none: the decode engine prefilled locally)
and which decode engine answered; the gateway's ``kvgate_pd_decisions_total`` says why
(the P/D rule of docs/disaggregation.md).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

SYSTEM = "You are kvgate's demo assistant; answer in one short paragraph. " * 50
FOLLOW_UP = (
    "And when the prompt's system part is already cached on a decode engine, does the "
    "gateway still send the request to a prefill engine first, or prefill it there?"
)


@dataclass(frozen=True, slots=True)
class Sample:
    label: str
    path: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Legs:
    """Where one sample ran: the prefill engine (``None``: local), decode engine, reason."""

    label: str
    prefill: str | None
    decode: str | None
    reason: str


def samples(model: str, seed: int = 0) -> list[Sample]:
    rnd = random.Random(seed)
    doc = " ".join(f"{rnd.random():.6f}" for _ in range(1500))  # ~3,000 tokens, no reuse
    chat = "/v1/chat/completions"

    def turn(question: str) -> dict[str, Any]:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        return {"model": model, "messages": messages, "max_tokens": 16}

    return [
        Sample(
            "cold 3,000-token document",
            "/v1/completions",
            {"model": model, "prompt": doc, "max_tokens": 16},
        ),
        Sample("chat, new system prompt", chat, turn("What does the router do?")),
        Sample("chat, same system prompt", chat, turn(FOLLOW_UP)),
        Sample(
            "short question", "/v1/completions", {"model": model, "prompt": "Hi!", "max_tokens": 8}
        ),
    ]


def _sum(text: str, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                key = s.labels.get(label, "")
                out[key] = out.get(key, 0.0) + s.value
    return out


def _requests(client: httpx.Client, url: str) -> float:
    text = client.get(url + "/metrics").text
    return sum(_sum(text, "vllm:request_success_total", "").values())


def _reasons(client: httpx.Client, gateway: str) -> dict[str, float]:
    return _sum(client.get(gateway + "/metrics").text, "kvgate_pd_decisions_total", "reason")


def run_samples(
    gateway: str, prefills: Sequence[str], decodes: Sequence[str], model: str
) -> list[Legs]:
    """Send the samples one at a time; the legs of each, from the engines' counters."""
    out: list[Legs] = []
    with httpx.Client(timeout=120.0, trust_env=False) as client:
        for s in samples(model):
            before = {u: _requests(client, u) for u in (*prefills, *decodes)}
            reasons = _reasons(client, gateway)
            r = client.post(gateway + s.path, json=s.body)
            r.raise_for_status()
            after = {u: _requests(client, u) for u in (*prefills, *decodes)}
            ran = [u for u in after if after[u] > before[u]]
            now = _reasons(client, gateway)
            why = [k for k in now if now[k] > reasons.get(k, 0.0)]
            out.append(
                Legs(
                    s.label,
                    next((u for u in ran if u in prefills), None),
                    next((u for u in ran if u in decodes), None),
                    why[0] if why else "?",
                )
            )
    return out


def report(legs: Sequence[Legs]) -> str:
    lines = ["Sample requests (which engine did each leg, from the engines' own counters):"]
    width = max(len(x.label) for x in legs)
    for i, x in enumerate(legs, 1):
        prefill = x.prefill or "local (on the decode engine)"
        lines.append(
            f"  {i}. {x.label:<{width}}  prefill {prefill} [{x.reason}]  decode {x.decode}"
        )
    return "\n".join(lines)


def wait_ready(url: str, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            try:
                if client.get(url + "/ready").status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    return False


def print_samples_when_ready(
    gateway: str,
    prefills: Sequence[str],
    decodes: Sequence[str],
    model: str,
    say: Callable[[str], None],
) -> None:
    """The demo's background job: wait for the gateway, run the samples, print the legs."""
    if not wait_ready(gateway):
        say("kvgate demo: the gateway did not become ready; no sample requests sent")
        return
    try:
        say(report(run_samples(gateway, prefills, decodes, model)))
    except httpx.HTTPError as exc:
        say(f"kvgate demo: a sample request failed: {exc}")
