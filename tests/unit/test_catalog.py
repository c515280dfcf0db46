"""The catalog round-trips the typed records and reads rows an earlier version wrote."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from aenv.domain import (
    BootInfo,
    BuildInfo,
    EgressPolicy,
    Instance,
    PausedState,
    PauseTier,
    SandboxRecord,
    SandboxState,
    TemplateKind,
    TemplateRecord,
)
from aenv.orchestrator.catalog import Catalog

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def record(**kw: object) -> SandboxRecord:
    values: dict[str, object] = {
        "sandbox_id": "isbx",
        "template_id": "base",
        "alias": "base",
        "client_id": "aenv",
        "started_at": T0,
        "end_at": T0 + timedelta(seconds=300),
        "cpu_count": 2,
        "memory_mb": 512,
        "disk_mb": 1024,
        "state": SandboxState.RUNNING,
        "envd_version": "0.1",
        "envd_access_token": "tok",
        **kw,
    }
    return SandboxRecord(**values)  # type: ignore[arg-type]


def test_sandbox_round_trip(tmp_path: Path) -> None:
    c = Catalog(tmp_path / "catalog.db")
    r = record(
        state=SandboxState.PAUSED,
        instance=Instance("isbx", "isbx-1", "10.200.0.2", {"slot": 3}),
        paused=PausedState(PauseTier.HIBERNATED, T0, image="hib-isbx-1"),
        boot=BootInfo(env={"A": "1"}, user="user", workdir="/w", from_layers=["sha256:a"]),
        layers=["sha256:b", "sha256:a"],
        egress=EgressPolicy(allow_internet=False, allow_out=["203.0.113.0/24"]),
        traffic_access_token="tt",
        mask_request_host="localhost:${PORT}",
    )
    c.put_sandbox(r)
    assert c.sandboxes() == [r]


def test_rows_of_an_earlier_version_load(tmp_path: Path) -> None:
    c = Catalog(tmp_path / "catalog.db")
    doc = json.loads(json.dumps({**record().__dict__}, default=str))
    for key in ("paused", "instance", "egress", "traffic_access_token", "mask_request_host"):
        doc.pop(key)
    doc["allow_internet_access"] = False
    doc["state"] = "paused"
    doc["boot"] = {"env": {}, "user": None, "workdir": None, "from_layers": []}
    doc["paused_state"] = {"tier": "frozen", "paused_at": T0.isoformat()}
    doc["instance"] = {
        "sandbox_id": "isbx",
        "container_id": "isbx-7",
        "address": "10.200.0.6",
        "slot": 1,
        "bundle_dir": "/x",
        "extra": {},
    }
    c._run(
        "INSERT INTO sandboxes(id, state, doc) VALUES(?,?,?)", ("isbx", "paused", json.dumps(doc))
    )
    (r,) = c.sandboxes()
    assert r.instance is not None and (r.instance.id, r.instance.address) == (
        "isbx-7",
        "10.200.0.6",
    )
    assert r.tier is PauseTier.FROZEN and r.paused is not None and r.paused.paused_at == T0
    assert r.egress == EgressPolicy(allow_internet=False)


def test_templates_keep_names_and_builder_keys(tmp_path: Path) -> None:
    c = Catalog(tmp_path / "catalog.db")
    t = TemplateRecord(
        template_id="t1",
        kind=TemplateKind.TEMPLATE,
        layers=["sha256:a"],
        names=["web", "web:v2"],
        cpu_count=4,
        build=BuildInfo(build_id="b1", start_cmd="serve"),
    )
    c.put_template(t)
    assert c.template("web:v2") == t
    assert c.template("t1") == t
    assert c.templates() == [t]
    assert c.delete_template("t1") and c.template("web") is None
