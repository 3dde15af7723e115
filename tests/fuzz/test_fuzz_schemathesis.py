"""Schema-driven fuzzing (schemathesis) of a real ``kvgate serve`` in front of two emulators.

The OpenAPI schema is the app's own (``GET /openapi.json``: the proxied POST routes are
served by the fast path, but FastAPI's routes still describe them). For every operation
that does not change the engine set, schemathesis generates valid (positive) and invalid
(negative) requests; each must get an answer within 10 s (no hang), never a 5xx (a 503
only with kvgate's "no healthy engine" wording, which cannot happen here), with a status
code, content type and body the schema documents. Bounded and deterministic: a fixed
number of examples per operation and ``derandomize``. ``POST``/``DELETE /admin/engines``
are left out: an admin adding a generated URL would make the gateway probe it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from procs import MODEL, Cluster, cluster

schemathesis = pytest.importorskip("schemathesis")  # dev dependency: schemathesis>=4.32,<5
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.config import load_settings  # noqa: E402
from gateway.proxy.app import create_app  # noqa: E402

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("fuzz"), n=2, time_scale=0.001) as c:
        yield c


@pytest.fixture(scope="module")
def schema() -> Any:
    app = create_app(load_settings(engines=[{"url": "http://127.0.0.1:9"}]))
    return schemathesis.openapi.from_dict(app.openapi())


def test_schema_describes_every_route(schema: Any) -> None:
    raw = schema.raw_schema
    paths = raw["paths"]
    for path, method in [
        ("/v1/completions", "post"),
        ("/v1/chat/completions", "post"),
        ("/v1/models", "get"),
        ("/health", "get"),
        ("/ready", "get"),
        ("/admin/engines", "get"),
        ("/admin/engines", "post"),
        ("/admin/engines", "delete"),
    ]:
        assert method in paths[path], (path, method)
    chat = paths["/v1/chat/completions"]["post"]
    body = chat["requestBody"]["content"]["application/json"]["schema"]
    assert "messages" in body["required"] and body["additionalProperties"] is True
    assert {"200", "400", "401", "404", "413", "429", "503"} <= set(chat["responses"])
    assert "422" not in chat["responses"]  # kvgate answers 400 for invalid parameters
    assert set(raw["components"]["securitySchemes"]) == {
        "clientKey",
        "adminKey",
        "adminKeyHeader",
    }
    assert "503" in paths["/ready"]["get"]["responses"]


def check_answer(response: requests.Response) -> None:
    status = response.status_code
    if status >= 500:
        message = ""
        if response.headers.get("content-type", "").startswith("application/json"):
            message = str(response.json().get("error", {}).get("message", ""))
        assert status == 503 and "no healthy engine" in message, (status, response.text[:300])


CASES = [
    ("/v1/completions", "POST", GenerationMode.POSITIVE, 60),
    ("/v1/completions", "POST", GenerationMode.NEGATIVE, 40),
    ("/v1/chat/completions", "POST", GenerationMode.POSITIVE, 60),
    ("/v1/chat/completions", "POST", GenerationMode.NEGATIVE, 40),
    ("/v1/models", "GET", GenerationMode.POSITIVE, 5),
    ("/health", "GET", GenerationMode.POSITIVE, 5),
    ("/ready", "GET", GenerationMode.POSITIVE, 5),
    ("/admin/engines", "GET", GenerationMode.POSITIVE, 5),
]


@pytest.mark.parametrize(("path", "method", "mode", "examples"), CASES)
def test_fuzz_operation(
    running: Cluster, schema: Any, path: str, method: str, mode: GenerationMode, examples: int
) -> None:
    operation = schema[path][method]
    seen: dict[int, int] = {}

    @settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode), served=st.booleans())
    def run(case: Any, served: bool) -> None:
        if mode is GenerationMode.POSITIVE and served and isinstance(case.body, dict):
            case.body["model"] = MODEL  # half the valid requests reach an engine
        response = case.call(base_url=running.gateway.url, timeout=10)  # timeout: no hang
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        check_answer(response)
        case.validate_response(
            response,
            checks=[status_code_conformance, content_type_conformance, response_schema_conformance],
        )

    run()
    print(f"{method} {path} {mode.value}: statuses {dict(sorted(seen.items()))}")  # with -s
    assert seen, "no request was sent"
    if path.startswith("/v1/") and method == "POST" and mode is GenerationMode.POSITIVE:
        assert seen.get(200, 0) > 0, seen  # some generated requests were really served
    if mode is GenerationMode.NEGATIVE:  # invalid requests were refused as the client's error
        assert sum(n for code, n in seen.items() if 400 <= code < 500) > 0, seen
    # the gateway survived the fuzzing and still serves a valid request end to end
    assert running.gateway.popen.poll() is None, running.gateway.output()[-2000:]
    ok = requests.post(
        running.gateway.url + "/v1/completions",
        json={"model": MODEL, "prompt": "after the fuzzing", "max_tokens": 3},
        timeout=10,
    )
    assert ok.status_code == 200, ok.text[:300]
    assert ok.json()["choices"][0]["text"] and ok.json()["usage"]["completion_tokens"] == 3
