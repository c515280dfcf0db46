"""Load test of the cluster's routing path: a real redis-server, one real node with one real
sandbox, one gateway, all on this machine. A raw keep-alive HTTP/1.1 client sends small
requests straight to the node and through the gateway, and the difference is what the
gateway adds:

    data     envd's `GET /health` in the sandbox (E2b-Sandbox-Id header): the data plane
    control  `GET /sandboxes/{id}`: a control-plane request routed by the sandbox's binding

Sequential requests give latency (p50/p90/p99); several connections in parallel give
requests per second. Results go to stdout and bench/results/gateway-latest.json.

    .venv/bin/python -m bench.gateway_load [--requests 2000] [--concurrency 16] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from .server import AENV, BenchServer, _term_with_parent, build_base, free_port, remove_home

RESULTS = Path(__file__).resolve().parent / "results"
KEY = "e2b_" + "be" * 20


class Raw:
    """One keep-alive connection sending the same request again and again."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def send(self, request: bytes) -> None:
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = head[9:12]
        if status not in (b"200", b"204"):
            raise RuntimeError(head.decode("latin-1"))
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        if length:
            await self.reader.readexactly(length)


async def _connect(port: int) -> Raw:
    return Raw(*await asyncio.open_connection("127.0.0.1", port))


async def latency(port: int, request: bytes, n: int) -> list[float]:
    c = await _connect(port)
    for _ in range(min(200, n)):
        await c.send(request)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await c.send(request)
        out.append(time.perf_counter() - t0)
    c.writer.close()
    return out


async def throughput(port: int, request: bytes, concurrency: int, seconds: float) -> float:
    clients = [await _connect(port) for _ in range(concurrency)]
    done = 0
    stop = time.perf_counter() + seconds

    async def loop(c: Raw) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await c.send(request)
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(loop(c) for c in clients))
    rate = done / (time.perf_counter() - t0)
    for c in clients:
        c.writer.close()
    return rate


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def heartbeat_capacity(url: str, pid: int, roster_size: int, beats: int) -> dict[str, float]:
    """How many node heartbeats (registration + a roster of `roster_size` sandboxes) one
    Redis takes per second of its own CPU."""
    from aenv.cluster.records import NodeRecord, RosterEntry
    from aenv.cluster.state import ClusterState

    st = ClusterState(url, namespace="bench")
    roster = {
        f"i{n:019d}": RosterEntry(state="running", template_id="base", started_at="2026-01-01")
        for n in range(roster_size)
    }
    nodes = [NodeRecord(node_id=f"n{i}", url=f"http://10.0.0.{i}:8000") for i in range(50)]
    prev: dict[str, set[str] | None] = {n.node_id: None for n in nodes}
    try:
        for n in nodes:  # registered once, as after their first heartbeat
            prev[n.node_id] = await st.heartbeat(n, roster, None)
        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        for i in range(beats):
            n = nodes[i % len(nodes)]
            prev[n.node_id] = await st.heartbeat(n, roster, prev[n.node_id])
        wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    finally:
        await st.close()
    return {
        "roster_size": roster_size,
        "beats_per_s": beats / wall,
        "redis_cpu_ms_per_beat": cpu / beats * 1e3,
        "beats_per_redis_core_s": beats / cpu if cpu > 0 else float("inf"),
    }


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e3


def spawn_gateway(env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [AENV, "gateway"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_term_with_parent,
        )


def requests_for(sandbox_id: str) -> dict[str, bytes]:
    data = (
        b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\ne2b-sandbox-id: %b\r\n"
        b"e2b-sandbox-port: 49983\r\n\r\n" % sandbox_id.encode()
    )
    control = b"GET /sandboxes/%b HTTP/1.1\r\nhost: 127.0.0.1\r\nx-api-key: %b\r\n\r\n" % (
        sandbox_id.encode(),
        KEY.encode(),
    )
    return {"data": data, "control": control}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from tests.helpers import RedisServer

    work = Path(tempfile.mkdtemp(prefix="aenv-bench-gw-"))
    redis = RedisServer(work / "redis")
    node: BenchServer | None = None
    gateway: subprocess.Popen[bytes] | None = None
    try:
        redis.start()
        home = work / "node"
        home.mkdir()
        await asyncio.to_thread(build_base, home)
        cluster = {"AENV_REDIS_URL": redis.url, "AENV_HEARTBEAT_SECONDS": "1"}
        node = BenchServer(home, KEY, name="node", extra_env=cluster)
        await node.start()
        gw_port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("AENV_")}
        env.update(cluster, AENV_API_KEY=KEY, AENV_LISTEN=f"127.0.0.1:{gw_port}")
        gateway = spawn_gateway(env, work / "gateway.log")
        gw_url = f"http://127.0.0.1:{gw_port}"
        async with httpx.AsyncClient(headers={"X-API-Key": KEY}, timeout=120) as http:
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if len((await http.get(f"{gw_url}/nodes")).json()) == 1:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("the gateway never saw the node")
                await asyncio.sleep(0.2)
            r = await http.post(f"{gw_url}/sandboxes", json={"templateID": "base", "timeout": 600})
            r.raise_for_status()
            sandbox_id = r.json()["sandboxID"]
        reqs = requests_for(sandbox_id)
        ports = {"node": node.port, "gateway": gw_port}
        out: dict[str, Any] = {"requests": args.requests, "concurrency": args.concurrency}
        for kind, request in reqs.items():
            row: dict[str, Any] = {}
            for path, port in ports.items():
                samples = await latency(port, request, args.requests)
                cpu0 = cpu_seconds(gateway.pid)
                t0 = time.perf_counter()
                rate = await throughput(port, request, args.concurrency, args.seconds)
                done = rate * (time.perf_counter() - t0)
                row[path] = {
                    "p50_ms": statistics.median(samples) * 1e3,
                    "p90_ms": pct(samples, 0.9),
                    "p99_ms": pct(samples, 0.99),
                    "rps": rate,
                }
                if path == "gateway":
                    per = (cpu_seconds(gateway.pid) - cpu0) / max(done, 1)
                    row[path]["gateway_cpu_us_per_request"] = per * 1e6
                    row[path]["rps_per_gateway_core"] = 1 / per if per > 0 else 0.0
            row["added_p50_ms"] = row["gateway"]["p50_ms"] - row["node"]["p50_ms"]
            out[kind] = row
        assert redis.proc is not None
        out["heartbeats"] = await heartbeat_capacity(redis.url, redis.proc.pid, 100, 2000)
        return out
    finally:
        if gateway is not None and gateway.poll() is None:
            gateway.terminate()
            gateway.wait(15)
        if node is not None:
            await node.stop()
        redis.stop()
        remove_home(work)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seconds", type=float, default=5.0)
    args = p.parse_args()
    out = asyncio.run(run(args))
    out["machine"] = {"cpus": os.cpu_count()}
    out["at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gateway-latest.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"{'request':<9}{'path':<9}{'p50 ms':>8}{'p90 ms':>8}{'p99 ms':>8}{'req/s':>9}")
    for kind in ("data", "control"):
        for path in ("node", "gateway"):
            r = out[kind][path]
            print(
                f"{kind:<9}{path:<9}{r['p50_ms']:>8.2f}{r['p90_ms']:>8.2f}"
                f"{r['p99_ms']:>8.2f}{r['rps']:>9.0f}"
            )
        print(f"{'':<9}{'added':<9}{out[kind]['added_p50_ms']:>8.2f}")
        g = out[kind]["gateway"]
        print(
            f"{'':<9}gateway CPU {g['gateway_cpu_us_per_request']:.0f} us/request = "
            f"{g['rps_per_gateway_core']:.0f} req/s per gateway core"
        )
    hb = out["heartbeats"]
    print(
        f"heartbeats ({hb['roster_size']} sandboxes each): {hb['beats_per_s']:.0f}/s from one "
        f"client, Redis CPU {hb['redis_cpu_ms_per_beat']:.2f} ms each = "
        f"{hb['beats_per_redis_core_s']:.0f} per Redis core-second"
    )


if __name__ == "__main__":
    main()
