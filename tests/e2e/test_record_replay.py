"""Record real traffic with ``kvgate serve --record`` and replay it in the simulator.

Real processes (emulated engines, the gateway) and the official openai client; the recording
is checked against what the engines reported, for its sharing structure, and for privacy.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from openai import BadRequestError, OpenAI
from procs import MODEL, ROOT, Cluster, cluster

from gateway.proxy.recorder import Salter, salt_key
from gateway.proxy.routing_key import RoutingKeyer, render_chat
from gateway.sim.workloads import WorkloadOptions, load_workload

pytestmark = pytest.mark.e2e

SALT = "e2e-recording-salt"
SYSTEM_A = (
    "Aurelian ledger steward: reconcile invoices, flag duplicates, summarise balances "
    "quarterly, always cite the voucher numbers. "
) * 6
DOC_B = (
    "Handbook of meteorology. Cumulonimbus formations precede thunderstorms; barometric "
    "pressure drops signal approaching fronts. "
) * 6
UNIQUE = [
    "Xylophone workshop inventory: mallets, resonators, frames and carrying cases.",
    "Quokka habitats on Rottnest Island shelter among shrubs during daytime heat.",
    "Zeppelin mooring masts needed sturdy winches, ballast crews and windsocks.",
]


@dataclass
class Sent:
    """One request as the client saw it."""

    group: str  # "A", "B" or "unique"
    prompt: str  # the routing key's text (chat rendered as the gateway renders it)
    prompt_tokens: int | None  # from the engine's usage; None when the client saw none
    completion_tokens: int | None
    output: str
    ok: bool = True


def chat(oa: OpenAI, group: str, messages: list[dict[str, str]], *, stream: bool) -> Sent:
    rendered = render_chat(messages)
    if not stream:
        r = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)  # type: ignore[arg-type]
        assert r.usage is not None
        text = r.choices[0].message.content or ""
        return Sent(group, rendered, r.usage.prompt_tokens, r.usage.completion_tokens, text)
    chunks = list(
        oa.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return Sent(group, rendered, usage.prompt_tokens, usage.completion_tokens, text)


def complete(oa: OpenAI, group: str, prompt: str, *, stream: bool, usage: bool = True) -> Sent:
    if not stream:
        r = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=5)
        assert r.usage is not None
        return Sent(
            group, prompt, r.usage.prompt_tokens, r.usage.completion_tokens, r.choices[0].text
        )
    options = {"stream_options": {"include_usage": True}} if usage else {}
    chunks = list(
        oa.completions.create(model=MODEL, prompt=prompt, max_tokens=5, stream=True, **options)  # type: ignore[call-overload]
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    u = chunks[-1].usage if usage else None
    return Sent(
        group, prompt, u.prompt_tokens if u else None, u.completion_tokens if u else None, text
    )


def traffic(c: Cluster) -> list[Sent]:
    oa = OpenAI(base_url=c.gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    sent = []
    for i, question in enumerate(["Which voucher repeats?", "Total for March?", "Any gaps?"]):
        messages = [
            {"role": "system", "content": SYSTEM_A},
            {"role": "user", "content": question},
        ]
        sent.append(chat(oa, "A", messages, stream=i % 2 == 1))
    for i, question in enumerate(["Why do fronts matter?", "Explain squall lines."]):
        sent.append(complete(oa, "B", DOC_B + question, stream=i == 1))
    sent.append(chat(oa, "A", [{"role": "system", "content": SYSTEM_A}], stream=True))
    sent.append(chat(oa, "unique", [{"role": "user", "content": UNIQUE[0]}], stream=False))
    sent.append(complete(oa, "unique", UNIQUE[1], stream=True))
    sent.append(complete(oa, "unique", UNIQUE[2], stream=True, usage=False))
    with pytest.raises(BadRequestError):  # the engine refuses n=2: recorded with ok=false
        oa.completions.create(model=MODEL, prompt="Refused wombat burrow", max_tokens=3, n=2)
    sent.append(Sent("refused", "Refused wombat burrow", None, None, "", ok=False))
    return sent


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Sent]]:
    tmp = tmp_path_factory.mktemp("record")
    path = tmp / "rec" / "traffic.jsonl"
    config = tmp / "kvgate.yaml"
    config.write_text(f"record: {{salt: {SALT}, max_bytes: 1000000, backups: 2}}\n")
    with cluster(tmp, n=2, gateway_args=["--config", str(config), "--record", str(path)]) as c:
        sent = traffic(c)
        c.gateway.stop()  # SIGTERM: a clean shutdown flushes every record
        # uvicorn re-raises SIGTERM once its graceful shutdown (lifespan included) is done
        assert c.gateway.popen.returncode in (0, -signal.SIGTERM), c.gateway.output()
        assert "Traceback" not in c.gateway.output()
    return path, sent


def rows(path: Path) -> list[dict[str, Any]]:
    out = [json.loads(x) for x in path.read_text().splitlines()]
    return sorted(out, key=lambda r: r["timestamp"])


def test_every_request_is_recorded_with_the_engines_lengths(
    recorded: tuple[Path, list[Sent]],
) -> None:
    path, sent = recorded
    recs = rows(path)
    assert len(recs) == len(sent)
    for s, r in zip(sent, recs, strict=True):
        assert r["ok"] is s.ok and r["model"] == MODEL and r["slo_class"] == "standard"
        if s.prompt_tokens is not None:
            assert (r["input_length"], r["input_source"]) == (s.prompt_tokens, "usage")
            assert (r["output_length"], r["output_source"]) == (s.completion_tokens, "usage")
        else:
            assert r["input_source"] == "estimate"
        assert r["engine"].startswith("http://127.0.0.1:")
    assert recs[-2]["output_source"] == "estimate"  # a stream without include_usage
    assert (recs[-1]["outcome"], recs[-1]["output_source"]) == ("engine_client_error", "max_tokens")
    assert [r["route"] for r in recs[:4]] == ["chat"] * 3 + ["completions"]


def test_hash_ids_are_the_salted_routing_keys_and_keep_the_sharing(
    recorded: tuple[Path, list[Sent]],
) -> None:
    path, sent = recorded
    recs = rows(path)
    block = recs[0]["block_size"]
    keyer, salter = RoutingKeyer(block), Salter(salt_key(SALT))
    for s, r in zip(sent, recs, strict=True):
        unsalted = keyer.key(s.prompt)[0]
        assert r["hash_ids"] == [salter(h) for h in unsalted]
        assert not set(unsalted) & set(r["hash_ids"])
    wl = load_workload(f"recorded:{path}", WorkloadOptions(block_size=block))
    assert len(wl) == len(sent)
    firsts: dict[str, set[int]] = {}
    for s, req in zip(sent, wl.requests, strict=True):
        assert req.prompt_tokens >= 1 and req.output_tokens >= 1
        if req.block_hashes:
            firsts.setdefault(s.group, set()).add(req.block_hashes[0])
    assert len(firsts["A"]) == 1 and len(firsts["B"]) == 1  # a shared prompt, shared ids
    assert len(firsts["unique"]) == 3  # nothing shared
    assert not firsts["A"] & firsts["B"] and not (firsts["A"] | firsts["B"]) & firsts["unique"]
    a = [req.block_hashes for s, req in zip(sent, wl.requests, strict=True) if s.group == "A"]
    assert min(len(x) for x in a) >= 10 and len({x[:10] for x in a}) == 1


def test_nothing_of_the_prompts_or_outputs_is_in_the_recording(
    recorded: tuple[Path, list[Sent]],
) -> None:
    path, sent = recorded
    files = sorted(path.parent.iterdir())
    text = "".join(f.read_text() for f in files)
    allowed_strings = {MODEL, "chat", "completions", "standard", "usage", "estimate"}
    allowed_strings |= {"max_tokens", "unknown", "ok", "engine_client_error"}
    keys: set[str] = set()
    for r in rows(path):
        keys |= set(r)
        for key, value in r.items():
            if key == "tenant":  # flow control's tenant, salted: hex digits only
                assert re.fullmatch(r"[0-9a-f]{16}", value), value
            elif isinstance(value, str):
                assert value in allowed_strings or key == "engine", (key, value)
            else:
                assert isinstance(value, int | list), (key, value)  # bools are ints
    assert keys <= {
        "timestamp",
        "input_length",
        "output_length",
        "hash_ids",
        "block_size",
        "input_source",
        "output_source",
        "model",
        "slo_class",
        "route",
        "engine",
        "ok",
        "outcome",
        "recording_start",
        "tenant",
        "priority",
    }
    structural = sorted(keys | allowed_strings | {"true", "false", "null", "http"}, key=len)
    remainder = text
    for word in reversed(structural):
        remainder = remainder.replace(word, " ")
    words = {w.lower() for s in sent for w in re.findall(r"[A-Za-z]{4,}", s.prompt + s.output)}
    assert len(words) > 50
    leaked = sorted(w for w in words if w in remainder.lower())
    assert not leaked
    keyer = RoutingKeyer(rows(path)[0]["block_size"])
    for s in sent:
        for h in keyer.key(s.prompt)[0]:
            assert str(h) not in text


def test_replay_runs_end_to_end_in_the_cli(
    recorded: tuple[Path, list[Sent]], tmp_path: Path
) -> None:
    path, sent = recorded
    out = tmp_path / "sim"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "simulate",
            "--workload",
            f"recorded:{path}",
            "--policies",
            "round_robin,cache_aware",
            "--instances",
            "2",
            "--rate-scale",
            "2",
            "--no-plots",
            "--no-timing",
            "--quiet",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["requests"] == len(sent) and results["rate_scale"] == 2
    for name in ("round_robin", "cache_aware"):
        assert results["policies"][name]["completed"] == len(sent)
    assert results["policies"]["cache_aware"]["cache_hit_rate"] > 0
