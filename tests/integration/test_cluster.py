"""Many nodes: a real redis-server, a real S3 server, three real nodes on this host (their
network prefixes and ranges derived from their node ids) and two gateways, driven by the
stock E2B SDK through the gateways. The tests run in order on one cluster: sandboxes spread
and work through either gateway, listing pages across nodes, fork and snapshots, a gateway
killed with -9, Redis restarted empty, a node drained, a node killed."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox
from e2b.exceptions import SandboxException

from aenv.nodenet import node_network
from tests.helpers import wait_until

from .cluster_env import KEY, SECRETS, Cluster, node_ids, run_cluster
from .conftest import AENV
from .helpers import wait_port

pytestmark = pytest.mark.integration

# Node ids of this session (each derives its own net prefix and range from its id).
NODE_IDS = node_ids("cl", 3)


@pytest.fixture(scope="module")
def cluster(s3_endpoint: str) -> Iterator[Cluster]:
    with run_cluster(s3_endpoint, NODE_IDS, "cl") as c:
        yield c


def test_nodes_register_with_networks_of_their_own(cluster: Cluster) -> None:
    gw = cluster.gateways[0]
    assert cluster.node_status(gw) == dict.fromkeys(NODE_IDS, "ready")
    assert len({node_network(n) for n in NODE_IDS}) == len(NODE_IDS)


def _pty_roundtrip(s: Sandbox) -> str:
    from e2b.sandbox.commands.command_handle import PtySize

    out: list[bytes] = []
    got = threading.Event()

    def on_pty(b: bytes) -> None:
        out.append(b)
        if b"pty-42" in b"".join(out):
            got.set()

    h = s.pty.create(PtySize(rows=24, cols=80))
    waiter = threading.Thread(target=lambda: h.wait(on_pty=on_pty), daemon=True)
    waiter.start()
    s.pty.send_stdin(h.pid, b"echo pty-$((40+2)); exit\n")
    assert got.wait(20), b"".join(out)
    waiter.join(15)
    return b"".join(out).decode(errors="replace")


def test_sandboxes_spread_and_work_through_either_gateway(cluster: Cluster) -> None:
    a, b = cluster.gateways
    made = [cluster.create(a, metadata={"suite": "cluster"}) for _ in range(6)]
    where = {s.sandbox_id: cluster.node_of(s.sandbox_id) for s in made}
    assert set(where.values()) == set(NODE_IDS), where
    per_node = {n["nodeID"]: n["sandboxCount"] for n in a.get("/nodes").json()}
    wait_until(
        lambda: (
            {n["nodeID"]: n["sandboxCount"] for n in a.get("/nodes").json()}
            == {nid: list(where.values()).count(nid) for nid in NODE_IDS}
        ),
        15,
        0.3,
        f"heartbeats to count the sandboxes per node ({per_node})",
    )
    for s in made[:3]:
        other = Sandbox.connect(s.sandbox_id, **b.sdk())
        other.files.write("/home/user/via-b.txt", f"written through b to {s.sandbox_id}")
        assert s.files.read("/home/user/via-b.txt") == f"written through b to {s.sandbox_id}"
        assert other.commands.run("hostname && echo ok").stdout.strip().endswith("ok")
        assert "pty-42" in _pty_roundtrip(other)
    # a user port, through each gateway, by Host name and by header
    s = made[0]
    s.commands.run("mkdir -p /tmp/www && echo served > /tmp/www/index.html")
    s.commands.run("cd /tmp/www && exec python3 -m http.server 8080", background=True)
    wait_port(s, 8080)
    for gw in (a, b):
        r = httpx.get(
            f"{gw.url}/index.html", headers={"Host": f"8080-{s.sandbox_id}.localhost"}, timeout=30
        )
        assert r.status_code == 200 and r.text.strip() == "served"
        r = httpx.get(
            f"{gw.url}/index.html",
            headers={"E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": "8080"},
            timeout=30,
        )
        assert r.text.strip() == "served"
    # a command's output streams through (not buffered until it ends)
    seen: list[float] = []
    s.commands.run(
        "for i in 1 2 3; do echo tick; sleep 1; done",
        on_stdout=lambda _line: seen.append(time.monotonic()),
        timeout=30,
    )
    assert len(seen) == 3 and seen[-1] - seen[0] > 1.5


def test_listing_pages_across_nodes(cluster: Cluster) -> None:
    gw = cluster.gateways[1]
    mine = set(cluster.made)
    listed: list[str] = []
    token: str | None = None
    for _ in range(20):
        params = {"limit": "2", "metadata": "suite=cluster"}
        if token:
            params["nextToken"] = token
        r = gw.get("/v2/sandboxes", **params)
        assert r.status_code == 200, r.text
        assert len(r.json()) <= 2
        listed += [x["sandboxID"] for x in r.json()]
        token = r.headers.get("x-next-token")
        if not token:
            break
    assert sorted(listed) == sorted(mine) and len(listed) == len(set(listed))
    # the SDK's own paginator agrees
    paginator = Sandbox.list(**gw.sdk(), limit=4)
    via_sdk: list[str] = []
    while paginator.has_next:
        via_sdk += [x.sandbox_id for x in paginator.next_items()]
    assert mine <= set(via_sdk)


def test_fork_and_snapshot_through_a_gateway(cluster: Cluster) -> None:
    a, b = cluster.gateways
    parent = cluster.create(a)
    parent.files.write("/home/user/p.txt", "from the parent")
    parent.commands.run("sleep 4242", background=True)
    home = cluster.node_of(parent.sandbox_id)
    kids = parent.fork(count=2)
    for k in kids:
        assert isinstance(k, Sandbox), k
        cluster.made.append(k.sandbox_id)
        assert cluster.node_of(k.sandbox_id) == home  # fork runs on the parent's node
        child = Sandbox.connect(k.sandbox_id, **b.sdk())
        assert child.files.read("/home/user/p.txt") == "from the parent"
        assert "sleep 4242" in child.commands.run("ps aux").stdout
    name = f"clsnap-{uuid.uuid4().hex[:6]}"
    snap = parent.create_snapshot(name=name)
    listed = [x["snapshotID"] for x in b.get("/snapshots").json()]
    assert snap.snapshot_id in listed
    from_snap = Sandbox.create(template=name, timeout=300, **b.sdk())
    cluster.made.append(from_snap.sandbox_id)
    assert from_snap.files.read("/home/user/p.txt") == "from the parent"


@pytest.mark.timeout(900)
def test_a_template_built_through_a_gateway_serves_every_node(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The build runs on one node (its status, logs and file upload follow it); the template
    is published to the repository and creates on the other nodes find it there."""
    from e2b import Template

    a, b = cluster.gateways
    (tmp_path / "greeting.txt").write_text("built on one node\n")
    name = f"cltpl-{uuid.uuid4().hex[:6]}"
    logs: list[str] = []
    template = (
        Template(file_context_path=str(tmp_path))
        .from_template("base")
        .copy("greeting.txt", "/opt/greeting.txt")
        .run_cmd("echo ran > /home/user/ran.txt")
    )
    Template.build(
        template,
        name,
        cpu_count=1,
        memory_mb=256,
        on_build_logs=lambda e: logs.append(e.message),
        api_key=KEY,
        api_url=a.url,
    )
    assert logs
    first = Sandbox.create(template=name, timeout=120, **b.sdk())
    cluster.made.append(first.sandbox_id)
    assert first.files.read("/opt/greeting.txt") == "built on one node\n"
    builder = cluster.node_of(first.sandbox_id)  # the scheduler prefers the node with its layers
    for nid, srv in cluster.nodes.items():
        if nid == builder:
            continue
        direct: dict[str, Any] = {"api_key": KEY, "api_url": srv.url, "sandbox_url": srv.url}

        def create_there(direct: dict[str, Any] = direct) -> Sandbox | None:
            # Another node finds the template once its builder has published it.
            try:
                return Sandbox.create(template=name, timeout=120, **direct)
            except SandboxException as e:
                if "not found" not in str(e):
                    raise
                return None

        s = wait_until(create_there, 120, 1.0, f"{name} to be usable on node {nid}")
        assert s is not None
        cluster.made.append(s.sandbox_id)
        assert s.files.read("/opt/greeting.txt") == "built on one node\n"
        assert s.commands.run("cat /home/user/ran.txt").stdout.strip() == "ran"


def test_a_gateway_killed_and_restarted_routes_every_sandbox(cluster: Cluster) -> None:
    a = cluster.gateways[0]
    a.stop(signal.SIGKILL)
    a.start()
    for sid in cluster.made:
        s = Sandbox.connect(sid, **a.sdk())
        assert s.commands.run("echo alive").stdout.strip() == "alive"


def test_redis_restarted_empty_loses_no_binding(cluster: Cluster) -> None:
    import redis as redis_client

    r = redis_client.Redis.from_url(cluster.redis.url, decode_responses=True)
    before = r.hgetall("aenv:bindings")
    assert set(cluster.made) <= set(before)
    cluster.redis.stop()
    cluster.redis.start()
    r = redis_client.Redis.from_url(cluster.redis.url, decode_responses=True)

    def rebuilt() -> bool:
        got = r.hgetall("aenv:bindings")
        return all(got.get(sid) == before[sid] for sid in cluster.made)

    wait_until(rebuilt, 20, 0.2, "the nodes to write their bindings again")
    b = cluster.gateways[1]
    for sid in cluster.made[:4]:
        assert Sandbox.connect(sid, **b.sdk()).commands.run("echo ok").stdout.strip() == "ok"
    wait_until(
        lambda: cluster.node_status(b) == dict.fromkeys(NODE_IDS, "ready"),
        20,
        0.3,
        "every node registered again",
    )


def _wait_movable(cluster: Cluster, node_id: str, sandbox_id: str) -> None:
    import redis as redis_client

    r = redis_client.Redis.from_url(cluster.redis.url, decode_responses=True)

    def published() -> bool:
        doc = r.hget(f"aenv:roster:{node_id}", sandbox_id)
        return bool(doc) and '"image":"hib-' in str(doc)

    wait_until(published, 90, 0.3, f"{sandbox_id} to be hibernated into the repository")


def test_drain_moves_sandboxes_on_resume(cluster: Cluster) -> None:
    a = cluster.gateways[0]
    s = cluster.create(a)
    s.files.write("/home/user/d.txt", "drained")
    s.commands.run("sleep 5151", background=True)
    source = cluster.node_of(s.sandbox_id)
    out = subprocess.run(
        [AENV, "--url", a.url, "--api-key", KEY, "node", "drain", source],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert f"node {source} is draining" in out.stdout
    assert cluster.node_status(a)[source] == "draining"
    back = Sandbox.connect(s.sandbox_id, **a.sdk())
    assert cluster.node_of(s.sandbox_id) != source
    assert back.files.read("/home/user/d.txt") == "drained"
    assert "sleep 5151" in back.commands.run("ps aux").stdout
    # no new sandbox goes to the draining node
    fresh = cluster.create(a)
    assert cluster.node_of(fresh.sandbox_id) != source
    subprocess.run(
        [AENV, "--url", a.url, "--api-key", KEY, "node", "undrain", source],
        check=True,
        capture_output=True,
        timeout=60,
    )
    wait_until(lambda: cluster.node_status(a)[source] == "ready", 10, 0.2, "undrained")


def test_a_stopped_node_hands_its_running_sandboxes_over(cluster: Cluster) -> None:
    """SIGTERM (a pod deleted, `docker stop`): the node first puts its sandboxes into the
    repository; one that was running stays running to its user, and its next command
    through a gateway, with no resume of the SDK's, runs on another node. The command's
    output stream, still open, does not hold the stop up (it would never end)."""
    a = cluster.gateways[0]
    s = cluster.create(a)
    s.files.write("/home/user/stop.txt", "outlived its node")
    handle = s.commands.run("sleep 7171", background=True)
    source = cluster.node_of(s.sandbox_id)
    srv = cluster.nodes[source]
    assert srv.proc is not None and srv.log_path is not None
    srv.proc.send_signal(signal.SIGTERM)
    try:
        assert srv.proc.wait(240) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
    except subprocess.TimeoutExpired:
        tail = srv.log_path.read_text(errors="replace")[-3000:]
        raise AssertionError(f"the node did not stop; its log ends:\n{tail}") from None
    srv.proc = None
    handle.disconnect()
    log = srv.log_path.read_text(errors="replace")
    assert f"node {source} drained at stop" in log and "stays on node" not in log
    out = s.commands.run("cat /home/user/stop.txt; ps aux")
    assert "outlived its node" in out.stdout and "sleep 7171" in out.stdout
    assert cluster.node_of(s.sandbox_id) != source
    assert Sandbox.get_info(s.sandbox_id, **a.sdk()).state.value == "running"
    srv.start()  # back under its id: it gives up what moved while it was away
    wait_until(lambda: cluster.node_status(a)[source] == "ready", 30, 0.3, "the node back")
    assert cluster.node_of(s.sandbox_id) != source


def test_a_killed_node_is_unhealthy_and_its_hibernated_sandboxes_move(cluster: Cluster) -> None:
    a, b = cluster.gateways
    # the first node to get two new sandboxes is the victim: one is hibernated there, one
    # left running
    by_node: dict[str, list[Sandbox]] = {}
    for _ in range(12):
        s = cluster.create(a)
        by_node.setdefault(cluster.node_of(s.sandbox_id), []).append(s)
        if max(len(v) for v in by_node.values()) == 2:
            break
    victim_id, on_victim = max(by_node.items(), key=lambda kv: len(kv[1]))
    assert len(on_victim) == 2, by_node
    victim = cluster.nodes[victim_id]
    sleeper, runner = on_victim
    sleeper.files.write("/home/user/moved.txt", "survived its node")
    sleeper.commands.run("sleep 6161", background=True)
    assert sleeper.pause()
    _wait_movable(cluster, victim_id, sleeper.sandbox_id)
    assert victim.proc is not None
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    victim.proc = None
    lost_at = time.monotonic()
    wait_until(
        lambda: cluster.node_status(b)[victim_id] == "unhealthy", 10, 0.2, "the node unhealthy"
    )
    assert time.monotonic() - lost_at < 10
    # its running sandbox: a clear answer at once, not a hang (the client gives up at 5 s)
    r = httpx.get(
        f"{b.url}/health",
        headers={"E2b-Sandbox-Id": runner.sandbox_id, "E2b-Sandbox-Port": "49983"},
        timeout=5,
    )
    assert r.status_code == 502 and "unreachable" in r.json()["message"], r.text
    # the hibernated one resumes on another node, under the same id
    moved = Sandbox.connect(sleeper.sandbox_id, **b.sdk())
    assert cluster.node_of(sleeper.sandbox_id) != victim_id
    assert moved.files.read("/home/user/moved.txt") == "survived its node"
    assert "sleep 6161" in moved.commands.run("ps aux").stdout
    if victim.proc is None:  # the fixture's cleanup kills its sandboxes through the API
        victim.start()


def test_a_secret_made_through_one_node_serves_every_node(cluster: Cluster) -> None:
    """`/secrets` through a gateway lands on one node; every node knows it at once (its
    metadata, a create whose rules name it), a change made through another node too, and
    a delete removes it everywhere. The value is never answered."""
    gw = cluster.gateways[0]
    h = {"X-API-Key": KEY}
    value = SECRETS["user secret"]
    r = httpx.post(f"{gw.url}/secrets", json={"name": "CL_TOKEN", "value": value}, headers=h)
    assert r.status_code == 201, r.text
    sid = r.json()["secretID"]
    live = [srv for srv in cluster.nodes.values() if srv.proc is not None]
    assert len(live) >= 2
    for srv in live:
        got = httpx.get(f"{srv.url}/secrets/{sid}", headers=h)
        assert got.status_code == 200, (srv.url, got.text)
        assert got.json()["currentVersion"] == 1 and value not in got.text
    r = httpx.post(f"{live[1].url}/secrets/cl_token", json={"value": value + "2"}, headers=h)
    assert r.status_code == 200 and r.json()["currentVersion"] == 2
    assert httpx.get(f"{live[0].url}/secrets/{sid}", headers=h).json()["currentVersion"] == 2
    rules = {"api.cluster.test": [{"transform": {"headers": {"X-T": "${e2b.secrets.CL_TOKEN}"}}}]}
    for srv in live:
        made = httpx.post(
            f"{srv.url}/v2/sandboxes",
            json={"templateID": "base", "timeout": 120, "network": {"rules": rules}},
            headers=h,
            timeout=120,
        )
        assert made.status_code == 201, (srv.url, made.text)
        cluster.made.append(made.json()["sandboxID"])
        httpx.delete(f"{srv.url}/sandboxes/{made.json()['sandboxID']}", headers=h, timeout=60)
    assert httpx.delete(f"{gw.url}/secrets/{sid}", headers=h).status_code == 204
    for srv in live:
        assert httpx.get(f"{srv.url}/secrets/{sid}", headers=h).status_code == 404


def test_no_secret_reaches_a_log(cluster: Cluster) -> None:
    """After everything above (Redis restarted under the nodes and gateways, a node killed),
    no node's or gateway's log holds Redis' password, the S3 secret or the API key."""
    logs = [srv.log_path for srv in cluster.nodes.values() if srv.log_path is not None]
    logs += [gw.log_path for gw in cluster.gateways]
    assert len(logs) == len(NODE_IDS) + len(cluster.gateways)
    text = "\n".join(p.read_text(errors="replace") for p in logs if p.exists())
    assert "heartbeat" in text or "gateway serving" in text  # the logs are the ones written
    for name, secret in {**SECRETS, "api key": KEY}.items():
        assert secret not in text, f"the {name} is in a log"
