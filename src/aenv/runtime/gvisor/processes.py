"""Ending a container's runsc processes (sandbox, gofer) safely: every pid is checked against
its command line before a signal, since a pid read from a state file may have been reused."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from pathlib import Path

from aenv.errors import RuntimeFailure
from aenv.runtime import _proc
from aenv.runtime.freezer import Freezer
from aenv.runtime.gvisor import control
from aenv.runtime.gvisor.container import Container
from aenv.runtime.gvisor.runsc import RUNNING_STATES, Runsc, gather_quiet

log = logging.getLogger("aenv.runtime")


class Processes:
    def __init__(self, runsc: Runsc, freezer: Freezer, cgroup_prefix: str) -> None:
        self.runsc = runsc
        self.freezer = freezer
        self._prefix = cgroup_prefix

    def cgroup(self, cid: str) -> str:
        """The cgroup path runsc gives a container (`linux.cgroupsPath`)."""
        return f"/{self._prefix}/{cid}"

    def unfreeze(self, cid: str, cgroup: str | None = None) -> None:
        """Thaws a frozen container: runsc commands and even SIGKILL wait on frozen tasks."""
        cg = cgroup or self.cgroup(cid)
        if self.freezer.is_frozen(cg):
            self.freezer.thaw(cg)

    def is_our_sandbox(self, pid: int, cid: str) -> bool:
        argv = _cmdline(pid)
        return (
            bool(argv)
            and argv[0] == "runsc-sandbox"
            and argv[-1] == cid
            and f"--root={self.runsc.root}" in argv
        )

    def is_our_gofer(self, pid: int, c: Container) -> bool:
        argv = _cmdline(pid)
        return (
            bool(argv)
            and argv[0] == "runsc-gofer"
            and f"--root={self.runsc.root}" in argv
            and f"--bundle={c.bundle_dir}" in argv
        )

    async def is_running(self, c: Container) -> bool:
        """Whether the container's sandbox process runs. It exits with the root container's
        init (a zombie until reaped, which is when `runsc state` notices), so its command
        line is the fast answer."""
        if c.pid > 0:
            return await asyncio.to_thread(self.is_our_sandbox, c.pid, c.id)
        state = await self.runsc.state(c.id)
        return state is not None and state.get("status") in RUNNING_STATES

    def kill_sandbox(self, c: Container) -> bool:
        """SIGKILLs the container's sandbox process (verified by its command line)."""
        pid = c.pid or self.runsc.read_pids(c.id)[0]
        if pid <= 0 or not self.is_our_sandbox(pid, c.id):
            return False
        self.unfreeze(c.id, c.cgroup)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return True

    async def remove(self, c: Container, *, kill: bool, delete: bool = True) -> None:
        """Kills (unless it exits by itself after a checkpoint) and deletes (unless not
        `delete`) the container, and waits until its sandbox and gofer processes are gone (so
        nothing holds its rootfs).

        Both exits are reaped before `runsc delete`, which otherwise polls each zombie (up to
        5 s) until init reaps it. The gofer exits by itself once the sandbox is gone."""
        cid = c.id
        pid, gofer = c.pid, c.gofer_pid
        if pid <= 0:
            pid, gofer = self.runsc.read_pids(cid)

        def running() -> list[int]:
            """The container's processes that (may) still run, verified."""
            found = []
            if pid > 0 and (self.is_our_sandbox(pid, cid) or is_runsc_child(pid)):
                found.append(pid)
            if gofer > 0 and (self.is_our_gofer(gofer, c) or is_runsc_child(gofer)):
                found.append(gofer)
            return found

        procs = await asyncio.to_thread(running)
        if kill and pid in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if procs and not await _proc.wait_exited(procs, 10.0):
            left = await asyncio.to_thread(running)
            log.warning("processes %s of %s did not exit; killing them", left, cid)
            for p in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            await _proc.wait_exited(left, 10.0)
        if not delete:
            return
        try:
            await self.runsc.delete(cid)
        except RuntimeFailure as e:
            log.warning("runsc delete %s: %s", cid, e)
        await asyncio.to_thread(_proc.reap_adopted)

    async def is_frozen(self, c: Container) -> bool:
        if control.is_held(c.bundle_dir):  # held around a checkpoint (`hold`)
            return True
        if await asyncio.to_thread(self.freezer.available, c.cgroup):
            return await asyncio.to_thread(self.freezer.is_frozen, c.cgroup)
        state = await self.runsc.state(c.id)  # paused by runsc (no freezer on this host)
        return state is not None and state.get("status") == "paused"

    def commands(self) -> list[int]:
        """Pids of runsc commands on this root that still run (`checkpoint`, `restore`, …,
        not sandboxes or gofers): at start-up, ones a server that died had started."""
        me, found = os.getpid(), []
        root_flag = f"--root={self.runsc.root}"
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == me:
                continue
            argv = _cmdline(int(d.name))
            if argv and root_flag in argv and argv[0] not in _DAEMONS:
                found.append(int(d.name))
        return found

    async def wait_for_commands(self, time_limit: float = 30.0) -> None:
        """Lets the runsc commands a crashed server left finish (a checkpoint that ends its
        sandbox, a restore that starts one) so what follows sees the host as they leave it;
        kills those still running after `time_limit` seconds."""
        pids = await asyncio.to_thread(self.commands)
        if not pids:
            return
        log.info("waiting for %d runsc commands of an earlier run", len(pids))
        if not await _proc.wait_exited(pids, time_limit):
            for p in await asyncio.to_thread(self.commands):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            await _proc.wait_exited(pids, 5.0)

    def kill_strays(self, keep: set[str]) -> int:
        """At start-up: SIGKILLs every runsc process of this node's root that belongs to no
        container in `keep` — e.g. a `runsc restore` a crash cut short, whose sandbox has no
        pid in its state file yet and would otherwise spin on in a slot the node reuses.
        Returns how many it killed."""
        flag = f"--root={self.runsc.root}"
        me = os.getpid()
        killed = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            argv = _cmdline(int(entry))
            if flag not in argv or any(cid in a for a in argv for cid in keep):
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), signal.SIGKILL)
                killed += 1
        return killed

    async def kill_all(self, cids: list[str]) -> None:
        """SIGKILLs the containers' sandbox processes and waits (briefly) until they and
        their gofers are dead, so their mounts and netns can go; reaping may come later."""
        pids: list[int] = []
        for cid in cids:
            await asyncio.to_thread(self.unfreeze, cid)
            pid, gofer = self.runsc.read_pids(cid)
            if pid > 0 and self.is_our_sandbox(pid, cid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                pids += [p for p in (pid, gofer) if p > 0]
        deadline = time.monotonic() + 5.0
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if not _proc.settled(p)]
            if pids:
                await asyncio.sleep(0.02)

    async def delete_all(self, cids: list[str]) -> None:
        """Kills and deletes containers (concurrently, a few at a time)."""
        sem = asyncio.Semaphore(8)

        async def one(cid: str) -> None:
            async with sem:
                await asyncio.to_thread(self.unfreeze, cid)
                pid, gofer = self.runsc.read_pids(cid)
                if pid > 0 and self.is_our_sandbox(pid, cid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                # Reaped first, or `runsc delete` waits for init to reap them (children of
                # this process only when it started them: not after a restart).
                children = [p for p in (pid, gofer) if p > 0 and is_runsc_child(p)]
                if children:
                    await _proc.wait_exited(children, 5.0)
                await self.runsc.delete(cid)

        await gather_quiet(*(one(c) for c in cids))
        await asyncio.to_thread(_proc.reap_adopted)


# A running container's own processes (argv[0] as runsc sets it).
_DAEMONS = ("runsc-sandbox", "runsc-gofer")


def is_runsc_child(pid: int) -> bool:
    """A runsc process (sandbox, gofer) this process adopted, e.g. already a zombie."""
    st = _proc.proc_stat(pid)
    return st is not None and st.ppid == os.getpid() and st.comm == _proc.RUNSC_COMM


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]
