"""deploy/kubernetes/monitoring/podmonitors.yaml, applied on its own where the Prometheus Operator
runs: one PodMonitor each for the nodes and the gateways, each selecting exactly the pods of
its workload in the kustomization, scraping `/metrics` on a port named `metrics`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.kustomize import WORKLOADS, render

K8S = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
BASE = K8S / "base"


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    wanted = selector.get("matchLabels", {})
    return bool(wanted) and all(labels.get(k) == v for k, v in wanted.items())


def test_each_podmonitor_selects_exactly_its_workloads_pods() -> None:
    monitors = list(yaml.safe_load_all((K8S / "monitoring" / "podmonitors.yaml").read_text()))
    pods = {
        o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"]
        for o in render(BASE)
        if o["kind"] in WORKLOADS
    }
    scraped: dict[str, set[str]] = {}
    for m in monitors:
        assert m["apiVersion"] == "monitoring.coreos.com/v1" and m["kind"] == "PodMonitor"
        (endpoint,) = m["spec"]["podMetricsEndpoints"]
        assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
        scraped[m["metadata"]["name"]] = {
            name for name, labels in pods.items() if _selects(m["spec"]["selector"], labels)
        }
    assert scraped == {"aenv-node": {"aenv-node"}, "aenv-gateway": {"aenv-gateway"}}
