"""A sandbox outlives its worst process: memory pressure is noticed on the host and handled
inside, before the host's OOM killer ends the whole sandbox.

gVisor tells its applications the sandbox has as much RAM as its memory limit, but it does
not stop them from using more: a single huge allocation (`bytearray(6 << 30)`) is mapped,
touched and backed by the sentry's memory until the container's cgroup reaches its limit,
and there the host's OOM killer kills the sentry — every process and envd with it. On a VM
(E2B, AgentENV) the guest kernel kills the process instead and the sandbox lives on.

So, per running container, on cgroup v1 (this host's; without it nothing changes):
* the cgroup's hard limit is raised from the sandbox's size to size + headroom
  (max(128 MiB, size / 4)), after runsc started it at the size (which gVisor reports as RAM);
* an eventfd fires when the usage crosses the size (`cgroup.event_control` threshold on
  `memory.usage_in_bytes`): unless what it passed by is page cache the kernel can drop,
  the listener is told, and the node has envd kill the largest process inside
  (`envd/oomkill.py`);
* the kernel's OOM killer is switched off for the cgroup (`memory.oom_control`) and an
  eventfd fires when the cgroup is out of memory: its tasks then wait instead of dying, so
  the limit is raised by RESCUE_BYTES (envd needs room to do the kill) and the listener told
  again; after RESCUES of those the kernel's killer is let back, as before. Rescues come at
  most one per RESCUE_GAP seconds: the process that ran out takes each one at once, and on
  a loaded machine the node's kill through envd takes seconds, so rescues paced by the
  clock (the tasks wait meanwhile) give it RESCUES * RESCUE_GAP seconds, not milliseconds.

Push, not poll: two eventfds per sandbox in the event loop, nothing on a timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .freezer import CGROUP_ROOT

log = logging.getLogger("aenv.runtime")

MIB = 1 << 20
MIN_HEADROOM = 128 * MIB
# Tried: 12 rescues of 32 MiB (the same room, twice the time) lost the sandbox more often
# (its connections reset while it waited longer at its limit) than 6 of 64 MiB.
RESCUE_BYTES = 64 * MIB
RESCUES = 6
RESCUE_GAP = 1.0


def headroom(size: int) -> int:
    return max(MIN_HEADROOM, size // 4)


@dataclass
class _Guard:
    cid: str
    dir: Path
    size: int
    limit: int
    fds: list[int]
    threshold_fd: int
    oom_fd: int
    rescues: int = 0
    last_rescue: float = 0.0
    # The next rescue, when one came too soon after the last.
    pending: asyncio.TimerHandle | None = None


class MemoryGuard:
    """`arm(cid, cgroup, size)` after a container starts, `disarm(cid)` before it goes;
    `on_pressure(cid)` runs (in the event loop) when its usage passes `size` or it is out
    of memory."""

    def __init__(self, on_pressure: Callable[[str], None], root: Path = CGROUP_ROOT) -> None:
        self.on_pressure = on_pressure
        self.root = root
        self._guards: dict[str, _Guard] = {}
        # The arm in flight of each container (a disarm meanwhile cancels it).
        self._arming: dict[str, object] = {}

    def armed(self, cid: str) -> bool:
        return cid in self._guards

    async def arm(self, cid: str, cgroup: str, size: int) -> bool:
        """Guards the container; False where the host cannot (no cgroup v1 memory). The
        cgroup writes run in a thread: registering a threshold waits for an RCU grace period
        in the kernel (tens of ms on a busy host), which held the event loop on every
        create and restore."""
        self.disarm(cid)
        d = self.root / "memory" / cgroup.strip("/")
        token = self._arming[cid] = object()
        job = asyncio.ensure_future(asyncio.to_thread(_register, d, size))
        try:
            got = await asyncio.shield(job)
        except asyncio.CancelledError:
            job.add_done_callback(_close_registered)  # what the thread opens is closed
            raise
        except OSError as e:
            log.warning("memory guard of %s not armed: %s", cid, e)
            return False
        finally:
            if self._arming.get(cid) is token:
                del self._arming[cid]
            else:
                token = None  # disarmed (or armed again) meanwhile
        if got is None:
            return False
        limit, fds, threshold_fd, oom_fd = got
        if token is None:
            for fd in fds:
                os.close(fd)
            return False
        g = _Guard(cid, d, size, limit, fds, threshold_fd, oom_fd)
        loop = asyncio.get_running_loop()
        loop.add_reader(threshold_fd, self._crossed, g)
        loop.add_reader(oom_fd, self._out_of_memory, g)
        self._guards[cid] = g
        return True

    def disarm(self, cid: str) -> None:
        self._arming.pop(cid, None)
        g = self._guards.pop(cid, None)
        if g is None:
            return
        loop = asyncio.get_running_loop()
        if g.pending is not None:
            g.pending.cancel()
        for fd in (g.threshold_fd, g.oom_fd):
            loop.remove_reader(fd)
        for fd in g.fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        for cid in list(self._guards):
            self.disarm(cid)

    # -- events -------------------------------------------------------------------------

    def _drain(self, g: _Guard, fd: int) -> bool:
        """Reads the event; False when the cgroup is gone (its removal signals too)."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.read(fd, 8)
        if not g.dir.exists():
            self.disarm(g.cid)
            return False
        return True

    def _crossed(self, g: _Guard) -> None:
        if not self._drain(g, g.threshold_fd):
            return
        try:
            usage = int((g.dir / "memory.usage_in_bytes").read_text())
            stat = (g.dir / "memory.stat").read_text()
        except (OSError, ValueError):
            return
        # Page cache the kernel can drop is not the sandbox's: a sandbox that read many
        # files is not out of memory (and if it gets there, the OOM event says so).
        # Thresholds fire on the way down too.
        if usage - _stat(stat, "total_inactive_file") >= g.size:
            self._tell(g.cid)

    def _out_of_memory(self, g: _Guard) -> None:
        if not self._drain(g, g.oom_fd):
            return
        wait = g.last_rescue + RESCUE_GAP - time.monotonic()
        if g.rescues and wait > 0:
            if g.pending is None:
                g.pending = asyncio.get_running_loop().call_later(wait, self._rescue, g)
            return
        self._rescue(g)

    def _rescue(self, g: _Guard) -> None:
        g.pending = None
        if self._guards.get(g.cid) is not g:
            return
        try:
            under = "under_oom 1" in (g.dir / "memory.oom_control").read_text()
            if not under:
                return
            if g.rescues >= RESCUES:
                # Nothing inside freed memory: the kernel's killer ends it, as without us.
                log.warning("sandbox container %s stays out of memory: OOM killer back", g.cid)
                _write(g.dir / "memory.oom_control", 0)
                return
            g.rescues += 1
            g.last_rescue = time.monotonic()
            g.limit += RESCUE_BYTES
            _raise_limit(g.dir, g.limit)
            log.info(
                "sandbox container %s out of memory: rescue %d of %d", g.cid, g.rescues, RESCUES
            )
        except OSError as e:
            log.warning("memory guard of %s: %s", g.cid, e)
            return
        self._tell(g.cid)

    def _tell(self, cid: str) -> None:
        try:
            self.on_pressure(cid)
        except Exception:
            log.exception("memory pressure listener")


def _stat(text: str, key: str) -> int:
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _write(path: Path, value: int) -> None:
    path.write_text(str(value))


def _raise_limit(d: Path, limit: int) -> None:
    """memory + swap may not be limited below memory alone: that one first, when set."""
    memsw = d / "memory.memsw.limit_in_bytes"
    with contextlib.suppress(OSError, ValueError):
        if int(memsw.read_text()) < limit:
            _write(memsw, limit)
    _write(d / "memory.limit_in_bytes", limit)


def _register(d: Path, size: int) -> tuple[int, list[int], int, int] | None:
    """The cgroup's limit raised by the headroom, the kernel's OOM killer off, and eventfds
    for the usage threshold and OOM: (limit, every fd, threshold fd, OOM fd); None without
    cgroup v1 memory events. Blocking; on an error nothing is left open."""
    if not (d / "cgroup.event_control").exists():
        return None
    fds: list[int] = []
    try:
        limit = size + headroom(size)
        _raise_limit(d, limit)
        _write(d / "memory.oom_control", 1)
        threshold_fd = _event(d, "memory.usage_in_bytes", str(size), fds)
        oom_fd = _event(d, "memory.oom_control", "", fds)
    except OSError:
        for fd in fds:
            os.close(fd)
        raise
    return limit, fds, threshold_fd, oom_fd


def _close_registered(job: asyncio.Future[tuple[int, list[int], int, int] | None]) -> None:
    if job.cancelled() or job.exception() is not None:
        return
    got = job.result()
    for fd in got[1] if got is not None else []:
        with contextlib.suppress(OSError):
            os.close(fd)


def _event(d: Path, target: str, args: str, fds: list[int]) -> int:
    """Registers an eventfd for `target`'s event (cgroup v1 `cgroup.event_control`)."""
    efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
    fds.append(efd)
    tfd = os.open(d / target, os.O_RDONLY | os.O_CLOEXEC)
    fds.append(tfd)
    (d / "cgroup.event_control").write_text(f"{efd} {tfd} {args}".strip())
    return efd
