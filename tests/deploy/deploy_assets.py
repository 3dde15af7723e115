"""The Prometheus and Grafana assets under deploy/, and helpers the deploy tests share."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
GRAFANA_DIR = ROOT / "deploy" / "grafana"
DASHBOARDS = sorted((GRAFANA_DIR / "dashboards").glob("*.json"))

# What the Grafana variables become when a query is sent to Prometheus directly.
GRAFANA_BUILTINS = {
    "__rate_interval": "30s",
    "__interval": "15s",
    "__interval_ms": "15000",
    "__range": "5m",
    "__range_s": "300",
    "__range_ms": "300000",
}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


@dataclass(frozen=True)
class Query:
    """One PromQL expression of a dashboard panel or an alert rule."""

    source: str  # file name
    title: str  # panel title or alert name
    ref: str  # refId, or "alert"
    expr: str  # as written, with Grafana variables

    def promql(self, variables: dict[str, str] | None = None) -> str:
        """The expression with every Grafana variable replaced (``.*`` for template ones)."""
        values = {**GRAFANA_BUILTINS, **(variables or {})}

        def sub(m: re.Match[str]) -> str:
            name = m.group(1) or m.group(2)
            if name not in values:
                raise KeyError(f"{self.source} '{self.title}': unknown variable ${name}")
            return values[name]

        return _VARIABLE.sub(sub, self.expr)


def load_dashboard(path: Path) -> dict[str, Any]:
    board: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return board


def all_panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    out: list[dict[str, Any]] = []
    for panel in board.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def template_variables(board: dict[str, Any]) -> dict[str, str]:
    """The dashboard's template variables, each as its "All" value."""
    return {v["name"]: v.get("allValue") or ".*" for v in board["templating"]["list"]}


def dashboard_queries() -> list[Query]:
    out = []
    for path in DASHBOARDS:
        for panel in all_panels(load_dashboard(path)):
            for target in panel.get("targets", []):
                out.append(Query(path.name, panel["title"], target["refId"], target["expr"]))
    return out


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text(encoding="utf-8"))
    return [rule for group in doc["groups"] for rule in group["rules"]]


def alert_queries() -> list[Query]:
    name = "alerts.yml"
    return [
        Query(name, r.get("alert") or r["record"], "alert", r["expr"].strip())
        for r in alert_rules()
    ]


def prometheus_config_for(
    rule_file: Path, targets: dict[str, list[str]] | None = None, interval: str | None = None
) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with its rule file (and optionally targets) replaced."""
    config: dict[str, Any] = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["rule_files"] = [str(rule_file)]
    if interval is not None:
        config["global"]["scrape_interval"] = interval
        config["global"]["evaluation_interval"] = interval
    if targets is not None:
        for job in config["scrape_configs"]:
            job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    return config


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (scripts/setup_prometheus.sh installs it)")
    return path
