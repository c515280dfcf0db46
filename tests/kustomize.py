"""A renderer for the part of kustomize that `deploy/kubernetes/kustomization.yaml` uses.

`resources` (local files), `namespace`, `labels` (without `includeSelectors`) and `images`,
applied as `kubectl kustomize` applies them, and `configurations` of `nameReference`s only,
which change nothing here (they rename values along with a Service that an overlay's
`namePrefix` renames; tests/unit/test_deploy_overlays.py renders overlays with kubectl). Any other field of the kustomization is refused
rather than ignored, so the tests never check a rendering that differs from what
`kubectl apply -k` would create (and where kubectl is installed, the tests compare the two).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {
    "apiVersion",
    "kind",
    "namespace",
    "labels",
    "resources",
    "images",
    "configurations",
}
# Kinds without a namespace (of those a deployment may carry).
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
    "IngressClass",
    "ValidatingWebhookConfiguration",
    "MutatingWebhookConfiguration",
}
WORKLOADS = {"Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job"}


class Unsupported(Exception):
    pass


def render(directory: Path) -> list[dict[str, Any]]:
    kz = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kz) - SUPPORTED
    if unknown:
        raise Unsupported(f"kustomization fields this renderer does not apply: {sorted(unknown)}")
    if (kz.get("apiVersion"), kz.get("kind")) != (
        "kustomize.config.k8s.io/v1beta1",
        "Kustomization",
    ):
        raise Unsupported("not a kustomize.config.k8s.io/v1beta1 Kustomization")
    for conf in kz.get("configurations", []):
        fields = set(yaml.safe_load((directory / conf).read_text()))
        if fields != {"nameReference"}:
            raise Unsupported(f"configurations {conf!r}: only nameReference is rendered")
    objects: list[dict[str, Any]] = []
    for res in kz.get("resources", []):
        path = directory / res
        if not path.is_file():
            raise Unsupported(f"resource {res!r}: only local files are rendered")
        objects += [d for d in yaml.safe_load_all(path.read_text()) if d]
    objects = [copy.deepcopy(o) for o in objects]
    if "namespace" in kz:
        _namespace(objects, kz["namespace"])
    for entry in kz.get("labels", []):
        _labels(objects, entry)
    for image in kz.get("images", []):
        _image(objects, image)
    return objects


def _namespace(objects: list[dict[str, Any]], ns: str) -> None:
    for o in objects:
        if o["kind"] not in CLUSTER_SCOPED:
            o["metadata"]["namespace"] = ns
        # kustomize moves the ServiceAccounts a binding names along with them.
        if o["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            for s in o.get("subjects", []):
                if s.get("kind") == "ServiceAccount":
                    s["namespace"] = ns


def _labels(objects: list[dict[str, Any]], entry: dict[str, Any]) -> None:
    if entry.get("includeSelectors"):
        raise Unsupported("labels.includeSelectors")
    if set(entry) - {"pairs", "includeSelectors", "includeTemplates"}:
        raise Unsupported(f"labels fields {sorted(entry)}")
    pairs = entry.get("pairs", {})
    for o in objects:
        o["metadata"].setdefault("labels", {}).update(pairs)
        if entry.get("includeTemplates") and o["kind"] in WORKLOADS:
            meta = o["spec"]["template"].setdefault("metadata", {})
            meta.setdefault("labels", {}).update(pairs)


def pod_specs(o: dict[str, Any]) -> list[dict[str, Any]]:
    if o["kind"] in WORKLOADS:
        return [o["spec"]["template"]["spec"]]
    if o["kind"] == "Pod":
        return [o["spec"]]
    return []


def _split_image(ref: str) -> tuple[str, str]:
    """(name, the tag or digest suffix with its separator)."""
    if "@" in ref:
        name, digest = ref.split("@", 1)
        return name, "@" + digest
    slash = ref.rfind("/")
    colon = ref.rfind(":")
    if colon > slash:
        return ref[:colon], ref[colon:]
    return ref, ""


def _image(objects: list[dict[str, Any]], image: dict[str, Any]) -> None:
    if set(image) - {"name", "newName", "newTag", "digest"}:
        raise Unsupported(f"images fields {sorted(image)}")
    for o in objects:
        for spec in pod_specs(o):
            for c in spec.get("initContainers", []) + spec.get("containers", []):
                name, suffix = _split_image(c["image"])
                if name != image["name"]:
                    continue
                name = image.get("newName", name)
                if "digest" in image:
                    suffix = "@" + image["digest"]
                elif "newTag" in image:
                    suffix = ":" + str(image["newTag"])
                c["image"] = name + suffix
