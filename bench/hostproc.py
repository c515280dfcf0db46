"""The host processes of a gVisor sandbox, found through /proc (works for any server on this
host, whatever its AENV_HOME): `runsc-sandbox` (the sentry) and `runsc-gofer` whose command
line mentions the sandbox id (the container id is `<sandbox id>-<suffix>` and the bundle path
holds the sandbox id), plus the sentry's systrap stub children (empty command line)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")
RUNSC_NAMES = ("runsc-sandbox", "runsc-gofer")


@dataclass
class SandboxProcs:
    sentry: list[int] = field(default_factory=list)
    gofer: list[int] = field(default_factory=list)
    stubs: list[int] = field(default_factory=list)

    @property
    def main(self) -> list[int]:
        return self.sentry + self.gofer

    def __bool__(self) -> bool:
        return bool(self.sentry or self.gofer)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _ppid_state(pid: int, proc: Path = PROC) -> tuple[int, str] | None:
    raw = _read(proc / str(pid) / "stat")
    if raw is None:
        return None
    after = raw.rsplit(b")", 1)[-1].split()
    try:
        return int(after[1]), after[0].decode()
    except (IndexError, ValueError):
        return None


def scan(keys: list[str], proc: Path = PROC) -> dict[str, SandboxProcs]:
    """For each key (a sandbox or container id), its runsc processes. One pass over /proc."""
    found: dict[str, SandboxProcs] = {k: SandboxProcs() for k in keys}
    wanted = [(k, k.encode()) for k in keys]
    children: dict[int, list[int]] = {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        cmd = _read(proc / entry.name / "cmdline")
        if cmd is None:
            continue
        if not cmd:
            ps = _ppid_state(pid, proc)
            if ps is not None:
                children.setdefault(ps[0], []).append(pid)
            continue
        argv0 = cmd.split(b"\0", 1)[0].decode(errors="replace")
        if argv0 not in RUNSC_NAMES:
            continue
        for key, raw in wanted:
            if raw in cmd:
                target = found[key]
                (target.sentry if argv0 == "runsc-sandbox" else target.gofer).append(pid)
    for procs in found.values():
        for pid in procs.sentry:
            procs.stubs.extend(children.get(pid, []))
    return found


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    ps = _ppid_state(pid)
    return ps is not None and ps[1] != "Z"


def any_alive(pids: list[int]) -> bool:
    return any(alive(p) for p in pids)


def _kib(path: Path, field_name: str) -> int:
    raw = _read(path)
    if raw is None:
        return 0
    for line in raw.decode(errors="replace").splitlines():
        if line.startswith(field_name):
            try:
                return int(line.split()[1])
            except (IndexError, ValueError):
                return 0
    return 0


def rss_mib(pids: list[int]) -> float:
    """Sum of VmRSS."""
    return sum(_kib(PROC / str(p) / "status", "VmRSS:") for p in pids) / 1024


def pss_mib(pids: list[int]) -> float:
    """Sum of Pss (shared pages split between their users)."""
    return sum(_kib(PROC / str(p) / "smaps_rollup", "Pss:") for p in pids) / 1024
