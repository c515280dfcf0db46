"""Naps: an idle sandbox's host threads sleep in long stretches instead of waking every few
milliseconds.

An idle gVisor sentry (systrap) still wakes often: the Go runtime's timers, its netstack's
timers, envd's own. Each wake-up is a host context switch, and 25-35 millicores per idle
sandbox on this machine add up to whole cores at a few hundred sandboxes. Linux lets each
thread say how late its timers may fire (`/proc/<tid>/timerslack_ns`, 50 µs by default):
with a second of slack the kernel coalesces them, and the same idle sandbox costs under
one millicore. Nothing else changes: an event (a packet, a pipe, a signal) wakes a thread
at once, as before; only a sleep's end may come up to the slack late. That is why naps are
for sandboxes with nothing to do, and ended before a request reaches one.

Threads inherit their creator's slack, so the sentry's later threads nap too; writing 0
gives each thread its default back. Needs CAP_SYS_NICE over the threads (the node is root).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from .freezer import CGROUP_ROOT

NAP_SLACK_NS = 1_000_000_000


def threads(cgroup: str, root: Path = CGROUP_ROOT) -> list[int]:
    """Every host thread in the container's cgroup (v1 freezer or cpu hierarchy, or v2)."""
    rel = cgroup.strip("/")
    for f in (root / "freezer" / rel / "tasks", root / "cpu" / rel / "tasks"):
        with contextlib.suppress(OSError):
            return [int(t) for t in f.read_text().split()]
    with contextlib.suppress(OSError):
        return [int(t) for t in (root / rel / "cgroup.threads").read_text().split()]
    return []


def set_slack(cgroup: str, slack_ns: int, root: Path = CGROUP_ROOT) -> int:
    """Sets the timer slack of every thread of the cgroup (0: each thread's default);
    returns how many threads took it. Threads that end meanwhile are skipped."""
    done = 0
    value = str(slack_ns).encode()
    for tid in threads(cgroup, root):
        try:
            fd = os.open(f"/proc/{tid}/timerslack_ns", os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            continue  # ended meanwhile
        try:
            os.write(fd, value)
            done += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return done


def slack_of(tid: int) -> int:
    return int(Path(f"/proc/{tid}/timerslack_ns").read_text())
