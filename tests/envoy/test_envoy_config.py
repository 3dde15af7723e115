"""deploy/envoy/envoy.yaml, the Envoy bootstrap of the docs and the Envoy tier: it renders in
both body modes and Envoy 1.40 itself accepts it (``envoy --mode validate``); it is laid out as
the Inference Extension's end-to-end Envoy (ext_proc to the picker over HTTP/2, an
ORIGINAL_DST cluster keyed by ``x-gateway-destination-endpoint``)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.envoy.rig import MODES, envoy_binary, render

pytestmark = pytest.mark.envoy


def rendered(mode: str, **kw: Any) -> dict[str, Any]:
    text = render(mode, listen_port=18081, admin_port=19000, epp_port=9002, **kw)
    doc: dict[str, Any] = yaml.safe_load(text)
    return doc


def test_envoy_is_the_wheels_1_40() -> None:
    out = subprocess.run([str(envoy_binary()), "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and "/1.40." in out.stdout


@pytest.mark.parametrize("mode", sorted(MODES))
def test_envoy_accepts_the_config(mode: str, tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(rendered(mode)), encoding="utf-8")
    out = subprocess.run(
        [str(envoy_binary()), "--mode", "validate", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    # and Envoy does refuse a broken one: the check can fail
    broken = rendered(mode)
    broken["static_resources"]["clusters"][0]["lb_policy"] = "NO_SUCH_POLICY"
    path.write_text(yaml.safe_dump(broken), encoding="utf-8")
    out = subprocess.run(
        [str(envoy_binary()), "--mode", "validate", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_layout_is_the_extensions(mode: str) -> None:
    doc = rendered(mode)
    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
    dst = clusters["original_destination_cluster"]
    assert dst["type"] == "ORIGINAL_DST" and dst["lb_policy"] == "CLUSTER_PROVIDED"
    assert dst["original_dst_lb_config"] == {
        "use_http_header": True,
        "http_header_name": "x-gateway-destination-endpoint",
    }
    epp = clusters["ext_proc"]
    options = epp["typed_extension_protocol_options"]
    assert "http2_protocol_options" in next(iter(options.values()))["explicit_http_config"]
    health = epp["health_checks"][0]["grpc_health_check"]["service_name"]
    assert health == "envoy.service.ext_proc.v3.ExternalProcessor"
    (listener,) = doc["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    filters = [f["name"] for f in hcm["http_filters"]]
    assert filters == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    ext_proc = hcm["http_filters"][0]["typed_config"]
    assert ext_proc["grpc_service"]["envoy_grpc"]["cluster_name"] == "ext_proc"
    assert ext_proc["failure_mode_allow"] is False  # FailClose unless asked
    pm = ext_proc["processing_mode"]
    assert pm["request_header_mode"] == pm["response_header_mode"] == "SEND"
    assert pm["request_body_mode"] == MODES[mode]["REQUEST_BODY_MODE"]
    assert pm["response_body_mode"] == MODES[mode]["RESPONSE_BODY_MODE"]
    (route,) = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert route["route"]["cluster"] == "original_destination_cluster"
    assert (
        rendered(mode, fail_open=True)["static_resources"]["listeners"][0]["filter_chains"][0][
            "filters"
        ][0]["typed_config"]["http_filters"][0]["typed_config"]["failure_mode_allow"]
        is True
    )
