"""The deployment files (deploy/): the kustomization rendered and every object checked
against the Kubernetes schemas, then what an operator would trip over — selectors that match
no pod, a privileged node without its host data dir, probes on a port nobody declares, an
environment variable the code never reads; and the compose file. The image's files:
test_deploy_image.py."""

from __future__ import annotations

import copy
import ipaddress
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from aenv.config import _SECTIONS, Settings
from tests.kustomize import CLUSTER_SCOPED, WORKLOADS, pod_specs, render

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes" / "base"
COMPOSE = ROOT / "deploy" / "compose" / "docker-compose.yml"
DOCKER = ROOT / "deploy" / "docker"
# The oldest Kubernetes release the manifests are meant for, and the newest schemas we have.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())

# The cluster settings (issue 12) the nodes and gateways read, accepted by name until they
# are all in config.py; the rest must be settings or names the code reads.
CLUSTER_ENV = {
    "AENV_REDIS_URL",
    "AENV_NODE_ID",
    "AENV_ADVERTISE_URL",
    "AENV_DISCOVERY",
    "AENV_KUBERNETES_SERVICE",
    "AENV_KUBERNETES_NAMESPACE",
}
# Not ours: the S3 credentials (read by the S3 client) and the manifests' own helpers.
OTHER_ENV = {
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "POD_IP",
    "REDIS_PASSWORD",
    "REDIS_HOST",
}


def _known_aenv_names() -> set[str]:
    names = {f"AENV_{f.upper()}" for f in Settings.model_fields if f not in _SECTIONS}
    for section in _SECTIONS.values():
        names |= {f"AENV_{f.upper()}" for f in section.model_fields}
    # Names read straight from the environment (os.environ.get("AENV_CACHE_DIR"), ...).
    for path in (ROOT / "src" / "aenv").rglob("*.py"):
        names |= set(re.findall(r"[\"'](AENV_[A-Z0-9_]+)[\"']", path.read_text()))
    return names | CLUSTER_ENV


KNOWN_ENV = _known_aenv_names() | OTHER_ENV


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return render(K8S)


def _one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# --- rendering and schemas ---------------------------------------------------------------


def test_renderer_agrees_with_kubectl_kustomize(objects: list[dict[str, Any]]) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (the renderer is then the only check)")
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    theirs = [d for d in yaml.safe_load_all(out) if d]

    def key(o: dict[str, Any]) -> tuple[str, str]:
        return o["kind"], o["metadata"]["name"]

    assert sorted(theirs, key=key) == sorted(objects, key=key)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_is_valid_for_kubernetes(objects: list[dict[str, Any]], version: str) -> None:
    for o in objects:
        # strict: an unknown (misspelled) field is an error, as `kubectl apply` reports it.
        kubernetes_validate.validate(o, version, strict=True)


def test_the_schema_check_catches_a_misspelled_field(objects: list[dict[str, Any]]) -> None:
    ds = copy.deepcopy(_one(objects, "DaemonSet", "aenv-node"))
    ds["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {"privileged": True}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSIONS[0], strict=True)


def test_everything_lands_in_one_namespace_that_admits_privileged_pods(
    objects: list[dict[str, Any]],
) -> None:
    ns = _one(objects, "Namespace", "aenv")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    for o in objects:
        if o["kind"] not in CLUSTER_SCOPED:
            assert o["metadata"]["namespace"] == "aenv", o["metadata"]["name"]
        assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "aenv"


def test_only_the_aenv_and_redis_images_are_used(objects: list[dict[str, Any]]) -> None:
    images = {c["image"] for o in objects for s in pod_specs(o) for c in _containers(s)}
    assert images == {"registry.example.com/aenv:0.2.0", "redis:7.2"}


# --- the node DaemonSet ------------------------------------------------------------------


def _env_of(container: dict[str, Any], objects: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
    """(name, literal value; "" for one from `valueFrom`) of what the container's environment
    holds, envFrom's ConfigMaps and Secrets first, as the kubelet builds it."""
    for src in container.get("envFrom", []):
        if "configMapRef" in src:
            data = _one(objects, "ConfigMap", src["configMapRef"]["name"])["data"]
        else:
            data = _one(objects, "Secret", src["secretRef"]["name"])["stringData"]
        yield from data.items()
    for e in container.get("env", []):
        yield e["name"], e.get("value", "")


def test_node_is_a_privileged_daemonset_on_the_hosts_data_dir(
    objects: list[dict[str, Any]],
) -> None:
    ds = _one(objects, "DaemonSet", "aenv-node")
    spec = ds["spec"]["template"]["spec"]
    node = next(c for c in spec["containers"] if c["name"] == "node")
    assert node["args"] == ["server"]
    assert node["securityContext"]["privileged"] is True
    assert not spec.get("hostPID") and not spec.get("hostNetwork")
    assert spec["automountServiceAccountToken"] is False  # sandboxes egress through the pod
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in node["volumeMounts"]}
    home = dict(_env_of(node, objects))["AENV_HOME"]
    assert volumes[mounts[home]]["hostPath"] == {"path": home, "type": "DirectoryOrCreate"}
    assert volumes[mounts["/dev"]]["hostPath"]["path"] == "/dev"  # loop devices
    # A memory limit would cap all sandboxes of the host at once.
    assert "limits" not in node.get("resources", {})
    # The base template is built before the node starts, on the same data dir.
    init = spec["initContainers"][0]
    assert init["args"][:2] == ["template", "build-base"] and init["image"] == node["image"]
    assert {m["mountPath"] for m in init["volumeMounts"]} >= {home, "/var/cache/aenv"}


def test_node_pods_outrank_other_workloads_and_drain_before_they_stop(
    objects: list[dict[str, Any]],
) -> None:
    spec = _one(objects, "DaemonSet", "aenv-node")["spec"]["template"]["spec"]
    pc = _one(objects, "PriorityClass", spec["priorityClassName"])
    # above every user workload's default (0), below the system's own classes (2e9)
    assert 0 < pc["value"] <= 1_000_000_000 and not pc.get("globalDefault")
    node = next(c for c in spec["containers"] if c["name"] == "node")
    hook = " ".join(node["lifecycle"]["preStop"]["exec"]["command"])
    listen = dict(_env_of(node, objects))["AENV_LISTEN"]
    assert f"--url http://127.0.0.1:{listen.rsplit(':', 1)[1]}" in hook
    assert 'node drain "$AENV_NODE_ID"' in hook and '--api-key "$AENV_API_KEY"' in hook
    assert "AENV_API_KEY" in dict(_env_of(node, objects))  # from the Secret, for the hook
    # the drain (a checkpoint and upload per sandbox) gets minutes before the SIGKILL
    assert spec["terminationGracePeriodSeconds"] >= 300
    assert "limits" not in node["resources"]  # a limit would cap every sandbox at once


def test_node_identity_comes_from_the_downward_api(objects: list[dict[str, Any]]) -> None:
    spec = _one(objects, "DaemonSet", "aenv-node")["spec"]["template"]["spec"]
    node = next(c for c in spec["containers"] if c["name"] == "node")
    env = {e["name"]: e for e in node["env"]}
    assert env["AENV_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    url = urlsplit(env["AENV_ADVERTISE_URL"]["value"])
    assert url.hostname == "$(pod_ip)"  # urlsplit lower-cases hosts
    listen_port = int(dict(_env_of(node, objects))["AENV_LISTEN"].rsplit(":", 1)[1])
    assert url.port == listen_port
    ports = {p["name"]: p["containerPort"] for p in node["ports"]}
    assert ports["http"] == listen_port
    # the keyless metrics listener, on the port the PodMonitors and the policy name
    metrics = dict(_env_of(node, objects))["AENV_METRICS_LISTEN"]
    assert ports["metrics"] == int(metrics.rsplit(":", 1)[1])


def test_variable_references_name_variables_defined_before_them(
    objects: list[dict[str, Any]],
) -> None:
    # The kubelet leaves an unknown $(VAR) in the value as it is: a silent misconfiguration.
    for o in objects:
        for spec in pod_specs(o):
            for c in _containers(spec):
                defined: set[str] = set()
                for name, value in _env_of(c, objects):
                    for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value):
                        assert ref in defined, f"{o['metadata']['name']}/{c['name']}: $({ref})"
                    defined.add(name)
                for arg in c.get("args", []):
                    for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                        assert ref in defined, f"{o['metadata']['name']}/{c['name']}: $({ref})"


def test_every_environment_variable_is_one_the_code_reads(
    objects: list[dict[str, Any]],
) -> None:
    for o in objects:
        for spec in pod_specs(o):
            if o["metadata"]["name"] == "aenv-redis":
                continue
            for c in _containers(spec):
                for name, _value in _env_of(c, objects):
                    assert name in KNOWN_ENV, f"{o['metadata']['name']}/{c['name']}: {name}"


def test_the_shared_settings_are_valid_settings(
    objects: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from aenv.snapshots.repository import S3Repository, open_repository

    data = _one(objects, "ConfigMap", "aenv-config")["data"]
    secret = _one(objects, "Secret", "aenv-secrets")["stringData"]
    for name, value in {**data, **secret}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AENV_HOME", str(tmp_path))  # no config.toml of this host's
    settings = Settings()
    assert settings.port == 8000 and settings.host == "0.0.0.0"
    ipaddress.ip_network(settings.net_cidr)
    assert isinstance(open_repository(settings.snapshots, tmp_path), S3Repository)
    assert re.fullmatch(r"e2b_[0-9a-f]{40}", secret["AENV_API_KEY"])


# --- gateways, services, RBAC ------------------------------------------------------------


def test_gateway_runs_two_replicas_with_health_probes_spread_over_hosts(
    objects: list[dict[str, Any]],
) -> None:
    gw = _one(objects, "Deployment", "aenv-gateway")
    assert gw["spec"]["replicas"] == 2
    pod = gw["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    assert c["args"] == ["gateway"]
    ports = {p["name"] for p in c["ports"]}
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
        assert c[probe]["httpGet"]["port"] in ports
    (term,) = pod["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert _matches(
        term["podAffinityTerm"]["labelSelector"]["matchLabels"], pod["metadata"]["labels"]
    )
    env = dict(_env_of(c, objects))
    assert env["AENV_DISCOVERY"] == "kubernetes"
    headless = _one(objects, "Service", env["AENV_KUBERNETES_SERVICE"])
    assert headless["spec"]["clusterIP"] == "None"
    pdb = _one(objects, "PodDisruptionBudget", "aenv-gateway")
    assert _matches(pdb["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])


def test_every_service_selects_exactly_one_workload_on_a_declared_port(
    objects: list[dict[str, Any]],
) -> None:
    workloads = [o for o in objects if o["kind"] in WORKLOADS]
    for svc in (o for o in objects if o["kind"] == "Service"):
        chosen = [
            w
            for w in workloads
            if _matches(svc["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
        ]
        assert len(chosen) == 1, svc["metadata"]["name"]
        (w,) = chosen
        # The workload's own selector picks its pods too (or it never becomes ready).
        assert _matches(
            w["spec"]["selector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"]
        )
        declared = {
            p.get("name")
            for c in w["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])
        }
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in declared, svc["metadata"]["name"]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and `In` expressions, what the manifests use)."""
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In", e
        ok = ok and labels.get(e["key"]) in e["values"]
    return ok and bool(selector)


def test_network_policies_admit_exactly_the_intended_callers(
    objects: list[dict[str, Any]],
) -> None:
    pods = {
        w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"]
        for w in objects
        if w["kind"] in WORKLOADS
    }
    allowed: dict[str, set[str]] = {}
    for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
        (target,) = [
            n for n, labels in pods.items() if _selects(policy["spec"]["podSelector"], labels)
        ]
        allowed[target] = {
            n
            for rule in policy["spec"]["ingress"]
            for peer in rule["from"]
            for n, labels in pods.items()
            if _selects(peer["podSelector"], labels)
        }
    assert allowed == {
        "aenv-redis": {"aenv-node", "aenv-gateway"},
        "aenv-node": {"aenv-gateway"},
    }
    # and the nodes' metrics port to the cluster's Prometheus, in its own namespace only
    node_policy = next(
        o for o in objects if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "aenv-node"
    )
    by_port = {r["ports"][0]["port"]: r["from"] for r in node_policy["spec"]["ingress"]}
    (prometheus,) = by_port[9464]
    assert prometheus["namespaceSelector"]["matchLabels"]
    assert prometheus["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "prometheus"


def test_redis_url_points_at_the_redis_service_with_its_password(
    objects: list[dict[str, Any]],
) -> None:
    svc = _one(objects, "Service", "aenv-redis")
    redis = _one(objects, "Deployment", "aenv-redis")["spec"]["template"]["spec"]["containers"][0]
    assert redis["args"][:2] == ["--requirepass", "$(REDIS_PASSWORD)"]
    for name in ("aenv-node", "aenv-gateway"):
        kind = "DaemonSet" if name == "aenv-node" else "Deployment"
        c = _one(objects, kind, name)["spec"]["template"]["spec"]["containers"][0]
        env = dict(_env_of(c, objects))
        # The kubelet expands $(REDIS_HOST), the ConfigMap's, which follows a namePrefix.
        url = urlsplit(env["AENV_REDIS_URL"].replace("$(REDIS_HOST)", env["REDIS_HOST"]))
        assert url.scheme == "redis" and url.hostname == svc["metadata"]["name"]
        assert url.port == svc["spec"]["ports"][0]["port"]
        assert url.password == "$(REDIS_PASSWORD)"


def test_each_role_gets_only_the_secrets_it_uses(objects: list[dict[str, Any]]) -> None:
    secret = set(_one(objects, "Secret", "aenv-secrets")["stringData"])
    uses = {
        ("DaemonSet", "aenv-node", "node"): secret,
        ("Deployment", "aenv-gateway", "gateway"): {"AENV_API_KEY", "REDIS_PASSWORD"},
    }
    for (kind, name, container_name), wanted in uses.items():
        spec = _one(objects, kind, name)["spec"]["template"]["spec"]
        container = next(c for c in spec["containers"] if c["name"] == container_name)
        got = {
            e["valueFrom"]["secretKeyRef"]["key"]
            for e in container.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})
        }
        for src in container.get("envFrom", []):
            if "secretRef" in src:
                got |= set(_one(objects, "Secret", src["secretRef"]["name"])["stringData"])
        assert got == wanted, f"{name} gets {sorted(got)}"


def test_gateway_may_list_and_watch_endpointslices_and_nothing_more(
    objects: list[dict[str, Any]],
) -> None:
    gw = _one(objects, "Deployment", "aenv-gateway")["spec"]["template"]["spec"]
    bindings = [
        b
        for b in objects
        if b["kind"] == "RoleBinding"
        and {"kind": "ServiceAccount", "name": gw["serviceAccountName"], "namespace": "aenv"}
        in b["subjects"]
    ]
    assert len(bindings) == 1
    _one(objects, "ServiceAccount", gw["serviceAccountName"])
    role = _one(objects, "Role", bindings[0]["roleRef"]["name"])
    assert bindings[0]["roleRef"]["kind"] == "Role"
    (rule,) = role["rules"]
    assert rule["apiGroups"] == ["discovery.k8s.io"] and rule["resources"] == ["endpointslices"]
    assert {"list", "watch"} <= set(rule["verbs"]) <= {"get", "list", "watch"}
    # Nothing cluster-wide.
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]


# --- docker compose ----------------------------------------------------------------------


def _expand(value: str) -> str:
    """Compose's `${VAR:-default}` with nothing set: the default."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}]*)\}", r"\1", value)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict)
    return doc


def _runs(service: dict[str, Any]) -> str:
    return " ".join(
        str(x) for x in (service.get("entrypoint") or []) + (service.get("command") or [])
    )


def test_compose_has_redis_s3_two_nodes_and_gateways(compose: dict[str, Any]) -> None:
    services = compose["services"]
    nodes = {n: s for n, s in services.items() if re.search(r"\bserver$", _runs(s))}
    gateways = {n: s for n, s in services.items() if _runs(s) == "gateway"}
    assert {"redis", "s3"} <= set(services)
    assert len(nodes) == 2 and 1 <= len(gateways) <= 2
    for name, s in services.items():
        for dep in s.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown {dep}"
    published = [p for s in gateways.values() for p in s["ports"]]
    assert len({p.rsplit(":", 1)[0] for p in published}) == len(published)


def test_compose_nodes_are_privileged_with_their_own_identity_and_data(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    nodes = {n: s for n, s in services.items() if re.search(r"\bserver$", _runs(s))}
    ids, prefixes, nets, data = set(), set(), [], set()
    for name, s in nodes.items():
        env = {k: _expand(str(v)) for k, v in s["environment"].items()}
        assert s["privileged"] is True
        ids.add(env["AENV_NODE_ID"])
        prefixes.add(env["AENV_NET_PREFIX"])
        nets.append(ipaddress.ip_network(env["AENV_NET_CIDR"]))
        url = urlsplit(env["AENV_ADVERTISE_URL"])
        assert url.hostname == name and url.port == int(env["AENV_LISTEN"].rsplit(":", 1)[1])
        vols = dict(v.split(":", 1)[::-1] for v in s["volumes"])
        assert vols["/var/lib/aenv"] in compose["volumes"]
        data.add(vols["/var/lib/aenv"])
        assert vols["/dev"] == "/dev"
    assert len(ids) == len(prefixes) == len(data) == len(nodes)
    assert not any(a.overlaps(b) for i, a in enumerate(nets) for b in nets[i + 1 :])


def test_compose_settings_reach_redis_and_s3_where_used_and_are_read_by_the_code(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    for name, s in services.items():
        if "environment" not in s or name in ("redis", "s3"):
            continue
        env = {k: _expand(str(v)) for k, v in s["environment"].items()}
        assert set(env) <= KNOWN_ENV, name
        assert urlsplit(env["AENV_REDIS_URL"]).hostname == "redis"
        if name.startswith("gateway"):
            # A gateway never touches the repository: it gets none of its credentials.
            assert not {k for k in env if k.startswith(("AWS_", "AENV_S3_"))}, name
            continue
        assert urlsplit(env["AENV_S3_ENDPOINT"]).hostname == "s3"
        bucket = urlsplit(env["AENV_SNAPSHOT_REPO"]).hostname
        assert f"http://s3:5000/{bucket}'" in _runs(services["bucket"])
