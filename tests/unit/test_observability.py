"""Observability on the whole orchestrator over the fake runtime: sampled metrics per
sandbox (ranges, paused sandboxes, the bound), logs (node events and envd's journal, read
once each), node counters, the Prometheus exposition, the API routes in E2B's shapes, and
the sandbox id on log lines."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aenv.domain import CreateRequest
from aenv.errors import NotFound, RuntimeFailure
from aenv.logctx import JsonFormatter, SandboxIdFilter, TextFormatter, sandbox_context
from aenv.orchestrator import metrics as metrics_mod
from aenv.server import node_app
from tests.node_harness import Harness, started

API_KEY = "obs-test-key-0123456789"


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Harness]:
    async for h in started(tmp_path, api_key=API_KEY):
        yield h


async def sample_every_5s(h: Harness, n: int) -> None:
    for _ in range(n):
        h.clock.advance(5)
        await h.orch.sampler.round()


def address(h: Harness, sandbox_id: str) -> str:
    a = h.orch.table.get(sandbox_id).address
    assert a is not None
    return a


# ---------------------------------------------------------------------------- metrics
async def test_running_sandboxes_are_sampled_and_ranges_select(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest(memory_mb=512, cpu_count=2))
    t0 = node.clock.now
    await sample_every_5s(node, 4)  # at t0+5 .. t0+20
    series = node.orch.metrics.series(r.sandbox_id)
    assert [s.at for s in series] == [t0 + timedelta(seconds=5 * i) for i in range(1, 5)]
    assert all(s.cpu_count == 2 and s.mem_total == 512 * 2**20 for s in series)
    assert all(s.disk_total == r.disk_mb * 2**20 for s in series)
    mid = node.orch.metrics.series(
        r.sandbox_id, t0 + timedelta(seconds=10), t0 + timedelta(seconds=15)
    )
    assert [s.at for s in mid] == [t0 + timedelta(seconds=10), t0 + timedelta(seconds=15)]
    before = node.orch.metrics.series(
        r.sandbox_id, t0 - timedelta(hours=1), t0 - timedelta(minutes=30)
    )
    assert before == []


async def test_a_paused_sandbox_keeps_its_samples_and_gets_no_new_ones(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    await sample_every_5s(node, 2)
    await node.orch.pauser.pause(r.sandbox_id)
    await sample_every_5s(node, 3)
    assert len(node.orch.metrics.series(r.sandbox_id)) == 2
    await node.orch.pauser.connect(r.sandbox_id, timeout=60)
    await sample_every_5s(node, 1)
    assert len(node.orch.metrics.series(r.sandbox_id)) == 3


async def test_a_killed_sandbox_has_no_metrics(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    await sample_every_5s(node, 1)
    await node.orch.sandboxes.kill(r.sandbox_id)
    await sample_every_5s(node, 1)
    with pytest.raises(NotFound):
        node.orch.metrics.series(r.sandbox_id)
    assert node.orch.metrics.latest(r.sandbox_id) is None


async def test_the_ring_keeps_the_newest_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metrics_mod, "RING_SIZE", 3)
    async for h in started(tmp_path):
        r = await h.orch.sandboxes.create(CreateRequest())
        await sample_every_5s(h, 5)
        series = h.orch.metrics.series(r.sandbox_id)
        assert len(series) == 3
        assert series[-1].at == h.clock.now


# ---------------------------------------------------------------------------- logs
async def test_logs_hold_node_events_and_envd_journal_once(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    host = address(node, r.sandbox_id)
    node.envd.log(host, "process started", pid="7", cmd="/bin/bash")
    node.envd.log(host, "process ended", level="warn", pid="7", exitCode="1")
    await node.orch.sampler.round()
    first = await node.orch.logs.read(r.sandbox_id)  # pulls again: nothing new
    messages = [e.message for e in first]
    assert messages == ["sandbox created", "process started", "process ended"]
    assert first[2].level == "warn" and first[2].fields["exitCode"] == "1"
    assert first[0].fields["source"] == "node"
    node.envd.log(host, "process started", pid="8", cmd="ls")
    second = await node.orch.logs.read(r.sandbox_id)
    assert [e.message for e in second][3:] == ["process started"]
    assert second[3].fields["cmd"] == "ls"


async def test_logs_skip_what_envd_logged_before_the_sandbox_was_handed_out(
    node: Harness,
) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    host = address(node, r.sandbox_id)
    node.envd.log(host, "warm-up of the pool")
    node.envd.journal[host][-1]["ts"] = r.started_at.timestamp() - 60
    assert "warm-up of the pool" not in [e.message for e in await node.orch.logs.read(r.sandbox_id)]


async def test_logs_start_over_when_envd_counts_from_zero_again(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    host = address(node, r.sandbox_id)
    for i in range(3):
        node.envd.log(host, f"before {i}")
    await node.orch.logs.read(r.sandbox_id)
    node.envd.journal[host], node.envd.journal_seq[host] = [], 0  # a fresh envd
    node.envd.log(host, "after restart")
    got = [e.message for e in await node.orch.logs.read(r.sandbox_id)]
    assert got[-1] == "after restart" and got.count("before 0") == 1


async def test_lifecycle_operations_are_logged(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    await node.orch.pauser.pause(r.sandbox_id)
    await node.orch.pauser.connect(r.sandbox_id, timeout=60)
    got = [e.message for e in await node.orch.logs.read(r.sandbox_id)]
    assert got == ["sandbox created", "sandbox paused", "sandbox resumed"]


# ---------------------------------------------------------------------------- node + prometheus
async def test_node_counts_creates_allocation_and_states(node: Harness) -> None:
    a = await node.orch.sandboxes.create(CreateRequest(cpu_count=2, memory_mb=512))
    b = await node.orch.sandboxes.create(CreateRequest(cpu_count=1, memory_mb=256))
    await node.orch.pauser.pause(b.sandbox_id)
    node.envd.fail_inits = 1
    with pytest.raises(RuntimeFailure):
        await node.orch.sandboxes.create(CreateRequest())
    with pytest.raises(NotFound):  # the client's mistake, not a failed create
        await node.orch.sandboxes.create(CreateRequest(template_id="nope"))
    info = await node.orch.stats.info()
    assert (info.create_successes, info.create_fails) == (2, 1)
    assert info.counts["running"] == 1 and info.counts["paused"] == 1
    assert info.counts["paused_frozen"] == 1
    assert (info.allocated_cpu, info.allocated_memory_bytes) == (2, 512 * 2**20)
    assert (info.paused_cpu, info.paused_memory_bytes) == (1, 256 * 2**20)
    assert info.status == "ready" and info.memory_budget_bytes == 4096 * 2**20
    assert a.sandbox_id != b.sandbox_id


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fam: Any, sample: str, **labels: str) -> float:
    for s in fam.samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    raise AssertionError(f"no {sample} {labels}")


async def test_prometheus_exposition(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    await node.orch.pauser.pause(r.sandbox_id)
    with pytest.raises(NotFound):
        await node.orch.sandboxes.kill("missing")
    fams = families((await node.orch.stats.exposition()).decode())
    ops = fams["aenv_operation_duration_seconds"]
    assert value(ops, "aenv_operation_duration_seconds_count", op="create") == 1
    assert value(ops, "aenv_operation_duration_seconds_count", op="pause") == 1
    errors = fams["aenv_operation_errors"]
    assert value(errors, "aenv_operation_errors_total", op="kill", code="404") == 1
    states = fams["aenv_sandboxes"]
    assert value(states, "aenv_sandboxes", state="paused") == 1
    assert value(states, "aenv_sandboxes", state="running") == 0
    assert value(fams["aenv_cache_bytes"], "aenv_cache_bytes", cache="layers") > 0


# ---------------------------------------------------------------------------- API
@pytest.fixture
async def api(node: Harness) -> AsyncIterator[httpx.AsyncClient]:
    app = node_app(node.settings, node.orch)  # lifespan not run: the node is up
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://aenv", headers={"X-API-Key": API_KEY}
    ) as client:
        yield client


async def test_api_metrics_routes(node: Harness, api: httpx.AsyncClient) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    await sample_every_5s(node, 2)
    t = int(node.clock.now.timestamp())
    resp = await api.get(f"/sandboxes/{r.sandbox_id}/metrics", params={"start": t, "end": t})
    assert resp.status_code == 200
    (m,) = resp.json()
    assert m["timestampUnix"] == t and m["cpuCount"] == r.cpu_count
    assert set(m) >= {"timestamp", "cpuUsedPct", "memUsed", "memTotal", "diskUsed", "diskTotal"}
    assert len((await api.get(f"/sandboxes/{r.sandbox_id}/metrics")).json()) == 2
    many = await api.get("/sandboxes/metrics", params={"sandbox_ids": f"{r.sandbox_id},nope"})
    assert list(many.json()["sandboxes"]) == [r.sandbox_id]
    missing = await api.get("/sandboxes/nope/metrics")
    assert missing.status_code == 404 and missing.json()["code"] == 404
    bad = await api.get(f"/sandboxes/{r.sandbox_id}/metrics", params={"start": 10, "end": 5})
    assert bad.status_code == 400


async def test_api_logs_routes(node: Harness, api: httpx.AsyncClient) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    host = address(node, r.sandbox_id)
    node.envd.log(host, "process started", cmd="echo")
    node.envd.log(host, "internal error: boom", level="error")
    v1 = (await api.get(f"/sandboxes/{r.sandbox_id}/logs")).json()
    assert [e["message"] for e in v1["logEntries"]][1:] == [
        "process started",
        "internal error: boom",
    ]
    assert v1["logs"][1]["line"] == "process started cmd=echo"
    path = f"/v2/sandboxes/{r.sandbox_id}/logs"
    errors = (await api.get(path, params={"level": "error"})).json()["logs"]
    assert [e["message"] for e in errors] == ["internal error: boom"]
    found = (await api.get(path, params={"search": "started"})).json()["logs"]
    assert [e["message"] for e in found] == ["process started"]
    back = (await api.get(path, params={"direction": "backward", "limit": 1})).json()["logs"]
    assert [e["message"] for e in back] == ["internal error: boom"]
    assert (await api.get("/v2/sandboxes/nope/logs")).status_code == 404


async def test_api_nodes_and_prometheus(node: Harness, api: httpx.AsyncClient) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    (n,) = (await api.get("/nodes")).json()
    assert n["status"] == "ready" and n["sandboxCount"] == 1 and n["createSuccesses"] == 1
    assert n["metrics"]["allocatedMemoryBytes"] == r.memory_mb * 2**20
    assert n["metrics"]["cpuCount"] >= 1 and n["metrics"]["disks"]
    detail = (await api.get(f"/nodes/{n['nodeID']}")).json()
    assert [s["sandboxID"] for s in detail["sandboxes"]] == [r.sandbox_id]
    assert (await api.get("/nodes/other-node")).status_code == 404
    prom = await api.get("/metrics")
    assert prom.status_code == 200 and prom.headers["content-type"].startswith("text/plain")
    assert "aenv_operation_duration_seconds" in families(prom.text)
    assert (await api.get("/metrics", headers={"X-API-Key": ""})).status_code == 401
    bearer = await httpx.AsyncClient(transport=api._transport, base_url="http://aenv").get(
        "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert bearer.status_code == 200


# ---------------------------------------------------------------------------- log lines
def _logger(formatter: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(SandboxIdFilter())
    handler.setFormatter(formatter)
    logger = logging.getLogger(f"aenv.test.{id(out)}")
    logger.propagate = False
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return logger, out


def test_log_lines_carry_the_sandbox_id() -> None:
    logger, out = _logger(TextFormatter())
    with sandbox_context("sbx1"):
        logger.info("booted in %d ms", 12)
    logger.info("node line")
    first, second = out.getvalue().splitlines()
    assert first.endswith("booted in 12 ms sandbox_id=sbx1")
    assert "sandbox_id" not in second


def test_json_log_lines() -> None:
    logger, out = _logger(JsonFormatter())
    with sandbox_context("sbx2"):
        logger.warning("slow")
    line = json.loads(out.getvalue())
    assert line["sandbox_id"] == "sbx2" and line["level"] == "warning"
    assert line["message"] == "slow"


async def test_timer_lines_about_a_sandbox_carry_its_id(
    node: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    r = await node.orch.sandboxes.create(CreateRequest(timeout=10))
    caplog.handler.addFilter(SandboxIdFilter())
    node.clock.advance(11)
    with caplog.at_level(logging.INFO, logger="aenv"):
        await node.orch.node.tick()
    lines = [rec for rec in caplog.records if "timed out" in rec.getMessage()]
    assert lines and all(getattr(rec, "sandbox_id", None) == r.sandbox_id for rec in lines)
