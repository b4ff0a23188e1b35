"""The Grafana dashboard and the Prometheus scrape config speak of metrics and ports that exist."""

import json
import re
from pathlib import Path

import yaml

from common.telemetry.metrics import GatewayMetrics, WorkerMetrics

ROOT = Path(__file__).resolve().parents[1]


def exposed_names() -> set[str]:
    worker = WorkerMetrics("w", "EPD")
    worker.gauges(running=lambda: 0, waiting=lambda: 0, kv_usage=lambda: 0)
    names = set()
    for registry in (GatewayMetrics("m", 1.0, 0.1).registry, worker.registry):
        for family in registry.collect():
            names.add(family.name)
            names.update(sample.name for sample in family.samples)
            if family.type == "histogram":
                names.update(f"{family.name}_{suffix}" for suffix in ("bucket", "sum", "count"))
            if family.type == "counter":
                names.add(f"{family.name}_total")
    return names


def test_every_dashboard_query_names_a_metric_we_expose():
    dashboard = json.loads((ROOT / "deploy/grafana/epdmesh-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {m for e in exprs for m in re.findall(r"epdmesh:[a-z0-9_]+", e)}
    assert len(dashboard["panels"]) >= 10 and len(used) >= 15
    missing = used - exposed_names()
    assert not missing, f"the dashboard queries metrics nobody exposes: {sorted(missing)}"


def test_prometheus_scrapes_the_ports_compose_opens():
    scrape = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    expected = {"gateway:8000"}
    for name, svc in compose.items():
        command = svc.get("command") or []
        if "worker" in command and not svc.get("profiles"):
            expected.add(f"{name}:{command[command.index('--metrics-port') + 1]}")
    assert targets == expected
