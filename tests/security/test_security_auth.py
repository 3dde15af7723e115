"""Client keys and the admin key are separate; keys are compared in constant time; the
client's Authorization never reaches an engine (each engine gets its own key)."""

from __future__ import annotations

import hmac
from types import SimpleNamespace
from typing import Any

import pytest
from fake_engines import FakeEngine
from inproc_gateway import A, B, client_of, running_app
from pydantic import SecretStr

from gateway.proxy import fastpath

BODY = {"model": "m", "prompt": "x"}
KEYS: dict[str, Any] = {"api_keys": ["client-k1", "client-k2"], "admin_key": "admin-k"}


async def test_client_keys_do_not_open_admin_routes_and_vice_versa() -> None:
    async with running_app(FakeEngine(A), **KEYS) as app, client_of(app) as gw:
        as_client = {"authorization": "Bearer client-k1"}
        as_admin = {"authorization": "Bearer admin-k"}
        admin_by_client = await gw.get("/admin/engines", headers=as_client)
        admin_by_client_header = await gw.get(
            "/admin/engines", headers={"x-admin-key": "client-k1"}
        )
        delete_by_client = await gw.delete("/admin/engines", params={"url": A}, headers=as_client)
        v1_by_admin = await gw.post("/v1/completions", json=BODY, headers=as_admin)
        models_by_admin = await gw.get("/v1/models", headers=as_admin)
        admin_ok = await gw.get("/admin/engines", headers=as_admin)
        admin_header_ok = await gw.get("/admin/engines", headers={"x-admin-key": "admin-k"})
        v1_ok = await gw.post("/v1/completions", json=BODY, headers=as_client)
    for r in (admin_by_client, admin_by_client_header, delete_by_client):
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    for r in (v1_by_admin, models_by_admin):
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert admin_ok.status_code == 200 and admin_header_ok.status_code == 200
    assert v1_ok.status_code == 200
    assert len(admin_ok.json()["engines"]) == 1  # the DELETE did nothing


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Basic client-k1",
        "client-k1",
        "Bearer client-k1x",
        "Bearer client-k",
        "Bearer CLIENT-K1",
        "Bearer client-k1\x00",
    ],
)
async def test_malformed_or_wrong_client_keys_are_401(authorization: str | None) -> None:
    a = FakeEngine(A)
    headers = {} if authorization is None else {"authorization": authorization}
    async with running_app(a, **KEYS) as app, client_of(app) as gw:
        r = await gw.post("/v1/completions", json=BODY, headers=headers)
    assert r.status_code == 401
    assert a.seen == []


async def test_admin_without_a_key_is_loopback_only() -> None:
    async with (
        running_app(FakeEngine(A)) as app,
        client_of(app, "127.0.0.1") as local,
        client_of(app, "203.0.113.9") as remote,
    ):
        assert (await local.get("/admin/engines")).status_code == 200
        r = await remote.get("/admin/engines")
        spoof = await remote.get(
            "/admin/engines", headers={"x-forwarded-for": "127.0.0.1", "host": "localhost"}
        )
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert spoof.status_code == 403  # headers do not make a caller local


def test_client_keys_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every configured key is compared with hmac.compare_digest, whichever matches."""
    calls: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(fastpath.hmac, "compare_digest", spy)

    keys = [SecretStr("k-a"), SecretStr("k-b"), SecretStr("k-c")]
    state: Any = SimpleNamespace(settings=SimpleNamespace(api_keys=keys))
    assert fastpath.check_client_key(state, "Bearer k-a") == 0
    assert len(calls) == 3  # not stopped at the first match
    calls.clear()
    assert fastpath.check_client_key(state, "bearer k-c") == 2
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(fastpath.ApiError):
        fastpath.check_client_key(state, "Bearer k-x")
    assert len(calls) == 3


async def test_client_authorization_is_never_forwarded_engines_get_their_own() -> None:
    a, b = FakeEngine(A), FakeEngine(B)
    async with (
        running_app(
            a,
            b,
            api_keys=["client-k1"],
            engine_keys={A: "engine-a-key"},
            policy={"name": "round_robin"},
        ) as app,
        client_of(app) as gw,
    ):
        for path in ("/v1/completions", "/v1/chat/completions"):
            for stream in (False, True):
                body = {
                    "model": "m",
                    "stream": stream,
                    **(
                        {"prompt": "x"}
                        if path == "/v1/completions"
                        else {"messages": [{"role": "user", "content": "x"}]}
                    ),
                }
                r = await gw.post(
                    path,
                    json=body,
                    headers={"authorization": "Bearer client-k1", "cookie": "session=s3cret"},
                )
                assert r.status_code == 200
    sent = a.headers + b.headers
    assert len(sent) == 4
    assert all("client-k1" not in str(h) and "s3cret" not in str(h) for h in sent)
    assert all(h["authorization"] == "Bearer engine-a-key" for h in a.headers)
    assert all("authorization" not in h for h in b.headers)  # B has no key configured
