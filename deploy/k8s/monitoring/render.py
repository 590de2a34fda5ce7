"""Writes this folder's PrometheusRule and Grafana dashboard ConfigMap from the compose stack's
sources (deploy/prometheus/alerts.yml, deploy/grafana/dashboards/tandem.json), so that both stacks
alert and chart the same way. tests/system/test_k8s.py fails when the written files are stale.

    python deploy/k8s/monitoring/render.py
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

HERE = Path(__file__).parent
DEPLOY = HERE.parent.parent
HEADER = "# Written by render.py from {source}; edit that file and run render.py again.\n"


class _Literal(str):
    """A string written as a YAML block (|), line by line, rather than one quoted line."""


def _literal(dumper: yaml.SafeDumper, text: _Literal) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|")


yaml.SafeDumper.add_representer(_Literal, _literal)


def _dump(source: str, manifest: dict) -> str:
    return HEADER.format(source=source) + yaml.safe_dump(manifest, sort_keys=False, width=100)


def prometheus_rule() -> str:
    alerts = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return _dump("deploy/prometheus/alerts.yml", {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "tandem", "labels": {"app.kubernetes.io/part-of": "tandem"}},
        "spec": alerts,
    })


COMPOSE_DATASOURCE_UID = "tandem-prometheus"  # deploy/grafana/provisioning names its Prometheus so


def _any_prometheus(node: object) -> object:
    """The dashboard with the compose stack's Prometheus uid replaced by a ${datasource} choice."""
    if isinstance(node, dict):
        if node.get("uid") == COMPOSE_DATASOURCE_UID:
            return {**node, "uid": "${datasource}"}
        return {key: _any_prometheus(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_any_prometheus(value) for value in node]
    return node


def dashboard_config_map() -> str:
    source = json.loads((DEPLOY / "grafana" / "dashboards" / "tandem.json").read_text())
    dashboard = _any_prometheus(source)
    # A cluster's Grafana names its Prometheus datasource its own way: the dashboard asks which.
    chooser = {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"}
    dashboard["templating"]["list"].insert(0, chooser)
    return _dump("deploy/grafana/dashboards/tandem.json", {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "tandem-dashboard",
                     # The Grafana Helm chart's dashboard sidecar loads ConfigMaps with this label.
                     "labels": {"grafana_dashboard": "1", "app.kubernetes.io/part-of": "tandem"}},
        "data": {"tandem.json": _Literal(json.dumps(dashboard, indent=2) + "\n")},
    })


RENDERED = {"prometheusrule.yaml": prometheus_rule, "dashboard.yaml": dashboard_config_map}

if __name__ == "__main__":
    for name, render in RENDERED.items():
        (HERE / name).write_text(render())
        print(f"wrote {HERE / name}")
