"""The traffic recorder: record format, salting, rotation, the queue bound, the app hook."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engines import FakeCluster, FakeEngine
from prometheus_client import CollectorRegistry

from gateway.config import load_settings
from gateway.core.types import RequestInfo, SloClass
from gateway.proxy.app import create_app
from gateway.proxy.exchange import Exchange
from gateway.proxy.recorder import Entry, Recorder, RotatingFile, Salter, format_entry, make_entry
from gateway.proxy.routing_key import RoutingKeyer
from gateway.sim.workloads import WorkloadOptions, load_workload

MOONCAKE = ["timestamp", "input_length", "output_length", "hash_ids"]
FIELDS = {
    *MOONCAKE,
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
}
KEYER = RoutingKeyer(16)
SHARED = "You are a helpful assistant for the accounting department. " * 8


def entry(**kw: Any) -> Entry:
    base = Entry(
        arrival=10.5,
        hashes=(11, 22, 33),
        block_size=16,
        estimate=50,
        prompt=None,
        output=None,
        output_usage=False,
        max_tokens=None,
        model="m",
        slo_class="standard",
        route="chat",
        engine="http://a:1",
        prefill_engine=None,
        ok=True,
        outcome="ok",
    )
    return replace(base, **kw)


def exchange(prompt: str = "hello " * 40, **kw: Any) -> Exchange:
    hashes, tokens = KEYER.key(prompt)
    info = RequestInfo(
        id="r", block_hashes=hashes, prompt_tokens=tokens, arrival=0.0, model="m", **kw
    )
    return Exchange(
        route="completions",
        path="/v1/completions",
        raw=b"",
        info=info,
        model="m",
        stream=False,
        request_id="r",
        started=3.25,
        engine="http://a:1",
    )


def line(e: Entry, salter: Any = lambda h: h, t0: float = 10.0) -> dict[str, Any]:
    text = format_entry(e, salter, t0, 1_700_000_000_000)
    assert text.endswith("\n") and text.count("\n") == 1 and text.isascii()
    out: dict[str, Any] = json.loads(text)
    return out


# -- format ------------------------------------------------------------------------------------


def test_record_is_a_mooncake_line_with_kvgate_fields() -> None:
    rec = line(entry(prompt=48, output=7, output_usage=True))
    assert list(rec)[:4] == MOONCAKE
    assert set(rec) == FIELDS
    assert rec["timestamp"] == 500  # ms since the recorder's start
    assert (rec["input_length"], rec["input_source"]) == (48, "usage")
    assert (rec["output_length"], rec["output_source"]) == (7, "usage")
    assert rec["hash_ids"] == [11, 22, 33] and rec["block_size"] == 16
    assert rec["recording_start"] == 1_700_000_000_000
    assert (rec["model"], rec["slo_class"], rec["route"], rec["ok"]) == ("m", "standard", "chat", 1)


@pytest.mark.parametrize(
    ("kw", "n_in", "n_out"),
    [
        ({}, (50, "estimate"), (1, "unknown")),
        ({"output": 9}, (50, "estimate"), (9, "estimate")),
        ({"max_tokens": 64, "ok": False}, (50, "estimate"), (64, "max_tokens")),
        ({"output": 0, "output_usage": True}, (50, "estimate"), (1, "usage")),
        ({"prompt": 0, "estimate": 0}, (1, "estimate"), (1, "unknown")),
    ],
)
def test_lengths_say_where_they_came_from(
    kw: dict[str, Any], n_in: tuple[int, str], n_out: tuple[int, str]
) -> None:
    rec = line(entry(**kw))
    assert (rec["input_length"], rec["input_source"]) == n_in
    assert (rec["output_length"], rec["output_source"]) == n_out


def test_p_d_records_both_engines_and_arrivals_never_go_negative() -> None:
    rec = line(entry(prefill_engine="http://p:1", arrival=1.0))
    assert rec["prefill_engine"] == "http://p:1" and rec["engine"] == "http://a:1"
    assert rec["timestamp"] == 0


def test_entry_reads_usage_from_json_and_sse_tails() -> None:
    body = b'{"choices":[{"text":"\\"prompt_tokens\\": 99"}],"usage":{"prompt_tokens":41,'
    body += b'"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":16}}}'
    e = make_entry(exchange(), ok=True, outcome="ok", output=5, usage=body)
    assert (e.prompt, e.output, e.output_usage, e.arrival) == (41, 5, True, 3.25)
    sse = b'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3}}\n\n'
    assert make_entry(exchange(), ok=True, outcome="ok", output=3, usage=sse).prompt == 12
    bare = make_entry(exchange(), ok=True, outcome="ok", output=3, usage=b"data: [DONE]\n\n")
    assert (bare.prompt, bare.output_usage) == (None, False)
    assert bare.hashes == exchange().info.block_hashes and bare.estimate == 60


def test_entry_reads_responses_and_messages_usage() -> None:
    """Responses and Messages report ``input_tokens``/``output_tokens``; Messages leaves the
    cache reads out of ``input_tokens``, so they are added back."""
    responses = b'{"usage":{"input_tokens":30,"input_tokens_details":{"cached_tokens":16},'
    responses += b'"output_tokens":4,"output_tokens_details":{"reasoning_tokens":0}}}'
    e = make_entry(exchange(), ok=True, outcome="ok", output=4, usage=responses)
    assert (e.prompt, e.output_usage) == (30, True)
    ex = exchange()
    ex.route = "messages"
    tail = b'event: message_delta\ndata: {"usage":{"input_tokens":14,'
    tail += b'"cache_read_input_tokens":16,"output_tokens":6}}\n\n'
    m = make_entry(ex, ok=True, outcome="ok", output=6, usage=tail)
    assert (m.prompt, m.output_usage) == (30, True)


# -- salting -----------------------------------------------------------------------------------


def test_salting_keeps_prefix_structure_and_hides_the_hashes() -> None:
    a, _ = KEYER.key(SHARED + "Question one: what is the balance of the ledger?")
    b, _ = KEYER.key(SHARED + "Another question entirely, about invoices and taxes?")
    c, _ = KEYER.key("Something else. " + SHARED)
    shared = sum(1 for x, y in zip(a, b, strict=False) if x == y)
    assert shared >= 5
    salt = Salter(b"k" * 32)
    sa, sb, sc = ([salt(h) for h in hs] for hs in (a, b, c))
    assert sa[:shared] == sb[:shared] and sa[shared] != sb[shared]
    assert sc[0] != sa[0]
    unsalted = {*a, *b, *c}
    assert not unsalted & {*sa, *sb, *sc}
    assert all(0 <= i < 2**63 for i in sa)
    other = Salter(b"q" * 32)
    assert not {other(h) for h in a} & set(sa)
    assert [Salter(b"k" * 32)(h) for h in a] == sa  # deterministic for a given key


def test_salt_strings_are_stable_and_no_salt_is_random(tmp_path: Path) -> None:
    def ids(salt: str | None) -> list[int]:
        r = Recorder(tmp_path / "x.jsonl", salt=salt)
        return [r._salter(h) for h in (1, 2, 3)]

    assert ids("team-secret") == ids("team-secret") != ids("other-secret")
    assert ids(None) != ids(None)


# -- rotation, bound, dropping -----------------------------------------------------------------


def test_rotation_keeps_backups_and_bounds_each_file(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    f = RotatingFile(path, max_bytes=100, backups=2)
    for i in range(20):
        f.write(f"{i:02d}{'x' * 27}\n".encode())  # 30 bytes: 3 per file
    f.fh.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["rec.jsonl", "rec.jsonl.1", "rec.jsonl.2"]
    assert all(p.stat().st_size <= 100 for p in tmp_path.iterdir())
    kept = [ln[:2] for p in (path.with_name("rec.jsonl.2"), path.with_name("rec.jsonl.1"), path)
            for ln in p.read_text().splitlines()]  # fmt: skip
    assert kept == [f"{i:02d}" for i in range(12, 20)]  # oldest to newest, none lost between
    again = RotatingFile(path, max_bytes=100, backups=2)  # a restart appends
    assert again.size == path.stat().st_size
    again.fh.close()


def test_no_backups_starts_the_file_over(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    f = RotatingFile(path, max_bytes=50, backups=0)
    for i in range(5):
        f.write(f"{i}{'y' * 19}\n".encode())
    f.fh.close()
    assert [p.name for p in tmp_path.iterdir()] == ["rec.jsonl"]
    assert path.read_text().splitlines()[-1].startswith("4")


def test_a_full_queue_drops_and_counts_without_blocking(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    rec = Recorder(tmp_path / "r.jsonl", queue_size=3, registry=registry)  # writer not started
    t0 = time.perf_counter()
    for _ in range(1000):
        rec.record(exchange(), ok=True, outcome="ok", output=1)
    assert time.perf_counter() - t0 < 0.5
    assert rec.dropped == 997
    assert registry.get_sample_value("kvgate_record_dropped_total") == 997


def test_a_stuck_writer_never_blocks_the_request_path(tmp_path: Path) -> None:
    release = threading.Event()
    entered = threading.Event()
    rec = Recorder(tmp_path / "r.jsonl", queue_size=10)

    def stuck(h: int) -> int:
        entered.set()
        release.wait(10)
        return h

    rec._salter = stuck  # type: ignore[assignment]
    rec.start()
    # One record first, and wait until the writer is stuck formatting it: the
    # writer then holds exactly that one and the queue (10) is all that is left.
    rec.record(exchange(), ok=True, outcome="ok", output=1)
    assert entered.wait(5)
    t0 = time.perf_counter()
    for _ in range(200):
        rec.record(exchange(), ok=True, outcome="ok", output=1)
    assert time.perf_counter() - t0 < 0.5
    assert rec.dropped == 200 - 10
    release.set()
    rec.close()
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert len(lines) == rec.written == 201 - rec.dropped


def test_close_flushes_everything_and_later_records_are_ignored(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    rec = Recorder(tmp_path / "r.jsonl", salt="s", registry=registry)
    rec.start()
    for i in range(300):
        rec.record(exchange(f"prompt number {i} " * 20), ok=True, outcome="ok", output=i + 1)
    rec.close()
    rec.record(exchange(), ok=True, outcome="ok", output=1)
    lines = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [x["output_length"] for x in lines] == list(range(1, 301))
    assert registry.get_sample_value("kvgate_record_written_total") == 300
    assert rec.dropped == 0


def test_write_errors_are_counted_not_raised(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "r.jsonl")
    rec.start()
    assert rec._file is not None
    rec._file.fh.close()  # every write now fails
    for _ in range(5):
        rec.record(exchange(), ok=True, outcome="ok", output=1)
    rec.close()
    assert rec.dropped == 5 and rec.written == 0


# -- in the gateway ----------------------------------------------------------------------------


@asynccontextmanager
async def gateway(path: Path, *engines: FakeEngine) -> AsyncIterator[httpx.AsyncClient]:
    cfg = load_settings(
        engines=[{"url": e.url} for e in engines],
        retries={"max_attempts": 2, "backoff_s": 0.0},
        log_requests=False,
        record={"path": str(path), "salt": "test"},
    )
    app = create_app(cfg, transport=FakeCluster(*engines).transport())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield client


async def test_gateway_records_served_refused_and_failed_requests(tmp_path: Path) -> None:
    path = tmp_path / "rec" / "traffic.jsonl"
    a, bad = FakeEngine("http://a:1"), FakeEngine("http://b:1", model="x", mode="status400")
    chat = {"model": "m", "messages": [{"role": "user", "content": SHARED}]}
    async with gateway(path, a, bad) as gw:
        assert (await gw.post("/v1/chat/completions", json=chat)).status_code == 200
        r = await gw.post("/v1/chat/completions", json={**chat, "stream": True})
        assert r.status_code == 200
        r = await gw.post("/v1/completions", json={"model": "x", "prompt": "hi", "max_tokens": 9})
        assert r.status_code == 400
        bad.mode = "status503"
        r = await gw.post("/v1/completions", json={"model": "x", "prompt": "hi"})
        assert r.status_code == 503
        assert (await gw.post("/v1/chat/completions", json={"model": "m"})).status_code == 400
        metrics = (await gw.get("/metrics")).text
    assert "kvgate_record_dropped_total 0.0" in metrics
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["route"], r["ok"], r["outcome"]) for r in rows] == [
        ("chat", True, "ok"),
        ("chat", True, "ok"),
        ("completions", False, "engine_client_error"),
        ("completions", False, "rejected_503"),  # an invalid request is never recorded
    ]
    assert rows[0]["hash_ids"] == rows[1]["hash_ids"] and len(rows[0]["hash_ids"]) > 3
    assert [r["input_source"] for r in rows] == ["usage", "usage", "estimate", "estimate"]
    assert [r["output_length"] for r in rows] == [3, 3, 9, 1]
    assert all(r["engine"] == "http://a:1" for r in rows[:2]) and rows[2]["engine"] == bad.url
    assert all(set(r) == FIELDS | {"tenant"} for r in rows)  # flow control's (anonymous)
    assert "accounting" not in path.read_text()
    wl = load_workload(f"recorded:{path}", WorkloadOptions(block_size=16))
    assert len(wl) == 4 and wl.requests[0].arrival == 0.0
    assert wl.requests[0].block_hashes == wl.requests[1].block_hashes


def test_slo_class_and_model_survive(tmp_path: Path) -> None:
    e = exchange(slo=SloClass("interactive", 1.0, 0.05), max_tokens=5)
    rec = line(make_entry(e, ok=False, outcome="cancelled", output=None), t0=0.0)
    assert (rec["slo_class"], rec["output_length"], rec["timestamp"]) == ("interactive", 5, 3250)


def test_serve_flag_and_config_section(tmp_path: Path) -> None:
    from gateway.cli import build_parser
    from gateway.cli.serve import settings_from_args
    from gateway.core.errors import ConfigError

    cfg = tmp_path / "k.yaml"
    cfg.write_text("record: {salt: s1, backups: 2}\n")
    base = ["serve", "--engine", "http://a:1", "--config", str(cfg)]
    s = settings_from_args(build_parser().parse_args([*base, "--record", str(tmp_path / "r")]))
    assert s.record.path == str(tmp_path / "r") and s.record.backups == 2
    assert s.record.salt is not None and s.record.salt.get_secret_value() == "s1"
    assert s.record.max_bytes == 100 * 1024 * 1024 and s.record.queue_size == 10_000
    assert settings_from_args(build_parser().parse_args(base)).record.path is None
    cfg.write_text("record: {salt: ' '}\n")
    with pytest.raises(ConfigError, match=r"record\.salt"):
        settings_from_args(build_parser().parse_args(base))


async def test_p_d_requests_record_the_prefill_engine_only_when_it_prefilled(
    tmp_path: Path,
) -> None:
    p, d = FakeEngine("http://p:1"), FakeEngine("http://d:1")
    path = tmp_path / "pd.jsonl"
    cfg = load_settings(
        engines=[{"url": p.url, "role": "prefill"}, {"url": d.url, "role": "decode"}],
        retries={"max_attempts": 2, "backoff_s": 0.0},
        log_requests=False,
        record={"path": str(path)},
    )
    app = create_app(cfg, transport=FakeCluster(p, d).transport())
    body = {"model": "m", "prompt": "a long prompt that is worth a remote prefill " * 60}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as gw:
            assert (await gw.post("/v1/completions", json=body)).status_code == 200
            p.mode = "status503"  # the prefill leg fails: a local prefill on the decode engine
            assert (await gw.post("/v1/completions", json=body)).status_code == 200
            p.mode = "status400"  # a new prompt (the last one is cached on the decode engine)
            other = {"model": "m", "prompt": "another prompt, long enough to go remote " * 60}
            assert (await gw.post("/v1/completions", json=other)).status_code == 400
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r.get("prefill_engine"), r["engine"], r["outcome"]) for r in rows] == [
        (p.url, d.url, "ok"),
        (None, d.url, "ok"),
        (None, None, "engine_client_error"),
    ]
