"""Observability on a real node with the stock E2B SDK: sandbox metrics over time (CPU, a
file written shows on the disk), logs of commands run through envd, the node view and the
Prometheus exposition, and the server's log lines about a sandbox carrying its id."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
import pytest
from e2b import CommandExitException, Sandbox
from e2b.sandbox.sandbox_api import SandboxMetrics
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import Server

pytestmark = pytest.mark.integration

T = TypeVar("T")
MIB = 2**20


def wait_for(what: Callable[[], T], ok: Callable[[T], bool], seconds: float = 40) -> T:
    deadline = time.monotonic() + seconds
    while True:
        got = what()
        if ok(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


@pytest.fixture(scope="module")
def sbx(e2b_env: Server) -> Any:
    s = Sandbox.create(template="base", timeout=300)
    yield s
    s.kill()


def test_sdk_get_metrics_over_time(sbx: Sandbox, e2b_env: Server) -> None:
    created = datetime.datetime.now(datetime.UTC)
    # Busy for longer than two sampling intervals, so one interval is all busy; and 64 MiB
    # written to the sandbox's disk.
    sbx.commands.run("timeout 12 sh -c 'while :; do :; done'", background=True)
    sbx.commands.run("head -c 67108864 /dev/urandom > /home/user/blob && sync")
    first: list[SandboxMetrics] = wait_for(sbx.get_metrics, lambda m: len(m) > 0)
    assert first, "no metrics within 40 s"
    m = first[0]
    assert m.cpu_count == 2 and m.mem_total == 512 * MIB
    assert 0 < m.mem_used < m.mem_total
    assert 0 < m.disk_total <= 2048 * MIB  # AENV_DEFAULT_DISK_MB of the test server
    blob_seen = wait_for(
        sbx.get_metrics, lambda ms: any(x.disk_used >= 60 * MIB for x in ms), seconds=30
    )
    assert any(x.disk_used >= 60 * MIB for x in blob_seen)
    busy = wait_for(sbx.get_metrics, lambda ms: any(x.cpu_used_pct > 10 for x in ms), seconds=30)
    assert max(x.cpu_used_pct for x in busy) > 10
    # Ranges: all inside the range asked for; none before the sandbox existed.
    now = datetime.datetime.now(datetime.UTC)
    ranged = sbx.get_metrics(start=created - datetime.timedelta(seconds=30), end=now)
    assert ranged and all(
        created.timestamp() - 40 <= x.timestamp.timestamp() <= now.timestamp() + 1 for x in ranged
    )
    hour_ago = created - datetime.timedelta(hours=1)
    assert sbx.get_metrics(start=hour_ago, end=hour_ago + datetime.timedelta(minutes=30)) == []
    with e2b_env.client() as c:
        many = c.get("/sandboxes/metrics", params={"sandbox_ids": sbx.sandbox_id}).json()
    assert many["sandboxes"][sbx.sandbox_id]["cpuCount"] == 2


def test_logs_of_commands_run_through_envd(sbx: Sandbox, e2b_env: Server) -> None:
    with pytest.raises(CommandExitException):
        sbx.commands.run("echo observability-marker; exit 3")
    with e2b_env.client() as c:
        v2 = c.get(f"/v2/sandboxes/{sbx.sandbox_id}/logs").json()["logs"]
        v1 = c.get(f"/sandboxes/{sbx.sandbox_id}/logs").json()
        errors = c.get(f"/v2/sandboxes/{sbx.sandbox_id}/logs", params={"level": "warn"}).json()[
            "logs"
        ]
    started = [
        e
        for e in v2
        if e["message"] == "process started" and "observability-marker" in e["fields"]["args"]
    ]
    assert len(started) == 1
    pid = started[0]["fields"]["pid"]
    ended = [e for e in v2 if e["message"] == "process ended" and e["fields"]["pid"] == pid]
    assert ended[0]["fields"]["exitCode"] == "3" and ended[0]["level"] == "warn"
    assert ended[0] in errors
    assert {"message": "sandbox created", "source": "node"} in [
        {"message": e["message"], "source": e["fields"].get("source")} for e in v2
    ]
    assert len(v1["logs"]) == len(v1["logEntries"]) == len(v2)
    assert any("observability-marker" in line["line"] for line in v1["logs"])


def test_node_view_and_prometheus(sbx: Sandbox, e2b_env: Server) -> None:
    with e2b_env.client() as c:
        (node,) = c.get("/nodes").json()
        detail = c.get(f"/nodes/{node['nodeID']}").json()
        prom = c.get("/metrics")
    assert node["status"] == "ready" and node["sandboxCount"] >= 1
    assert node["createSuccesses"] >= 1
    m = node["metrics"]
    assert m["allocatedCPU"] >= 2 and m["allocatedMemoryBytes"] >= 512 * MIB
    assert m["memoryTotalBytes"] > m["memoryUsedBytes"] > 0 and m["cpuCount"] >= 1
    assert m["disks"][0]["totalBytes"] > m["disks"][0]["usedBytes"] > 0
    assert node["machineInfo"]["cpuArchitecture"]
    assert node["runtime"]["backend"] == "gvisor"
    assert sbx.sandbox_id in [s["sandboxID"] for s in detail["sandboxes"]]
    assert prom.status_code == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(prom.text)
        for s in fam.samples
    }
    assert samples[("aenv_operation_duration_seconds_count", (("op", "create"),))] >= 1
    assert samples[("aenv_sandboxes", (("state", "running"),))] >= 1
    assert samples[("aenv_cache_bytes", (("cache", "layers"),))] > 0
    unauthenticated = httpx.get(f"{e2b_env.url}/metrics")
    assert unauthenticated.status_code == 401
    bearer = httpx.get(
        f"{e2b_env.url}/metrics", headers={"Authorization": f"Bearer {e2b_env.api_key}"}
    )
    assert bearer.status_code == 200
    # envd's own /metrics stays out of reach on the data plane.
    envd = httpx.get(f"{e2b_env.url}/metrics", headers={"E2b-Sandbox-Id": sbx.sandbox_id})
    assert envd.status_code == 403


def test_a_paused_sandbox_keeps_its_metrics_and_logs(
    sandboxes: list[object], e2b_env: Server
) -> None:
    s = Sandbox.create(template="base", timeout=120)
    sandboxes.append(s)
    s.commands.run("echo before-pause")
    recorded = wait_for(s.get_metrics, lambda m: len(m) > 0)
    assert recorded
    with e2b_env.client() as c:
        path = f"/v2/sandboxes/{s.sandbox_id}/logs"
        before = c.get(path, params={"search": "process"}).json()["logs"]
        s.pause()
        assert len(Sandbox.get_metrics(s.sandbox_id)) >= len(recorded)
        logs = c.get(path).json()["logs"]
    assert any("before-pause" in e["fields"].get("args", "") for e in before)
    assert [e for e in logs if e["message"].startswith("process")] == before
    assert "sandbox paused" in [e["message"] for e in logs]


def test_server_log_lines_carry_the_sandbox_id(e2b_env: Server) -> None:
    s = Sandbox.create(template="base", timeout=60)
    s.kill()
    assert e2b_env.log_path is not None
    text = e2b_env.log_path.read_text(errors="replace")
    assert f"sandbox_id={s.sandbox_id}" in text
