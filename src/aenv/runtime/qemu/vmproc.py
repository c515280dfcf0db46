"""The QEMU process of a VM on the host: its cgroup (CPU quota, memory limit), whether it
still runs, how to end it, and what it uses (the contract's `Stats`)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from aenv.runtime import _proc
from aenv.runtime.base import Stats
from aenv.runtime.freezer import CGROUP_ROOT
from aenv.runtime.qemu.machine import QEMU_OVERHEAD_MB, Machine

_PERIOD_US = 100_000
_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def cgroup_dirs(cgroup: str) -> list[Path]:
    """The VM's cgroup in each hierarchy it uses: v1's cpu, cpuacct (its CPU counted where
    the node's meters read it) and memory, or the v2 one."""
    rel = cgroup.strip("/")
    v1 = [CGROUP_ROOT / c / rel for c in ("cpu", "cpuacct", "memory") if (CGROUP_ROOT / c).is_dir()]
    return v1 or [CGROUP_ROOT / rel]


def confine(m: Machine) -> None:
    """Puts the running QEMU into its cgroup, limited to the VM's vCPUs and its memory plus
    QEMU's own overhead (only QEMU dies at the limit, never a neighbour)."""
    mem = (m.memory_mb + QEMU_OVERHEAD_MB) * 1024 * 1024
    quota = m.cpu_count * _PERIOD_US
    for d in cgroup_dirs(m.cgroup):
        with contextlib.suppress(OSError):
            d.mkdir(parents=True, exist_ok=True)
            for name, value in (
                ("memory.limit_in_bytes", str(mem)),
                ("cpu.cfs_quota_us", str(quota)),
                ("memory.max", str(mem)),
                ("cpu.max", f"{quota} {_PERIOD_US}"),
            ):
                if (d / name).exists():
                    (d / name).write_text(value)
            (d / "cgroup.procs").write_text(str(m.pid))


def remove_cgroup(cgroup: str, patience: float = 2.0) -> None:
    """Removes the VM's cgroup; a QEMU that just died may still be leaving it (EBUSY)."""
    end = time.monotonic() + patience
    for d in cgroup_dirs(cgroup):
        while d.is_dir():
            try:
                d.rmdir()
            except OSError:
                if time.monotonic() > end:
                    break
                time.sleep(0.02)


def stale_cgroups(prefix: str, keep: set[str]) -> list[str]:
    """The cgroups of this prefix's VMs (`/<prefix>/<id>`) whose ids are not in `keep`."""
    found = set()
    for top in cgroup_dirs(f"/{prefix}"):
        if top.is_dir():
            found |= {f"/{prefix}/{d.name}" for d in top.iterdir() if d.is_dir()}
    return sorted(c for c in found if c.rsplit("/", 1)[1] not in keep)


def read_pid(m: Machine) -> int:
    with contextlib.suppress(OSError, ValueError):
        return int((m.dir / "qemu.pid").read_text().strip())
    return 0


def _pid(m: Machine) -> int:
    # Not yet in the record (a crash or a cancel right after QEMU daemonized): its pid file.
    return m.pid if m.pid > 0 else read_pid(m)


def running(m: Machine) -> bool:
    """Whether the VM's QEMU runs (the pid is checked to be that VM's: pids are reused)."""
    pid = _pid(m)
    if pid <= 0:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    st = _proc.proc_stat(pid)
    return f"aenv-{m.id}".encode() in cmdline.split(b"\0") and st is not None and not st.dead


def kill(m: Machine) -> int:
    """SIGKILLs the VM's QEMU if it runs; returns its pid (0 when none ran)."""
    if not running(m):
        return 0
    pid = _pid(m)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return pid


# Consoles of removed VMs kept for a post-mortem (`$AENV_HOME/qemu/consoles/<id>.log`).
KEPT_CONSOLES = 50


def keep_console(m: Machine, where: Path) -> None:
    """Moves a removed VM's serial console beside the last ones (the newest few are kept)."""
    try:
        if m.console.stat().st_size == 0:
            return
        where.mkdir(parents=True, exist_ok=True)
        m.console.rename(where / f"{m.id}.log")
        logs = sorted(where.glob("*.log"), key=lambda p: p.stat().st_mtime)
    except OSError:
        return
    for old in logs[:-KEPT_CONSOLES]:
        old.unlink(missing_ok=True)


def exit_cause(m: Machine) -> str | None:
    """Why a VM's QEMU ended on its own, from the last telling line of its console: the
    guest's init giving up, a kernel panic, the guest's OOM killer ending its init."""
    try:
        lines = m.console.read_text(errors="replace").splitlines()[-200:]
    except OSError:
        return None
    for line in reversed(lines):
        text = line.split("] ", 1)[-1].strip()
        if text.startswith(("aenv-init:", "Kernel panic", "Out of memory")):
            return f"the guest: {text}"
    return None


def reap(pid: int) -> None:
    """Reaps an exited QEMU when this process adopted it (a subreaper: a daemonized QEMU's
    parent exits at once); only a QEMU zombie of ours, never another child's status."""
    st = _proc.proc_stat(pid) if pid > 0 else None
    if st is None or not st.dead or st.ppid != os.getpid() or not st.comm.startswith("qemu"):
        return
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


@dataclass
class _Sample:
    cpu_s: float
    at: float


class Meter:
    """CPU % since the previous call (or the VM's start) and memory, from /proc."""

    def __init__(self) -> None:
        self._last: dict[str, _Sample] = {}

    def forget(self, vm_id: str) -> None:
        self._last.pop(vm_id, None)

    def stats(self, m: Machine) -> Stats:
        cpu_s, rss = 0.0, 0
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{m.pid}/stat").read_text().rpartition(")")[2].split()
            cpu_s = (int(fields[11]) + int(fields[12])) / _TICK
            rss = int(Path(f"/proc/{m.pid}/statm").read_text().split()[1]) * _PAGE
        now = time.monotonic()
        last = self._last.get(m.id) or _Sample(0.0, now - max(time.time() - m.started_at, 1e-3))
        self._last[m.id] = _Sample(cpu_s, now)
        pct = 100.0 * (cpu_s - last.cpu_s) / max(now - last.at, 1e-3) / max(m.cpu_count, 1)
        total = m.memory_mb * 1024 * 1024
        return Stats(
            cpu_used_pct=min(max(pct, 0.0), 100.0),
            mem_used_bytes=min(rss, total),
            mem_total_bytes=total,
            rss_bytes=rss,
        )
