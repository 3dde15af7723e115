"""The picker keys every endpoint as ``kvgate serve`` does: the same bodies through the HTTP
proxy and through the picker give the same recorded routing keys (salted block hashes,
prompt estimates, usage) and sessions, one recorder format for both front ends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from gateway.config import load_settings
from gateway.proxy.app import create_app
from tests.epp.harness import EMBED, MODEL, FakeEnvoy, fleet, picker

SHARED = "You are a careful assistant. Answer briefly and cite the document. " * 8
BODIES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                              "messages": [{"role": "system", "content": SHARED},
                                           {"role": "user", "content": "first question"}]}),
    ("/v1/completions", {"model": MODEL, "prompt": SHARED + "complete this", "max_tokens": 2}),
    ("/v1/responses", {"model": MODEL, "instructions": SHARED, "input": "a question",
                       "max_output_tokens": 2}),
    ("/v1/messages", {"model": MODEL, "system": SHARED, "max_tokens": 2,
                      "messages": [{"role": "user", "content": "hello"}]}),
    ("/v1/embeddings", {"model": EMBED, "input": [SHARED, "another text"]}),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "user": "session-7",
                              "messages": [{"role": "user", "content": "sticky"}]}),
]  # fmt: skip
KEYS = ("route", "hash_ids", "input_length", "input_source", "output_length", "model", "ok")


def rows(path: Path) -> list[dict[str, Any]]:
    return [
        {k: row.get(k) for k in (*KEYS, "session")}
        for row in map(json.loads, path.read_text().splitlines())
    ]


async def test_serve_and_epp_record_the_same_keys(tmp_path: Path) -> None:
    record = {"salt": "parity", "path": None}
    sessions = {"enabled": True, "body_fields": ["user"]}
    async with fleet("both", pooling=1) as (transport, urls):
        engines = [{"url": u} for u in urls]
        served = tmp_path / "serve.jsonl"
        cfg = load_settings(
            engines=engines, record={**record, "path": str(served)}, sessions=sessions
        )
        app = create_app(cfg, transport=transport)
        async with app.router.lifespan_context(app):
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://g")
            for path, body in BODIES:
                r = await client.post(path, content=json.dumps(body).encode())
                assert r.status_code == 200, r.text
            await client.aclose()
        picked = tmp_path / "epp.jsonl"
        async with picker(
            transport, engines, record={**record, "path": str(picked)}, sessions=sessions
        ) as server:
            envoy = FakeEnvoy(server, transport)
            for i, (path, body) in enumerate(BODIES):
                out = await envoy.send(path, body, mode="duplex" if i % 2 else "buffered")
                assert out.status == 200, out.content
            await envoy.aclose()
    a, b = rows(served), rows(picked)
    assert len(a) == len(BODIES) == len(b)
    assert a == b
    assert all(r["hash_ids"] for r in a[:4])  # generation routes are keyed on their prompt
    assert a[0]["hash_ids"][:4] == a[2]["hash_ids"][:4] == a[3]["hash_ids"][:4]  # one system prompt
    assert a[5]["session"]
