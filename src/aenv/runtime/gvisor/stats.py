"""A container's CPU and memory use, from its cgroup (v1 or v2) or, failing that, from
`runsc events --stats`; its host RSS from /proc."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from aenv.errors import RuntimeFailure
from aenv.runtime.base import Stats
from aenv.runtime.freezer import CGROUP_ROOT
from aenv.runtime.gvisor.container import Container
from aenv.runtime.gvisor.runsc import Runsc, is_missing


class StatsReader:
    def __init__(self, runsc: Runsc) -> None:
        self.runsc = runsc
        # Per container: the last (monotonic time, cpu ns) sample, so each `stats` reports
        # the CPU use since the one before.
        self._samples: dict[str, tuple[float, int]] = {}

    def baseline(self, c: Container) -> None:
        """Takes a first sample now (a new container): its first `stats` covers from here."""
        sample = read_cgroup(c.cgroup)
        if sample is not None:
            self._samples[c.id] = (time.monotonic(), sample[0])

    def forget(self, cid: str) -> None:
        self._samples.pop(cid, None)

    async def stats(self, c: Container) -> Stats:
        sample = await asyncio.to_thread(read_cgroup, c.cgroup)
        if sample is None:
            sample = await self._read_events(c.id)
        cpu_ns, mem_used, mem_limit = sample
        now = time.monotonic()
        cpus = max(1, c.cpu_count)
        prev = self._samples.get(c.id)
        self._samples[c.id] = (now, cpu_ns)
        if prev is not None and now > prev[0]:
            pct = (cpu_ns - prev[1]) / 1e9 / (now - prev[0]) / cpus * 100
        else:
            # First sample: the average since the sandbox started.
            elapsed = time.time() - c.started_at if c.started_at else 0.0
            pct = cpu_ns / 1e9 / elapsed / cpus * 100 if elapsed > 0 else 0.0
        if c.memory_mb > 0 or mem_limit <= 0 or mem_limit >= 1 << 62:
            # The sandbox's size: the cgroup's limit is above it (`runtime/memguard.py`).
            mem_limit = c.memory_mb * 1024 * 1024
        rss = await asyncio.to_thread(host_rss, c)
        return Stats(
            cpu_used_pct=round(max(0.0, min(pct, 100.0)), 2),
            mem_used_bytes=mem_used,
            mem_total_bytes=mem_limit,
            rss_bytes=rss,
        )

    async def _read_events(self, cid: str) -> tuple[int, int, int]:
        try:
            data = (await self.runsc.events_stats(cid)).get("data") or {}
        except RuntimeFailure as e:
            if is_missing(e):
                raise RuntimeFailure(f"container {cid} does not exist") from e
            raise
        cpu = int(((data.get("cpu") or {}).get("usage") or {}).get("total") or 0)
        mem = (data.get("memory") or {}).get("usage") or {}
        return cpu, int(mem.get("usage") or 0), int(mem.get("limit") or 0)


def read_cgroup(cgroup: str) -> tuple[int, int, int] | None:
    """(cpu ns, memory used, memory limit) from a container's cgroup, v1 or v2."""
    rel = cgroup.lstrip("/")
    v1_cpu = CGROUP_ROOT / "cpuacct" / rel / "cpuacct.usage"
    v1_mem = CGROUP_ROOT / "memory" / rel
    try:
        if v1_cpu.exists():
            cpu = int(v1_cpu.read_text())
            used = int((v1_mem / "memory.usage_in_bytes").read_text())
            stat = _kv((v1_mem / "memory.stat").read_text())
            used -= stat.get("total_inactive_file", 0)
            limit = int((v1_mem / "memory.limit_in_bytes").read_text())
            return cpu, max(0, used), limit
        v2 = CGROUP_ROOT / rel
        if (v2 / "cpu.stat").exists():
            cpu = _kv((v2 / "cpu.stat").read_text()).get("usage_usec", 0) * 1000
            used = int((v2 / "memory.current").read_text())
            used -= _kv((v2 / "memory.stat").read_text()).get("inactive_file", 0)
            raw = (v2 / "memory.max").read_text().strip()
            limit = 0 if raw == "max" else int(raw)
            return cpu, max(0, used), limit
    except (OSError, ValueError):
        return None
    return None


def oom_kills(cgroup: str) -> int:
    """How many processes the host's OOM killer ended in the cgroup (v1 `oom_kill` in
    memory.oom_control, v2 memory.events); 0 when unknown."""
    rel = cgroup.lstrip("/")
    for path, key in (
        (CGROUP_ROOT / "memory" / rel / "memory.oom_control", "oom_kill"),
        (CGROUP_ROOT / rel / "memory.events", "oom_kill"),
    ):
        try:
            return _kv(path.read_text()).get(key, 0)
        except OSError:
            continue
    return 0


def exit_cause(c: Container) -> str | None:
    if c.cgroup and oom_kills(c.cgroup) > 0:
        return f"the host killed it at its memory limit ({c.memory_mb} MiB)"
    return None


def host_rss(c: Container) -> int:
    total = 0
    for pid in (c.pid, c.gofer_pid):
        if pid <= 0:
            continue
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            continue
    return total


def _kv(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out
