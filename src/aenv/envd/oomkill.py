"""What the sandbox's kernel would do at its memory limit, done by envd when the node asks
(`POST /oom`, see `runtime/memguard.py`): the process using the most memory is killed
(SIGKILL), and what it was is returned for the node's logs and metrics.

Spared: envd itself (the sandbox's first process, pid 1) and any process that asked to be
(`oom_score_adj` -1000, as Linux spares it). Stdlib only, like the rest of envd."""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import asdict, dataclass

_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Victim:
    pid: int
    cmd: str
    rss_bytes: int


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


def largest(own: int | None = None, proc: str = "/proc") -> Victim | None:
    """The process with the largest resident memory that may be killed."""
    own = os.getpid() if own is None else own
    best: Victim | None = None
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid in (1, own):
            continue
        try:
            rss = _rss(proc, pid)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or a kernel thread
        if (best is None or rss > best.rss_bytes) and not _spared(proc, pid):
            best = Victim(pid, _cmd(proc, pid), rss)
    return best


def kill_largest() -> dict[str, object]:
    """Kills the largest process; `{"killed": {pid, cmd, rss_bytes}}` or `{"killed": None}`."""
    victim = largest()
    if victim is None:
        return {"killed": None}
    with contextlib.suppress(ProcessLookupError):
        os.kill(victim.pid, signal.SIGKILL)
    return {"killed": asdict(victim)}
