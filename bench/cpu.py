"""Where a stretch of work's CPU went: the whole machine (/proc/stat), the server's own
process, and the sandboxes (their runsc processes' cgroups, `cpuacct/<prefix>/`); the rest
is the runsc commands the server started, the kernel, and the host's own agents."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .idle_cpu import STAT, busy_jiffies

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
_HZ = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuSample:
    machine_s: float
    server_s: float
    sandboxes_s: float


@dataclass(frozen=True)
class CpuSplit:
    total_s: float
    server_s: float
    sandboxes_s: float

    @property
    def other_s(self) -> float:
        return max(0.0, self.total_s - self.server_s - self.sandboxes_s)

    def per(self, n: int) -> CpuSplit:
        n = max(1, n)
        return CpuSplit(self.total_s / n, self.server_s / n, self.sandboxes_s / n)

    def describe(self) -> str:
        return (
            f"server {self.server_s:.2f} s, sandboxes {self.sandboxes_s:.2f} s, "
            f"runsc commands + kernel + host {self.other_s:.2f} s"
        )


def _process_s(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        after = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[-1].split()
        return (int(after[11]) + int(after[12])) / _HZ
    except (OSError, ValueError, IndexError):
        return 0.0


def _cgroup_s(prefix: str) -> float:
    try:
        return int((CPUACCT / prefix / "cpuacct.usage").read_text()) / 1e9
    except (OSError, ValueError):
        return 0.0


class CpuMeter:
    """`sample()` before and after; `split(a, b)` the CPU-seconds between."""

    def __init__(self, prefix: str, server_pid: int | None = None, stat: Path = STAT) -> None:
        self.prefix = prefix
        self.server_pid = server_pid
        self.stat = stat

    def sample(self) -> CpuSample:
        return CpuSample(
            machine_s=busy_jiffies(self.stat) / _HZ,
            server_s=_process_s(self.server_pid),
            sandboxes_s=_cgroup_s(self.prefix),
        )

    @staticmethod
    def split(a: CpuSample, b: CpuSample) -> CpuSplit:
        return CpuSplit(
            total_s=b.machine_s - a.machine_s,
            server_s=b.server_s - a.server_s,
            sandboxes_s=b.sandboxes_s - a.sandboxes_s,
        )
