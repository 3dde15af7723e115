"""A real ``kvgate serve`` (with client, admin and engine keys) in front of an emulator.

- SSRF: nothing in a request (Host, X-Forwarded-*, Forwarded, an absolute-URI target, a URL
  in ``model`` or any body field, ``kv_transfer_params``) makes the gateway, or through it an
  engine, connect anywhere else: a canary server on 127.0.0.1 must see no connection. A
  control shows the canary would notice (an emulator given ``kv_transfer_params`` directly
  does connect to it: that is why the gateway refuses them).
- Request heads are bounded: a 1 MB header is a 431, 300 headers a 431, a 100 kB target a
  414, all at once, and the server stays up; a huge declared body is a 413 before it is sent.
- Secrets never appear in the logs (run at debug level), nor in admin answers.
"""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from procs import MODEL, Proc, free_port, start, start_emulator, wait_for

pytestmark = pytest.mark.e2e

CLIENT_KEY = "client-secret-7f3a9c1e5b"
ADMIN_KEY = "admin-secret-2d8e4b6a0c"
ENGINE_KEY = "engine-secret-9b1c3e5d7f"
WRONG_KEY = "wrong-guess-secret-4a6c8e0b2d"
PROXY_AUTH = "proxy-secret-1a2b3c4d5e"


class Canary:
    """A TCP server that records every connection (and answers nothing useful)."""

    def __init__(self) -> None:
        self.hits: list[bytes] = []
        hits = self.hits

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.settimeout(1.0)
                try:
                    data = self.request.recv(4096)
                except OSError:
                    data = b""
                hits.append(data)
                self.request.sendall(b"HTTP/1.1 500 canary\r\ncontent-length: 0\r\n\r\n")

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port: int = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Running:
    def __init__(self, engine: Proc, gateway: Proc, port: int) -> None:
        self.engine, self.gateway, self.port = engine, gateway, port


@pytest.fixture(scope="module")
def canary() -> Iterator[Canary]:
    c = Canary()
    yield c
    c.close()


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    logdir = tmp_path_factory.mktemp("security")
    engine = start_emulator(logdir, 0, time_scale=0.001)
    port = free_port()
    config = logdir / "kvgate.yaml"
    config.write_text(
        json.dumps(
            {
                "engines": [{"url": engine.url, "api_key": ENGINE_KEY}],
                "api_keys": [CLIENT_KEY],
                "admin_key": ADMIN_KEY,
                "log_level": "debug",
            }
        )
    )
    gateway = start(
        ["serve", "--port", str(port), "--config", str(config)], "gateway", port, logdir
    )
    try:
        wait_for(gateway, "/ready")
        yield Running(engine, gateway, port)
    finally:
        gateway.stop()
        engine.stop()


def raw_request(port: int, data: bytes, timeout: float = 10.0) -> tuple[int, bytes, float]:
    """Send ``data`` as is; (status, whole answer, seconds until the connection closed)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        with contextlib.suppress(OSError):  # the server may answer and close early
            s.sendall(data)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
            if b"\r\n\r\n" in out and b"connection: close" not in out.lower():
                head, _, body = out.partition(b"\r\n\r\n")
                length = _content_length(head)
                if length is not None and len(body) >= length:
                    break
    status = int(out[9:12]) if out.startswith(b"HTTP/1.1 ") else 0
    return status, out, time.monotonic() - t0


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return None


def post(target: bytes, body: bytes, *headers: bytes, host: bytes = b"gw") -> bytes:
    head = [
        b"POST " + target + b" HTTP/1.1",
        b"host: " + host,
        b"authorization: Bearer " + CLIENT_KEY.encode(),
        b"content-type: application/json",
        b"content-length: " + str(len(body)).encode(),
        b"connection: close",
        *headers,
    ]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def completion(**extra: object) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2, **extra}).encode()


# -- SSRF ----------------------------------------------------------------------------------
def test_no_request_makes_the_gateway_connect_anywhere_else(
    running: Running, canary: Canary
) -> None:
    c = canary.url
    hostport = f"127.0.0.1:{canary.port}".encode()
    attacks: list[tuple[str, bytes, set[int]]] = [
        ("host header", post(b"/v1/completions", completion(), host=hostport), {200}),
        (
            "forwarding headers",
            post(
                b"/v1/completions",
                completion(),
                b"x-forwarded-host: " + hostport,
                b"x-forwarded-proto: http",
                b"x-forwarded-port: " + str(canary.port).encode(),
                b"forwarded: host=" + hostport + b";proto=http",
                b"x-original-url: " + c.encode() + b"/v1/completions",
                b"x-rewrite-url: " + c.encode() + b"/v1/completions",
                b"x-kvgate-engine: " + c.encode(),
                b"x-session-id: " + c.encode(),
                b"x-request-id: " + c.encode(),
            ),
            {200},
        ),
        ("absolute-form target", post(c.encode() + b"/v1/completions", completion()), {200, 404}),
        ("authority-like path", post(b"//" + hostport + b"/v1/completions", completion()), {404}),
        ("dot segments", post(b"/v1/../v1/completions/../../" + hostport, completion()), {404}),
        ("url as model", post(b"/v1/completions", completion(model=c + "/v1")), {404}),
        (
            "urls in body fields",
            post(
                b"/v1/completions",
                completion(url=c, base_url=c, api_base=c, engine=c, endpoint=c),
            ),
            {200},
        ),
        (
            "kv_transfer_params",
            post(
                b"/v1/completions",
                completion(
                    kv_transfer_params={
                        "do_remote_prefill": True,
                        "remote_engine_id": "evil",
                        "remote_host": "127.0.0.1",
                        "remote_port": canary.port,
                        "remote_request_id": "r-1",
                        "remote_block_ids": [],
                    }
                ),
            ),
            {400},
        ),
        (
            "CONNECT",
            b"CONNECT " + hostport + b" HTTP/1.1\r\nhost: " + hostport + b"\r\n\r\n",
            {400, 404, 405},
        ),
    ]
    for name, data, statuses in attacks:
        status, answer, _ = raw_request(running.port, data)
        assert status in statuses, (name, answer[:500])
    with httpx.Client(base_url=f"http://127.0.0.1:{running.port}", timeout=10) as admin:
        # an admin may add engines; nothing a client sends can (wrong key: refused)
        r = admin.post(
            "/admin/engines",
            json={"url": c},
            headers={"authorization": f"Bearer {CLIENT_KEY}"},
        )
        assert r.status_code == 401
    time.sleep(1.5)  # health probes and any background work had their chance
    assert canary.hits == []


def test_control_the_canary_sees_an_engine_told_to_connect(
    canary: Canary, running: Running
) -> None:
    """Why ``kv_transfer_params`` are refused: an engine follows the address in them."""
    before = len(canary.hits)
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "evil",
        "remote_host": "127.0.0.1",
        "remote_port": canary.port,
        "remote_request_id": "r-2",
        "remote_block_ids": [],
        "remote_num_tokens": 0,
    }
    r = httpx.post(
        running.engine.url + "/v1/completions",
        json={"model": MODEL, "prompt": "hello", "max_tokens": 2, "kv_transfer_params": params},
        timeout=10,
    )
    assert r.status_code == 200
    deadline = time.monotonic() + 5
    while len(canary.hits) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(canary.hits) > before
    assert b"kv_release" in canary.hits[-1]
    del canary.hits[before:]


# -- request size limits ------------------------------------------------------------------
def test_oversized_heads_are_refused_at_once(running: Running) -> None:
    cases = [
        (post(b"/v1/completions", completion(), b"x-big: " + b"a" * 1_000_000), 431),
        (post(b"/v1/completions", completion(), b"x-big: " + b"a" * 70_000), 431),
        (
            post(b"/v1/completions", completion(), *[b"x-h%d: v" % i for i in range(300)]),
            431,
        ),
        (b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nhost: gw\r\n\r\n", 414),
    ]
    for data, expected in cases:
        status, answer, seconds = raw_request(running.port, data)
        assert status == expected, answer[:300]
        assert seconds < 5
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == expected
    # a normal request on a fresh connection still works
    status, answer, _ = raw_request(running.port, post(b"/v1/completions", completion()))
    assert status == 200, answer[:300]


def test_huge_declared_body_is_413_before_it_is_sent(running: Running) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer "
        + CLIENT_KEY.encode()
        + b"\r\ncontent-type: application/json\r\ncontent-length: 100000000\r\n\r\n{"
    )
    status, answer, seconds = raw_request(running.port, head)
    assert status == 413 and seconds < 5, answer[:300]


# -- secrets ------------------------------------------------------------------------------
def test_secrets_are_never_logged_nor_shown(running: Running) -> None:
    url = f"http://127.0.0.1:{running.port}"
    with httpx.Client(base_url=url, timeout=10) as client:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
        for key in (CLIENT_KEY, WRONG_KEY, ADMIN_KEY):
            client.post(
                "/v1/completions",
                json=body,
                headers={"authorization": f"Bearer {key}", "proxy-authorization": PROXY_AUTH},
            )
            client.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                headers={"authorization": f"Bearer {key}"},
            )
            client.get("/admin/engines", headers={"authorization": f"Bearer {key}"})
            client.get("/admin/engines", headers={"x-admin-key": key})
        client.post(  # an engine error path: a bad request the engine refuses
            "/v1/completions",
            json={**body, "max_tokens": 10**9},
            headers={"authorization": f"Bearer {CLIENT_KEY}"},
        )
        engines = client.get("/admin/engines", headers={"x-admin-key": ADMIN_KEY})
        assert engines.status_code == 200
        assert ENGINE_KEY not in engines.text and ADMIN_KEY not in engines.text
        metrics = client.get("/metrics").text
        assert all(s not in metrics for s in (CLIENT_KEY, ADMIN_KEY, ENGINE_KEY))
    running.gateway.stop()  # flushes the log
    log = running.gateway.output()
    assert '"request done"' in log  # the log is there (level debug: everything)
    for secret in (CLIENT_KEY, ADMIN_KEY, ENGINE_KEY, WRONG_KEY, PROXY_AUTH):
        assert secret not in log, secret
    assert Path(running.gateway.log).exists()
