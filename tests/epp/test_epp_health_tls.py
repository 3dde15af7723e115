"""gRPC health as the protocol names it, TLS with a given certificate, and the CLI's flags."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.cli import build_parser
from gateway.cli.epp import options_from_args
from gateway.cli.serve import settings_from_args
from gateway.core.errors import ConfigError
from gateway.epp import EppOptions
from tests.epp.harness import MODEL, FakeEnvoy, fleet, picker

SERVING = health_pb2.HealthCheckResponse.SERVING
NAMES = ["", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"]


async def statuses(channel: grpc.aio.Channel) -> dict[str, int]:
    stub = health_pb2_grpc.HealthStub(channel)
    out = {}
    for name in NAMES:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=name))
        out[name] = reply.status
    return out


async def test_health_serves_liveness_readiness_and_the_processor() -> None:
    async with (
        fleet("both") as (transport, urls),
        picker(transport, [{"url": u} for u in urls]) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        assert await statuses(channel) == dict.fromkeys(NAMES, SERVING)
        await server.set_ready(False)  # shutting down: alive, not ready
        got = await statuses(channel)
        assert got["liveness"] == SERVING
        assert {got[n] for n in NAMES if n != "liveness"} == {
            health_pb2.HealthCheckResponse.NOT_SERVING
        }
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="nope")
            )
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "tls.crt", tmp / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


async def test_tls_with_the_given_certificate(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    options = EppOptions(port=0, metrics_port=None, cert_path=cert, key_path=key)
    async with (
        fleet("both") as (transport, urls),
        picker(transport, [{"url": u} for u in urls], options=options) as server,
    ):
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        envoy = FakeEnvoy(server, transport, tls=creds)
        out = await envoy.send("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert out.status == 200 and out.destination
        await envoy.aclose()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as plain:
            with pytest.raises(grpc.aio.AioRpcError):  # plaintext is refused
                await health_pb2_grpc.HealthStub(plain).Check(
                    health_pb2.HealthCheckRequest(service="liveness"), timeout=5
                )


def test_the_cli_takes_serves_routing_flags_and_its_own() -> None:
    args = build_parser().parse_args(
        ["epp", "--engine", "http://10.0.0.1:8000", "--policy", "round_robin",
         "--host", "0.0.0.0", "--port", "9100", "--metrics-port", "9191", "--fallbacks", "1"]
    )  # fmt: skip
    settings = settings_from_args(args)
    assert [e.url for e in settings.engines] == ["http://10.0.0.1:8000"]
    assert settings.policy.name == "round_robin"
    assert settings.port == 8000  # --port is gRPC's, not the HTTP proxy's
    options = options_from_args(args)
    assert (options.host, options.port, options.metrics_port) == ("0.0.0.0", 9100, 9191)
    assert options.fallbacks == 1
    defaults = options_from_args(build_parser().parse_args(["epp", "--engine", "http://a:1"]))
    assert (defaults.port, defaults.metrics_port, defaults.fallbacks) == (9002, 9090, 0)
    with pytest.raises(ConfigError):
        options_from_args(build_parser().parse_args(["epp", "--fallbacks", "-1"]))


async def test_tls_needs_both_files(tmp_path: Path) -> None:
    cert, _ = self_signed(tmp_path)
    options = EppOptions(port=0, metrics_port=None, cert_path=cert)
    async with fleet("both") as (transport, urls):
        with pytest.raises(ConfigError):
            async with picker(transport, [{"url": u} for u in urls], options=options):
                pass


async def test_metrics_are_served_over_http() -> None:
    import httpx

    options = EppOptions(port=0, metrics_port=0)
    async with (
        fleet("both") as (transport, urls),
        picker(transport, [{"url": u} for u in urls], options=options) as server,
    ):
        envoy = FakeEnvoy(server, transport)
        out = await envoy.send("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert out.status == 200
        await envoy.aclose()
        async with httpx.AsyncClient() as client:
            r = await client.get(f"http://127.0.0.1:{server.metrics_port}/metrics")
        assert r.status_code == 200
        assert 'kvgate_requests_total{outcome="ok"' in r.text
        assert "kvgate_epp_open_requests 0.0" in r.text
