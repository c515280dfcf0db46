"""Run host commands (runsc, ip, iptables, mount) without blocking the event loop, and reap
the runsc processes this process adopts."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from aenv.errors import RuntimeFailure
from aenv.runtime import priority

log = logging.getLogger("aenv.runtime")


@dataclass
class Completed:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def _describe(argv: Sequence[str]) -> str:
    text = " ".join(argv)
    return text if len(text) <= 200 else text[:200] + "…"


def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


async def run(
    argv: Sequence[str],
    *,
    input: str | bytes | None = None,
    time_limit: float | None = 60.0,
    check: bool = True,
    cwd: str | os.PathLike[str] | None = None,
    what: str | None = None,
) -> Completed:
    """Runs `argv` with captured stdout/stderr; raises `RuntimeFailure` (with stderr) on failure.

    Only for commands that exit on their own: a command that leaves a daemon holding the pipes
    (`runsc run --detach`) must go through `run_detached`."""
    argv = [str(a) for a in argv]
    what = what or _describe(argv)
    data = input.encode() if isinstance(input, str) else input
    t0 = time.perf_counter()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if data is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=cwd,
            start_new_session=True,
        )
    except OSError as e:
        raise RuntimeFailure(f"cannot run {argv[0]}: {e}") from e
    priority.as_work(proc.pid)
    try:
        out, err = await asyncio.wait_for(proc.communicate(data), time_limit)
    except TimeoutError:
        _kill(proc)
        raise RuntimeFailure(f"{what}: timed out after {time_limit}s") from None
    except BaseException:
        _kill(proc)
        raise
    res = Completed(
        argv,
        proc.returncode if proc.returncode is not None else -1,
        out.decode(errors="replace"),
        err.decode(errors="replace"),
        time.perf_counter() - t0,
    )
    log.debug("%s -> %d in %.1f ms", _describe(argv), res.returncode, res.seconds * 1000)
    if check and res.returncode != 0:
        msg = res.stderr.strip() or res.stdout.strip() or f"exit status {res.returncode}"
        raise RuntimeFailure(f"{what}: {msg}")
    return res


async def run_detached(
    argv: Sequence[str],
    *,
    output: Path,
    time_limit: float | None = 120.0,
    what: str | None = None,
) -> Completed:
    """Runs a command that leaves daemons behind (`runsc run/restore --detach`).

    stdin is /dev/null and stdout/stderr go to `output` (appended), never to pipes: the
    daemons inherit them and would keep a pipe open forever. On failure the tail of `output`
    becomes the error message."""
    argv = [str(a) for a in argv]
    what = what or _describe(argv)
    t0 = time.perf_counter()
    f, offset = await asyncio.to_thread(_open_append, output)
    with f:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=f,
                stderr=f,
                start_new_session=True,
            )
        except OSError as e:
            raise RuntimeFailure(f"cannot run {argv[0]}: {e}") from e
        priority.as_work(proc.pid)
    try:
        rc = await asyncio.wait_for(proc.wait(), time_limit)
    except TimeoutError:
        _kill(proc)
        raise RuntimeFailure(f"{what}: timed out after {time_limit}s") from None
    except BaseException:
        _kill(proc)
        raise
    seconds = time.perf_counter() - t0
    log.debug("%s -> %d in %.1f ms", _describe(argv), rc, seconds * 1000)
    if rc != 0:
        msg = await asyncio.to_thread(_tail, output, offset)
        raise RuntimeFailure(f"{what}: {msg or f'exit status {rc}'}")
    return Completed(argv, rc, "", "", seconds)


def _open_append(path: Path) -> tuple[BinaryIO, int]:
    f = path.open("ab")
    return f, f.tell()


def _tail(path: Path, offset: int, limit: int = 4000) -> str:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return ""
    return data[-limit:].decode(errors="replace").strip()


# Child processes adopted as a subreaper ------------------------------------------------------
#
# `runsc run/restore --detach` leaves the sandbox and gofer processes (and the sandbox's
# systrap stubs) orphaned. Their exit must be reaped before `runsc delete` returns: it polls
# `kill(pid, 0)` every 100 ms for up to 5 s, and a zombie still answers. Under a lazy init
# (this VM's PID 1 reaps every 1-2 s) that makes deleting even a stopped container take
# 1-2 s. As a child subreaper this process adopts those orphans and reaps them itself, by pid
# and only runsc's (never `waitpid(-1)`, which would steal the exit status of asyncio's
# children): runsc re-executes itself through /proc/self/exe, so its sandbox, gofer and stub
# processes are named `exe`, and nothing else this process starts is.

PR_SET_CHILD_SUBREAPER = 36
RUNSC_COMM = "exe"


@dataclass(frozen=True)
class ProcStat:
    state: str
    ppid: int
    session: int
    threads: int
    comm: str

    @property
    def dead(self) -> bool:
        """A zombie whose every thread has exited (a zombie leader may still have threads)."""
        return self.state in ("Z", "X") and self.threads <= 1


def become_subreaper(on: bool = True) -> bool:
    """Makes this process the reaper of its orphaned descendants (Linux >= 3.4), or with
    `on=False` no longer."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def proc_stat(pid: int) -> ProcStat | None:
    """A process's /proc/<pid>/stat, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    head, _, tail = data.rpartition(b")")
    fields = tail.split()
    try:
        return ProcStat(
            state=fields[0].decode(),
            ppid=int(fields[1]),
            session=int(fields[3]),
            threads=int(fields[17]),
            comm=head.partition(b"(")[2].decode(errors="replace"),
        )
    except (IndexError, ValueError):
        return None


def settled(pid: int) -> bool:
    """True when `pid` no longer runs: gone, reaped now (a runsc child of ours), or a dead
    zombie someone else must reap. Sync, non-blocking."""
    st = proc_stat(pid)
    if st is None:
        return True
    if st.ppid == os.getpid() and st.comm == RUNSC_COMM:
        try:
            return os.waitpid(pid, os.WNOHANG)[0] == pid
        except ChildProcessError:
            return True
    return st.dead


def reap(pids: Iterable[int]) -> None:
    """Reaps those of `pids` that are exited runsc children of this process."""
    for pid in pids:
        if pid > 0:
            settled(pid)


MNT_DETACH = 2
# mount(8) options that are mount(2) flags rather than the filesystem's own.
_MOUNT_FLAGS = {"ro": 1, "nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024}


def mount(source: str, target: str, fstype: str, options: str) -> int:
    """mount(2) with mount(8)-style comma-separated `options`, without starting the mount
    program; returns 0 or the errno. Sync."""
    flags = 0
    data = []
    for opt in options.split(","):
        if opt in _MOUNT_FLAGS:
            flags |= _MOUNT_FLAGS[opt]
        elif opt:
            data.append(opt)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [
        ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p,
    ]  # fmt: skip
    rc = int(
        libc.mount(
            source.encode(), target.encode(), fstype.encode(), flags, ",".join(data).encode()
        )
    )
    return 0 if rc == 0 else ctypes.get_errno()


def umount(target: str, *, lazy: bool = False) -> int:
    """umount2(2) without starting the umount program; returns 0 or the errno. Sync."""
    libc = ctypes.CDLL(None, use_errno=True)
    rc = int(libc.umount2(target.encode(), MNT_DETACH if lazy else 0))
    return 0 if rc == 0 else ctypes.get_errno()


def children(proc: str = "/proc/self") -> list[int] | None:
    """The pids of a process's children, its adopted orphans included (each thread's
    `task/<tid>/children`); None where the kernel has no such file (CONFIG_PROC_CHILDREN)."""
    out: list[int] = []
    try:
        tids = os.listdir(f"{proc}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"{proc}/task/{tid}/children", "rb") as f:
                out.extend(int(p) for p in f.read().split())
        except FileNotFoundError:
            if not out and tid == tids[0]:
                return None  # no such file at all: not this kernel
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
    return out


def reap_adopted() -> int:
    """Reaps every exited runsc process adopted by this process (stubs of dead sandboxes,
    sandboxes that died on their own); returns how many. Reads its children's /proc entries
    only (a node with hundreds of sandboxes has thousands of processes: a scan of all of
    them, every few seconds and at each destroy, held the GIL for tens of ms)."""
    me = os.getpid()
    pids = children()
    if pids is None:
        with contextlib.suppress(OSError):
            pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    found = []
    for pid in pids or ():
        st = proc_stat(pid)
        if st is not None and st.ppid == me and st.comm == RUNSC_COMM and st.dead:
            found.append(pid)
    reap(found)
    return len(found)


async def wait_exited(pids: Iterable[int], time_limit: float) -> bool:
    """Waits until every pid has exited, reaping those that are runsc children. Woken by
    each process's pidfd as it exits (a poll's back-off added up to tens of ms to every
    stop); polls only for a pid the kernel gives no pidfd for. Returns False when one still
    runs after `time_limit` seconds."""
    todo = {p for p in pids if p > 0 and not settled(p)}
    if not todo:
        return True
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + time_limit
    woken = asyncio.Event()
    fds: dict[int, int] = {}
    try:
        for p in todo:
            with contextlib.suppress(OSError):  # gone already, or no pidfds here
                fds[p] = os.pidfd_open(p)
                loop.add_reader(fds[p], woken.set)
        delay = 0.002
        while True:
            for p in [p for p in todo if settled(p)]:
                todo.discard(p)
                if p in fds:
                    loop.remove_reader(fds[p])
                    os.close(fds.pop(p))
            if not todo:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            woken.clear()
            wait = left if len(fds) == len(todo) else min(left, delay)
            delay = min(delay * 2, 0.05)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), wait)
    finally:
        for fd in fds.values():
            loop.remove_reader(fd)
            os.close(fd)
