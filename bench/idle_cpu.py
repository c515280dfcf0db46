"""The machine's busy CPU over a window, from /proc/stat: what idle sandboxes cost the node
(issue 21 asks for it this way: busy CPU over a minute with none and with many). Every
process counts, the node's (server, runsc, sandboxes) and the host's own, so a window is
taken while the bench itself sleeps."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

STAT = Path("/proc/stat")


def busy_jiffies(stat: Path = STAT) -> int:
    """Jiffies the CPUs spent not idle (idle and iowait excluded) since boot."""
    fields = stat.read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
    return sum(values) - values[3] - values[4]


async def busy_millicores(seconds: float, stat: Path = STAT) -> float:
    """The machine's busy CPU, in thousandths of a core, averaged over `seconds` from now."""
    hz = os.sysconf("SC_CLK_TCK")
    loop = asyncio.get_running_loop()
    start, t0 = busy_jiffies(stat), loop.time()
    await asyncio.sleep(seconds)
    end, t1 = busy_jiffies(stat), loop.time()
    return (end - start) / hz / (t1 - t0) * 1000
