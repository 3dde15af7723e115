"""A real Prometheus scraping a real gateway and emulated vLLM engines (all on 127.0.0.1).

Every PromQL expression of the Grafana dashboards and of alerts.yml is evaluated by
Prometheus; the key panels must show data, and every rule must load and evaluate.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from deploy_assets import (
    DASHBOARDS,
    PROMETHEUS_DIR,
    Query,
    alert_queries,
    alert_rules,
    binary,
    dashboard_queries,
    load_dashboard,
    prometheus_config_for,
    template_variables,
)
from openai import OpenAI

from tests.e2e.procs import MODEL, Proc, free_port, start, wait_for

pytestmark = pytest.mark.e2e

N_ENGINES = 2
SYSTEM = "You are kvgate's monitoring test assistant. Keep every answer short. " * 25
DOCUMENT = "Prometheus scrapes targets and evaluates rules on a fixed interval. " * 25
# vLLM exports these only with the NixlConnector (vllm/distributed/kv_transfer/kv_connector/
# v1/nixl/stats.py); the emulator has no NIXL, so they cannot come from a scrape here.
NIXL_HISTOGRAMS = (
    "vllm:nixl_xfer_time_seconds",
    "vllm:nixl_post_time_seconds",
    "vllm:nixl_bytes_transferred",
    "vllm:nixl_num_descriptors",
)
NIXL_COUNTERS = (
    "vllm:nixl_num_failed_transfers",
    "vllm:nixl_num_failed_notifications",
    "vllm:nixl_num_kv_expired_reqs",
    "vllm:nixl_num_notifications_after_expiry",
)
# (dashboard, panel title): every target must return data after the traffic below.
KEY_PANELS = (
    ("kvgate-overview.json", "Requests / s"),
    ("kvgate-overview.json", "Requests / s by route"),
    ("kvgate-overview.json", "Healthy engines"),
    ("kvgate-overview.json", "TTFT p50 / p99 (gateway)"),
    ("kvgate-overview.json", "E2E latency p50 / p99 (gateway)"),
    ("kvgate-overview.json", "TTFT p50 / p99 (vLLM, per engine)"),
    ("kvgate-overview.json", "Routing decisions / s by policy and reason"),
    ("kvgate-overview.json", "Routing decision latency p50 / p99"),
    ("kvgate-overview.json", "Prefix hit ratio: router estimate vs engines"),
    ("kvgate-overview.json", "Prefix hit ratio per engine"),
    ("kvgate-overview.json", "KV cache usage (gateway view)"),
    ("kvgate-overview.json", "KV cache usage (vLLM)"),
    ("kvgate-overview.json", "Waiting requests (vLLM)"),
    ("kvgate-overview.json", "Engine health"),
    ("kvgate-pd.json", "Requests / s by P/D mode"),
    ("kvgate-pd.json", "Prompt tokens / s by source (vLLM)"),
    ("kvgate-pd.json", "KV cache usage by engine and role"),
    ("kvgate-pd.json", "P/D decisions / s by reason"),
    ("kvgate-pd.json", "Pool load: requests in flight per engine (router)"),
)


@dataclass
class Stack:
    prometheus: str
    gateway: Proc
    engines: list[Proc]
    http: httpx.Client
    requests_sent: int = 0

    def api(self, path: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = self.http.get(f"{self.prometheus}{path}", params=params).json()
        return body

    def query(self, promql: str) -> dict[str, Any]:
        return self.api("/api/v1/query", {"query": promql})

    def query_range(self, promql: str, seconds: float = 60.0) -> dict[str, Any]:
        """As Grafana asks a panel's data: a range query (here the last minute, 2 s steps)."""
        end = time.time()
        return self.api(
            "/api/v1/query_range", {"query": promql, "start": end - seconds, "end": end, "step": 2}
        )

    def vector(self, promql: str) -> list[dict[str, Any]]:
        body = self.query(promql)
        assert body["status"] == "success", (promql, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_until(self, promql: str, ok: Any, timeout: float = 20.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            result = self.vector(promql)
            if ok(result):
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {promql}: {result}")
            time.sleep(0.2)


def start_prometheus(
    tmp: Path, gateway: str, engines: list[str], *, stack: contextlib.ExitStack
) -> str:
    port = free_port()
    config = prometheus_config_for(
        PROMETHEUS_DIR / "alerts.yml",
        targets={"kvgate": [gateway], "vllm": engines},
        interval="1s",
    )
    config_path = tmp / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    log = tmp / "prometheus.log"
    with log.open("wb") as fh:
        popen = subprocess.Popen(
            [
                binary("prometheus"),
                f"--config.file={config_path}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            cwd=tmp,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    proc = Proc("prometheus", f"http://127.0.0.1:{port}", popen, log)
    stack.callback(proc.stop)
    wait_for(proc, "/-/ready", timeout=30)
    return proc.url


def start_kvgate(
    args: list[str], name: str, port: int, logdir: Path, stack: contextlib.ExitStack
) -> Proc:
    """``kvgate ARGS`` as a process that is stopped when ``stack`` closes, even if it never
    became ready."""
    proc = start(args, name, port, logdir)
    stack.callback(proc.stop)
    return proc


def start_cluster(logdir: Path, stack: contextlib.ExitStack) -> tuple[Proc, list[Proc]]:
    """Emulated engines (started together) and a cache_aware gateway in front of them."""
    engines = []
    for i in range(N_ENGINES):
        port = free_port()
        args = ["emulate", "--port", str(port), "--model", MODEL, "--time-scale", "0.02"]
        engines.append(start_kvgate([*args, "--seed", str(i)], f"engine{i}", port, logdir, stack))
    for proc in engines:
        wait_for(proc, "/health")
    port = free_port()
    args = ["serve", "--port", str(port), "--policy", "cache_aware"]
    for proc in engines:
        args += ["--engine", proc.url]
    gateway = start_kvgate(args, "gateway", port, logdir, stack)
    wait_for(gateway, "/ready")
    return gateway, engines


def panel_variables(path: Path) -> dict[str, str]:
    """Template variables at "All"; rate windows of a minute, so the whole test's traffic counts."""
    return {**template_variables(load_dashboard(path)), "__rate_interval": "1m"}


def send_traffic(base_url: str, rounds: int) -> int:
    """Completions and chat, streamed and not, sharing prefixes; the number of requests."""
    with OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=30) as oa:
        for i in range(rounds):
            messages: list[Any] = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"question {i}"},
            ]
            chat = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
            assert chat.choices[0].message.content
            stream = oa.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=6, stream=True
            )
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            prompt = DOCUMENT + f"#{i}"
            completion = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=6)
            assert completion.choices[0].text
            pieces = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=6, stream=True)
            assert "".join(p.choices[0].text for p in pieces if p.choices)
    return 4 * rounds


def total(result: list[dict[str, Any]]) -> float:
    return sum(float(s["value"][1]) for s in result)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    binary("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    with contextlib.ExitStack() as exits:
        gateway, engines = start_cluster(tmp, exits)
        hostport = [p.url.removeprefix("http://") for p in (gateway, *engines)]
        prom = start_prometheus(tmp, hostport[0], hostport[1:], stack=exits)
        http = exits.enter_context(httpx.Client(timeout=10))
        s = Stack(prom, gateway, engines, http)
        # Rates need a sample from before the traffic and one from after it. The engines'
        # counters exist from their start: wait for a first scrape of every target. The
        # gateway's labelled series appear with the first request: send one round and wait
        # until Prometheus has it, then the rest, then wait until every target was scraped
        # after the last request.
        s.wait_until("count(up == 1)", lambda r: total(r) == 1 + N_ENGINES)
        s.requests_sent = send_traffic(gateway.url, 1)
        s.wait_until("sum(kvgate_requests_total)", lambda r: total(r) == s.requests_sent)
        s.requests_sent += send_traffic(gateway.url, 4)
        s.wait_until("sum(kvgate_requests_total)", lambda r: total(r) == s.requests_sent)
        s.wait_until(
            'sum(vllm:request_success_total{job="vllm"})', lambda r: total(r) == s.requests_sent
        )
        yield s


def test_all_targets_are_up_with_the_compose_job_names(stack: Stack) -> None:
    up = {(s["metric"]["job"], s["value"][1]) for s in stack.vector("up")}
    assert up == {("kvgate", "1"), ("vllm", "1")}
    assert len(stack.vector('up{job="vllm"}')) == N_ENGINES


def test_every_dashboard_and_alert_expression_evaluates(stack: Stack) -> None:
    queries: list[tuple[Query, str]] = []
    for path in DASHBOARDS:
        variables = panel_variables(path)
        queries += [(q, q.promql(variables)) for q in dashboard_queries() if q.source == path.name]
    queries += [(q, q.expr) for q in alert_queries()]
    assert len(queries) > 50

    def check(item: tuple[Query, str]) -> list[str]:
        query, promql = item
        out = []
        for kind, body in (("instant", stack.query(promql)), ("range", stack.query_range(promql))):
            if body.get("status") != "success":
                out.append(f"{query.source} '{query.title}' {query.ref} ({kind}): {body}")
        return out

    with ThreadPoolExecutor(8) as pool:
        errors = [e for found in pool.map(check, queries) for e in found]
    assert not errors, "\n".join(errors)


def test_key_panels_show_data(stack: Stack) -> None:
    by_panel: dict[tuple[str, str], list[str]] = {}
    for path in DASHBOARDS:
        variables = panel_variables(path)
        for q in dashboard_queries():
            if q.source == path.name:
                by_panel.setdefault((q.source, q.title), []).append(q.promql(variables))
    empty = []
    for key in KEY_PANELS:
        assert key in by_panel, f"no panel {key}"
        for promql in by_panel[key]:
            if not stack.vector(promql):
                empty.append(f"{key}: {promql}")
    assert not empty, "\n".join(empty)


def test_traffic_shows_in_rates_and_hit_ratios(stack: Stack) -> None:
    rate = total(stack.vector("sum(rate(kvgate_requests_total[1m]))"))
    assert rate > 0
    routes = {s["metric"]["route"] for s in stack.vector("kvgate_requests_total")}
    assert routes == {"chat", "completions"}
    router = stack.vector(
        "sum(rate(kvgate_routed_expected_hit_tokens_total[1m]))"
        " / sum(rate(kvgate_routed_prompt_tokens_total[1m]))"
    )
    engines = stack.vector(
        'sum(rate(vllm:prefix_cache_hits_total{job="vllm"}[1m]))'
        ' / sum(rate(vllm:prefix_cache_queries_total{job="vllm"}[1m]))'
    )
    assert 0 < total(router) <= 1
    assert 0 < total(engines) <= 1
    assert total(stack.vector("sum(kvgate_healthy_engines)")) == N_ENGINES
    decisions = stack.vector("sum by (reason) (kvgate_routing_decisions_total)")
    assert "cache_aware:hit" in {s["metric"]["reason"] for s in decisions}


def test_pd_decisions_count_every_request_of_a_unified_pool(stack: Stack) -> None:
    """The decision-mix panel's series counts each routing decision (value, not presence)."""
    unified = total(stack.vector('sum(kvgate_pd_decisions_total{reason="unified"})'))
    assert unified == stack.requests_sent
    assert total(stack.vector('sum(kvgate_pd_decisions_total{reason!="unified"})')) == 0


def test_template_variables_list_the_engines(stack: Stack) -> None:
    def label_values(label: str, match: str) -> set[str]:
        values: list[str] = stack.api(f"/api/v1/label/{label}/values", {"match[]": match})["data"]
        return set(values)

    urls = {e.url for e in stack.engines}
    targets = {e.url.removeprefix("http://") for e in stack.engines}
    queries = {
        v["name"]: v["definition"]
        for path in DASHBOARDS
        for v in load_dashboard(path)["templating"]["list"]
    }
    for name, definition in queries.items():
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", definition)
        assert m, definition
        values = label_values(m.group(2), m.group(1))
        assert values == {"engine": urls, "instance": targets}[name], (name, values)


def test_every_rule_is_loaded_and_evaluates(stack: Stack) -> None:
    expected = {r["alert"] for r in alert_rules()}

    def loaded() -> list[dict[str, Any]]:
        body = stack.api("/api/v1/rules")
        assert body["status"] == "success", body
        return [rule for g in body["data"]["groups"] for rule in g["rules"]]

    deadline = time.monotonic() + 10
    rules = loaded()
    while any(r["lastEvaluation"].startswith("0001") for r in rules):
        assert time.monotonic() < deadline, "rules never evaluated"
        time.sleep(0.2)
        rules = loaded()
    assert {r["name"] for r in rules} == expected
    bad = [(r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad, bad
    # A healthy stack fires nothing (the `for:` windows are far longer than this test anyway).
    firing = [r["name"] for r in rules if r.get("state") == "firing"]
    assert not firing, firing


def test_every_metric_referenced_is_exported(stack: Stack) -> None:
    """Each kvgate_*/vllm:* name used is on the gateway's or an engine's /metrics (or NIXL)."""
    exported = {f"{h}{s}" for h in NIXL_HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
    exported |= {f"{c}_total" for c in NIXL_COUNTERS}
    for proc in (stack.gateway, stack.engines[0]):
        text = stack.http.get(proc.url + "/metrics").text
        for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M):
            if kind == "histogram":
                exported |= {name + s for s in ("_bucket", "_sum", "_count")}
            else:
                exported.add(name)
    referenced = {
        name
        for q in dashboard_queries() + alert_queries()
        for name in re.findall(r"\b(kvgate_[a-z0-9_]+|vllm:[a-z0-9_:]+)", q.expr)
    }
    missing = sorted(referenced - exported)
    assert not missing, missing
