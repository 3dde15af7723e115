"""deploy/prometheus and deploy/grafana: promtool checks, alert unit tests, dashboard structure."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_assets import (
    DASHBOARDS,
    GRAFANA_DIR,
    PROMETHEUS_DIR,
    ROOT,
    alert_queries,
    alert_rules,
    all_panels,
    binary,
    dashboard_queries,
    load_dashboard,
    prometheus_config_for,
    template_variables,
)
from prometheus_client import CollectorRegistry

from gateway.cluster.registry import EngineRegistry
from gateway.flow import FairQueue
from gateway.observability import GatewayMetrics
from gateway.proxy.flow_metrics import FlowMetrics

DATASOURCE = {"type": "prometheus", "uid": "prometheus"}
SEVERITIES = {"critical", "warning", "info"}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("promtool"), *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


# -- promtool ------------------------------------------------------------------------------
def test_promtool_checks_the_compose_config(tmp_path: Path) -> None:
    # The compose file reads its rules from /etc/prometheus/alerts.yml (a mounted volume);
    # check a copy that points at the repository's file instead.
    config = prometheus_config_for(PROMETHEUS_DIR / "alerts.yml")
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    result = promtool("check", "config", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_promtool_checks_the_rules() -> None:
    result = promtool("check", "rules", "deploy/prometheus/alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_promtool_alert_unit_tests_pass() -> None:
    result = promtool("test", "rules", "deploy/prometheus/alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


# -- Prometheus config and rules -----------------------------------------------------------
def test_compose_config_scrapes_the_gateway_and_the_engines() -> None:
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    jobs = {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in config["scrape_configs"]
    }
    assert jobs == {
        "kvgate": ["gateway:8000"],
        "vllm": ["engine-1:8000", "engine-2:8000", "engine-3:8000"],
    }


def test_every_alert_is_labelled_annotated_and_unit_tested() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)), "duplicate alert names"
    assert {
        "KvgateDown",
        "KvgateNoHealthyEngine",
        "KvgateHighErrorRate",
        "KvgateTTFTP99OverSLO",
        "VllmKvCacheNearFull",
        "KvgateRouterHitRatioCollapse",
        "VllmPrefixHitRatioCollapse",
    } <= set(names)
    for rule in rules:
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert rule["annotations"]["description"].strip(), rule["alert"]
    tests = yaml.safe_load((PROMETHEUS_DIR / "alerts_test.yml").read_text())
    firing = Counter(
        case["alertname"]
        for test in tests["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    )
    quiet = Counter(
        case["alertname"]
        for test in tests["tests"]
        for case in test.get("alert_rule_test", [])
        if not case.get("exp_alerts")
    )
    for name in names:
        assert firing[name] >= 1, f"{name}: no unit test where it fires"
    assert set(quiet) <= set(names)


# -- Grafana -------------------------------------------------------------------------------
def test_grafana_provisioning_points_at_prometheus_and_the_dashboards() -> None:
    prov = GRAFANA_DIR / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert (source["uid"], source["type"], source["url"]) == (
        "prometheus",
        "prometheus",
        "http://prometheus:9090",
    )
    dash = yaml.safe_load((prov / "dashboards" / "kvgate.yml").read_text())
    (provider,) = dash["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    assert {p.name for p in DASHBOARDS} == {"kvgate-overview.json", "kvgate-pd.json"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_structure(path: Path) -> None:
    board = load_dashboard(path)
    assert board["schemaVersion"] >= 39
    assert board["uid"] and board["title"]
    panels = all_panels(board)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {path.name}"
    variables = template_variables(board)
    for var in board["templating"]["list"]:
        assert var["datasource"] == DATASOURCE, var["name"]
    used: set[str] = set()
    data_panels = [p for p in panels if p["type"] != "row"]
    assert len(data_panels) >= 10
    for panel in data_panels:
        title = panel["title"]
        assert panel["datasource"] == DATASOURCE, title
        pos = panel["gridPos"]
        assert pos["w"] > 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, title
        targets: list[dict[str, Any]] = panel["targets"]
        assert targets, f"{title}: no targets"
        refs = [t["refId"] for t in targets]
        assert len(refs) == len(set(refs)), title
        for target in targets:
            assert target["datasource"] == DATASOURCE, title
            assert target["expr"].strip(), title
            used |= set(re.findall(r"\$\{?(\w+)", target["expr"]))
    assert used - {"__rate_interval", "__interval", "__range"} <= set(variables)


def test_dashboard_titles_are_unique_and_uids_distinct() -> None:
    boards = [load_dashboard(p) for p in DASHBOARDS]
    assert len({b["uid"] for b in boards}) == len(boards)
    for board in boards:
        titles = [p["title"] for p in all_panels(board) if p["type"] != "row"]
        assert len(titles) == len(set(titles)), board["uid"]


def test_every_grafana_variable_is_substituted() -> None:
    for path in DASHBOARDS:
        variables = template_variables(load_dashboard(path))
        for query in dashboard_queries():
            if query.source == path.name:
                assert "$" not in query.promql(variables), query


def test_every_kvgate_metric_referenced_is_exported_by_the_gateway() -> None:
    metrics = GatewayMetrics(CollectorRegistry())
    metrics.watch_engines(EngineRegistry(), lambda: {})
    FlowMetrics(metrics.registry, FairQueue(), max_tenants=5)  # flow control's collectors
    exported: set[str] = set()
    for family in metrics.registry.collect():
        if family.type == "counter":
            exported.add(family.name + "_total")
        elif family.type == "histogram":
            exported |= {family.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            exported.add(family.name)
    referenced = {
        name
        for q in dashboard_queries() + alert_queries()
        for name in re.findall(r"\bkvgate_[a-z0-9_]+", q.expr)
    }
    assert referenced, "no kvgate metric referenced"
    assert referenced <= exported, sorted(referenced - exported)
