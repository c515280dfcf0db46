"""One child process of envd: its output read from non-blocking fds on the event loop and
fanned out to every subscriber in the order it was read per fd (a slow subscriber pauses
reading instead of buffering without bound), ordered writes to its stdin or PTY, and its exit
status, collected by one ``waitpid(pid)`` thread (pidfd_open is not implemented in gVisor
20240729, and a thread blocked in waitpid survives checkpoint/restore).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import deque
from collections.abc import Callable
from typing import Any

from . import journal
from .rpc import Msg, RPCError, b64e

READ_CHUNK = 64 * 1024
HIGH_WATER = 8 * 1024 * 1024  # pause reading when a subscriber has this much queued
LOW_WATER = 1 * 1024 * 1024
EXIT_GRACE = 0.2  # after exit, wait this long for EOF on output fds

SIGNAL_NAMES = {
    1: "hangup",
    2: "interrupt",
    3: "quit",
    4: "illegal instruction",
    5: "trace/breakpoint trap",
    6: "aborted",
    7: "bus error",
    8: "floating point exception",
    9: "killed",
    10: "user defined signal 1",
    11: "segmentation fault",
    12: "user defined signal 2",
    13: "broken pipe",
    14: "alarm clock",
    15: "terminated",
}


class Subscriber:
    """One consumer of a process's events (a Start or Connect stream)."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc
        self.items: deque[tuple[Msg, int]] = deque()
        self.pending = 0
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False

    def push(self, ev: Msg, size: int) -> None:
        self.items.append((ev, size))
        self.pending += size
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self) -> Msg:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        ev, size = self.items.popleft()
        if size:
            self.pending -= size
            self.proc.maybe_resume()
        return ev


class Proc:
    def __init__(
        self, forget: Callable[[int], object], config: Msg, tag: str | None, pty: bool
    ) -> None:
        # Called with the pid once the process is gone and its output drained.
        self.forget = forget
        self.loop = asyncio.get_running_loop()
        self.config = config
        self.tag = tag
        self.is_pty = pty
        self.pid = 0
        self.popen: Any = None
        self.out_fds: dict[int, str] = {}  # fd -> "stdout" | "stderr" | "pty"
        self.reading: set[int] = set()
        self.stdin_fd: int | None = None
        self.pty_fd: int | None = None
        self.subs: set[Subscriber] = set()
        self.paused = False
        self.status: int | None = None  # raw wait status
        self.finished = asyncio.Event()
        self.eof = asyncio.Event()
        self.writers: dict[int, FdWriter] = {}
        self._finish_task: asyncio.Future[None] | None = None

    # -- output ---------------------------------------------------------------

    def subscribe(self) -> Subscriber:
        sub = Subscriber(self)
        self.subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        sub.closed = True
        self.subs.discard(sub)
        self.maybe_resume()

    def _publish(self, kind: str, data: bytes) -> None:
        if not self.subs:
            return
        ev: Msg = {"event": {"data": {kind: b64e(data)}}}
        for sub in self.subs:
            sub.push(ev, len(data))
            if sub.pending > HIGH_WATER:
                self._pause()

    def _pause(self) -> None:
        if self.paused:
            return
        self.paused = True
        for fd in self.reading:
            self.loop.remove_reader(fd)

    def maybe_resume(self) -> None:
        if not self.paused or any(s.pending > LOW_WATER for s in self.subs):
            return
        self.paused = False
        for fd in self.reading:
            self.loop.add_reader(fd, self._on_readable, fd)

    def start_reading(self) -> None:
        for fd in self.out_fds:
            os.set_blocking(fd, False)
            self.reading.add(fd)
            self.loop.add_reader(fd, self._on_readable, fd)

    def _close_out(self, fd: int) -> None:
        if fd in self.reading:
            self.reading.discard(fd)
            self.loop.remove_reader(fd)
        if fd in self.out_fds and fd != self.pty_fd:
            self.out_fds.pop(fd)
            os.close(fd)
        elif fd == self.pty_fd:
            self.out_fds.pop(fd, None)
        if not self.reading:
            self.eof.set()

    def _on_readable(self, fd: int) -> None:
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:  # EIO on a PTY master once the slave side is gone
            data = b""
        if not data:
            self._close_out(fd)
            return
        self._publish(self.out_fds[fd], data)

    def _drain_all(self) -> None:
        """Read whatever is left in the output fds, then close them."""
        for fd in list(self.out_fds):
            while True:
                try:
                    data = os.read(fd, READ_CHUNK)
                except (BlockingIOError, OSError):
                    break
                if not data:
                    break
                self._publish(self.out_fds[fd], data)
            self._close_out(fd)

    # -- lifecycle ----------------------------------------------------------

    def _on_exit(self, status: int) -> None:
        self.status = status
        if self.popen is not None:  # so subprocess never waits for it again
            self.popen.returncode = os.waitstatus_to_exitcode(status)
        self._finish_task = asyncio.ensure_future(self._finish())  # keep a reference

    async def _finish(self) -> None:
        if not self.eof.is_set() and not self.paused:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.eof.wait(), EXIT_GRACE)
        self.paused = False
        self._drain_all()
        self.forget(self.pid)
        for w in self.writers.values():
            w.close()
        self.writers.clear()
        if self.stdin_fd is not None:
            close_quiet(self.stdin_fd)
            self.stdin_fd = None
        if self.pty_fd is not None:
            close_quiet(self.pty_fd)
            self.pty_fd = None
        end = self.end_event()
        journal.record(
            "info" if end.get("exitCode") == 0 else "warn",
            "process ended",
            pid=self.pid,
            cmd=self.config.get("cmd"),
            exitCode=end.get("exitCode"),
            status=end.get("status"),
        )
        ev = {"event": {"end": end}}
        for sub in self.subs:
            sub.push(ev, 0)
        self.finished.set()

    def end_event(self) -> Msg:
        st = self.status or 0
        if os.WIFEXITED(st):
            code = os.WEXITSTATUS(st)
            end: Msg = {"exitCode": code, "exited": True, "status": f"exit status {code}"}
            if code != 0:
                end["error"] = end["status"]
            return end
        sig = os.WTERMSIG(st) if os.WIFSIGNALED(st) else 0
        name = SIGNAL_NAMES.get(sig, f"signal {sig}")
        status = f"signal: {name}"
        if os.WIFSIGNALED(st) and os.WCOREDUMP(st):
            status += " (core dumped)"
        return {"exitCode": -1, "exited": False, "status": status, "error": status}

    def signal(self, sig: int) -> None:
        if self.status is not None:
            return
        # the whole process group (setsid made it pid), then the process itself
        # in case it moved to another group
        with contextlib.suppress(OSError):
            os.killpg(self.pid, sig)
        with contextlib.suppress(OSError):
            os.kill(self.pid, sig)

    def info(self) -> Msg:
        out: Msg = {"config": self.config, "pid": self.pid}
        if self.tag is not None:
            out["tag"] = self.tag
        return out

    async def write_input(self, fd: int | None, data: bytes) -> None:
        if fd is None:
            raise RPCError("failed_precondition", "process has no stdin")
        w = self.writers.get(fd)
        if w is None:
            w = self.writers[fd] = FdWriter(self.loop, fd)
        await w.write(data)


class FdWriter:
    """Ordered, non-blocking writes to a pipe or PTY master."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        self.loop = loop
        self.fd = fd
        self.queue: deque[tuple[memoryview, asyncio.Future[None]]] = deque()
        self.watching = False
        self.closed = False
        os.set_blocking(fd, False)

    async def write(self, data: bytes) -> None:
        if self.closed:
            raise RPCError("failed_precondition", "input is closed")
        if not data:
            return
        fut = self.loop.create_future()
        self.queue.append((memoryview(data), fut))
        self._pump()
        await fut

    def _pump(self) -> None:
        while self.queue:
            view, fut = self.queue[0]
            try:
                n = os.write(self.fd, view)
            except BlockingIOError:
                n = 0
            except OSError as e:
                self.queue.popleft()
                if not fut.done():
                    fut.set_exception(RPCError("failed_precondition", f"write failed: {e}"))
                continue
            if n < len(view):
                self.queue[0] = (view[n:], fut)
                if not self.watching:
                    self.watching = True
                    self.loop.add_writer(self.fd, self._pump)
                return
            self.queue.popleft()
            if not fut.done():
                fut.set_result(None)
        if self.watching:
            self.watching = False
            self.loop.remove_writer(self.fd)

    def close(self) -> None:
        self.closed = True
        if self.watching:
            self.watching = False
            with contextlib.suppress(Exception):
                self.loop.remove_writer(self.fd)
        while self.queue:
            _, fut = self.queue.popleft()
            if not fut.done():
                fut.set_exception(RPCError("failed_precondition", "input closed"))


def close_quiet(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def wait_thread(loop: asyncio.AbstractEventLoop, proc: Proc, pid: int) -> None:
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            status = 0xFF00  # reaped by someone else: report exit status 255
            break
        except InterruptedError:
            continue
    with contextlib.suppress(RuntimeError):  # the loop is closed during shutdown
        loop.call_soon_threadsafe(proc._on_exit, status)
