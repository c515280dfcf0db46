"""What the sandbox's kernel would do at its memory limit, done by envd when the node asks
(`POST /oom`, see `runtime/memguard.py`): a process is killed (SIGKILL), and what it was is
returned for the node's logs and metrics.

Which one: the largest process of the session (an envd command and what it started) using
the most memory — as Linux's cgroup-aware OOM killer picks the biggest group first — so a
fork bomb of thousands of small shells loses its own, not the shell of a command beside it
that happens to be as large as each of them.

When: only while the sandbox is short of memory by its own count (`/proc/meminfo`, which
gVisor keeps exact). The host's view lags: memory the sentry freed is given back to the
host a while later, and the node's signals of that time would otherwise kill a bystander
after the culprit was already gone.

Spared: envd itself (the sandbox's first process, pid 1) and any process that asked to be
(`oom_score_adj` -1000, as Linux spares it). Stdlib only, like the rest of envd."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import asdict, dataclass

_PAGE = os.sysconf("SC_PAGE_SIZE")
# Short of memory: less than this share of the sandbox's memory is available.
RESERVE_SHARE = 8
# How long a kill waits for its victim to be gone (and its memory free).
EXIT_WAIT = 2.0


@dataclass(frozen=True)
class Victim:
    pid: int
    cmd: str
    rss_bytes: int


@dataclass(frozen=True)
class _Proc:
    pid: int
    session: int
    rss_bytes: int


def _stat_fields(proc: str, pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command (which may hold spaces and parens)."""
    with open(f"{proc}/{pid}/stat", "rb") as f:
        raw = f.read()
    return raw[raw.rindex(b")") + 2 :].decode().split()


def _rss(proc: str, pid: int) -> int:
    with open(f"{proc}/{pid}/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE


def _spared(proc: str, pid: int) -> bool:
    try:
        with open(f"{proc}/{pid}/oom_score_adj", "rb") as f:
            return int(f.read().strip() or 0) <= -1000
    except (OSError, ValueError):
        return False


def _cmd(proc: str, pid: int) -> str:
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()[:200]


def _alive(proc: str, pid: int) -> bool:
    """Running still (a zombie has given its memory back)."""
    try:
        return _stat_fields(proc, pid)[0] not in ("Z", "X")
    except (OSError, ValueError, IndexError):
        return False


def short_of_memory(proc: str = "/proc") -> bool:
    """True when less than 1/RESERVE_SHARE of the sandbox's memory is available (or when
    the sandbox does not say)."""
    fields: dict[str, int] = {}
    try:
        with open(f"{proc}/meminfo", "rb") as f:
            for line in f.read().decode().splitlines():
                name, _, rest = line.partition(":")
                value = rest.split()
                if value and value[0].isdigit():
                    fields[name] = int(value[0]) * 1024
    except OSError:
        return True
    total, available = fields.get("MemTotal"), fields.get("MemAvailable")
    if not total or available is None:
        return True
    return available < total // RESERVE_SHARE


def _killable(proc: str, own: int) -> list[_Proc]:
    found: list[_Proc] = []
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid in (1, own):
            continue
        try:
            fields = _stat_fields(proc, pid)
            if fields[0] in ("Z", "X"):
                continue
            found.append(_Proc(pid, int(fields[3]), _rss(proc, pid)))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or a kernel thread
    return [p for p in found if not _spared(proc, p.pid)]


def largest(own: int | None = None, proc: str = "/proc") -> Victim | None:
    """The largest process of the session that uses the most memory."""
    own = os.getpid() if own is None else own
    procs = _killable(proc, own)
    if not procs:
        return None
    by_session: dict[int, int] = {}
    for p in procs:
        by_session[p.session] = by_session.get(p.session, 0) + p.rss_bytes
    session = max(by_session, key=lambda s: by_session[s])
    pick = max((p for p in procs if p.session == session), key=lambda p: p.rss_bytes)
    return Victim(pick.pid, _cmd(proc, pick.pid), pick.rss_bytes)


async def kill_largest(
    proc: str = "/proc", wait: float = EXIT_WAIT, force: bool = False
) -> dict[str, object]:
    """Kills the largest process when the sandbox is short of memory (or `force`: the
    node knows better, e.g. the sentry's own memory is what is short) and waits (a while)
    for it to be gone; `{"killed": {pid, cmd, rss_bytes}}` or `{"killed": None}`."""
    if not force and not short_of_memory(proc):
        return {"killed": None}
    victim = largest(proc=proc)
    if victim is None:
        return {"killed": None}
    with contextlib.suppress(ProcessLookupError):
        os.kill(victim.pid, signal.SIGKILL)
    # Not envd's child (no wait, and gVisor has no pidfd): its exit is seen in /proc.
    deadline = time.monotonic() + wait
    while _alive(proc, victim.pid) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    return {"killed": asdict(victim)}
