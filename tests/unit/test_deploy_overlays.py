"""Overlays of the Kubernetes deployment, rendered by kubectl's own kustomize: the base and
an operator's overlay with its own namespace and name prefix (deploy/kubernetes/overlays/
example). After the renames, every name an object uses to find another must still resolve —
an RBAC subject left in the old namespace is a gateway refused by the API server, a Service
name left in a setting is a gateway that finds no node."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.kustomize import CLUSTER_SCOPED, pod_specs

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
VERSIONS = ("1.30", kubernetes_validate.latest_version())
# (directory, namespace, name prefix)
LAYOUTS = [("base", "aenv", ""), ("overlays/example", "aenv-staging", "staging-")]


def _kustomize(directory: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: overlays need the real kustomize")
    out = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="module", params=LAYOUTS, ids=[d for d, _, _ in LAYOUTS])
def layout(request: pytest.FixtureRequest) -> tuple[list[dict[str, Any]], str, str]:
    directory, namespace, prefix = request.param
    return _kustomize(K8S / directory), namespace, prefix


def _find(objects: list[dict[str, Any]], kind: str, name: str, namespace: str | None) -> bool:
    return any(
        o["kind"] == kind
        and o["metadata"]["name"] == name
        and o["metadata"].get("namespace") == namespace
        for o in objects
    )


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(spec.get("initContainers", [])) + list(spec["containers"])


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_is_valid_for_kubernetes(
    layout: tuple[list[dict[str, Any]], str, str], version: str
) -> None:
    objects, _, _ = layout
    for o in objects:
        kubernetes_validate.validate(o, version, strict=True)


def test_everything_is_renamed_into_one_namespace(
    layout: tuple[list[dict[str, Any]], str, str],
) -> None:
    objects, namespace, prefix = layout
    assert _find(objects, "Namespace", namespace, None)
    for o in objects:
        if o["kind"] not in CLUSTER_SCOPED:
            assert o["metadata"]["namespace"] == namespace, o["metadata"]["name"]
        if o["kind"] != "Namespace":
            assert o["metadata"]["name"].startswith(prefix + "aenv-"), o["metadata"]["name"]


def test_rbac_subjects_follow_the_service_account(
    layout: tuple[list[dict[str, Any]], str, str],
) -> None:
    objects, namespace, _ = layout
    bindings = [o for o in objects if o["kind"] == "RoleBinding"]
    assert bindings
    for b in bindings:
        assert _find(objects, b["roleRef"]["kind"], b["roleRef"]["name"], namespace)
        for s in b["subjects"]:
            assert s["kind"] == "ServiceAccount"
            assert _find(objects, "ServiceAccount", s["name"], s["namespace"]), s


def test_pods_name_objects_that_exist(layout: tuple[list[dict[str, Any]], str, str]) -> None:
    objects, namespace, _ = layout
    for o in objects:
        for spec in pod_specs(o):
            if "serviceAccountName" in spec:
                assert _find(objects, "ServiceAccount", spec["serviceAccountName"], namespace)
            if "priorityClassName" in spec:
                assert _find(objects, "PriorityClass", spec["priorityClassName"], None)
            for c in _containers(spec):
                for src in c.get("envFrom", []):
                    ref = src.get("configMapRef") or src.get("secretRef")
                    kind = "ConfigMap" if "configMapRef" in src else "Secret"
                    assert _find(objects, kind, ref["name"], namespace), ref
                for e in c.get("env", []):
                    key = e.get("valueFrom", {}).get("secretKeyRef")
                    if key is not None:
                        assert _find(objects, "Secret", key["name"], namespace), key


def _service_selecting(objects: list[dict[str, Any]], name: str) -> dict[str, str]:
    """The pod labels of the workload the named Service selects (a Service in a setting)."""
    svc = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == name)
    return dict(svc["spec"]["selector"])


def test_services_named_in_settings_follow_the_renames(
    layout: tuple[list[dict[str, Any]], str, str],
) -> None:
    objects, _, prefix = layout
    config = next(o for o in objects if o["kind"] == "ConfigMap")
    data = config["data"]
    assert data["AENV_KUBERNETES_SERVICE"] == f"{prefix}aenv-node"
    assert data["REDIS_HOST"] == f"{prefix}aenv-redis"
    workloads = {o["kind"]: o for o in objects if o["kind"] in ("DaemonSet",)}
    node_labels = workloads["DaemonSet"]["spec"]["template"]["metadata"]["labels"]
    selector = _service_selecting(objects, data["AENV_KUBERNETES_SERVICE"])
    assert all(node_labels.get(k) == v for k, v in selector.items())
    redis = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("redis")
    )
    selector = _service_selecting(objects, data["REDIS_HOST"])
    labels = redis["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in selector.items())
