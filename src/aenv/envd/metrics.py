"""``GET /metrics``: CPU, memory and disk usage from /proc and statvfs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

MIB = 1024 * 1024
_last_cpu: tuple[int, int] | None = None  # (busy, total) jiffies at the previous call


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat", encoding="ascii", errors="replace") as f:
        line = f.readline()
    vals = [int(x) for x in line.split()[1:]]
    # user nice system idle iowait irq softirq steal (guest* are part of user)
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    total = sum(vals[:8])
    return total - idle, total


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/meminfo", encoding="ascii", errors="replace") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                with contextlib.suppress(ValueError):
                    out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


async def collect() -> dict[str, float | int]:
    global _last_cpu
    try:
        now = _cpu_times()
        prev = _last_cpu
        if prev is None:  # first call: sample a short interval
            await asyncio.sleep(0.1)
            prev, now = now, _cpu_times()
        _last_cpu = now
        dt = now[1] - prev[1]
        cpu_pct = round(100.0 * (now[0] - prev[0]) / dt, 2) if dt > 0 else 0.0
    except (OSError, ValueError, IndexError):
        cpu_pct = 0.0
    try:
        mem = _meminfo()
    except OSError:
        mem = {}
    total = mem.get("MemTotal", 0)
    avail = mem.get("MemAvailable")
    if avail is None:
        avail = mem.get("MemFree", 0) + mem.get("Buffers", 0) + mem.get("Cached", 0)
    used = max(0, total - avail)
    try:
        sv = os.statvfs("/")
        disk_total = sv.f_blocks * sv.f_frsize
        disk_used = (sv.f_blocks - sv.f_bfree) * sv.f_frsize
    except OSError:
        disk_total = disk_used = 0
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return {
        "ts": int(time.time()),
        "cpu_count": cpus,
        "cpu_used_pct": cpu_pct,
        "mem_total": total,
        "mem_used": used,
        "mem_cache": mem.get("Cached", 0),
        "mem_total_mib": total // MIB,
        "mem_used_mib": used // MIB,
        "disk_used": disk_used,
        "disk_total": disk_total,
    }
