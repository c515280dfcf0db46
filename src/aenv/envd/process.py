"""``process.Process``: start, attach to, feed and signal processes.

Each process runs in its own session (``setsid``); PTY processes get the PTY
as controlling terminal. Output is read from non-blocking fds on the event loop
and fanned out to every subscribed stream (the Start stream and any Connect
streams), in the order it was read per fd. A slow subscriber pauses reading
(backpressure) instead of buffering without bound. Exit statuses are collected
by one ``waitpid(pid)`` thread per process (pidfd_open is not implemented in
gVisor 20240729, and a thread blocked in waitpid survives checkpoint/restore).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from .rpc import Ctx, Method, Msg, RPCError, Send, as_bool, as_int, as_msg, as_str, b64d, b64e

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from .state import State

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

KEEPALIVE: Msg = {"event": {"keepalive": {}}}


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
    def __init__(self, mgr: ProcessManager, config: Msg, tag: str | None, pty: bool) -> None:
        self.mgr = mgr
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
        self.writers: dict[int, _FdWriter] = {}
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
        self.mgr.procs.pop(self.pid, None)
        for w in self.writers.values():
            w.close()
        self.writers.clear()
        if self.stdin_fd is not None:
            _close_quiet(self.stdin_fd)
            self.stdin_fd = None
        if self.pty_fd is not None:
            _close_quiet(self.pty_fd)
            self.pty_fd = None
        ev = {"event": {"end": self.end_event()}}
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
            w = self.writers[fd] = _FdWriter(self.loop, fd)
        await w.write(data)


class _FdWriter:
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


def _close_quiet(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _wait_thread(loop: asyncio.AbstractEventLoop, proc: Proc, pid: int) -> None:
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


def _set_ctty() -> None:  # runs in the child between fork and exec
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _set_winsize(fd: int, cols: int, rows: int) -> None:
    import fcntl
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def session_winch(sid: int) -> None:
    """SIGWINCH to every process group of session `sid` (the foreground one among them)."""
    pgrps: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            # after "pid (comm) ": state ppid pgrp session ...
            fields = stat[stat.rfind(b")") + 2 :].split()
            if int(fields[3]) == sid:
                pgrps.add(int(fields[2]))
        except (OSError, ValueError, IndexError):
            continue
    for pgrp in pgrps:
        with contextlib.suppress(OSError):
            os.killpg(pgrp, signal.SIGWINCH)


def notify_winch(master: int, sid: int) -> None:
    """After a resize on the master side, Linux signals the terminal's foreground process
    group; gVisor (20240729) does not, and cannot tell which group that is (TIOCGPGRP on a
    master is ENOTTY): then every group of the terminal's session gets SIGWINCH."""
    try:
        os.tcgetpgrp(master)
    except OSError:
        session_winch(sid)


def _pty_size(pty: Msg) -> tuple[int, int]:
    size = as_msg(pty.get("size"), "pty.size")
    cols = as_int(size.get("cols"), "cols", 80) or 80
    rows = as_int(size.get("rows"), "rows", 24) or 24
    return cols, rows


class ProcessManager:
    def __init__(self, state: State) -> None:
        self.state = state
        self.procs: dict[int, Proc] = {}

    def find(self, selector: object) -> Proc:
        sel = as_msg(selector, "process")
        if "pid" in sel:
            pid = as_int(sel["pid"], "pid")
            proc = self.procs.get(pid)
            if proc is None:
                raise RPCError("not_found", f"process with pid {pid} not found")
            return proc
        if "tag" in sel:
            tag = as_str(sel["tag"], "tag")
            for proc in self.procs.values():
                if proc.tag == tag:
                    return proc
            raise RPCError("not_found", f"process with tag {tag} not found")
        raise RPCError("invalid_argument", "process selector requires pid or tag")

    def spawn(self, ctx: Ctx, msg: Msg) -> tuple[Proc, Subscriber]:
        import fcntl  # noqa: F401  (pre-import for the PTY preexec hook)
        import subprocess
        import termios  # noqa: F401

        pcfg = as_msg(msg.get("process"), "process")
        cmd = as_str(pcfg.get("cmd"), "cmd")
        if not cmd:
            raise RPCError("invalid_argument", "process.cmd is required")
        args = pcfg.get("args") or []
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise RPCError("invalid_argument", "process.args must be a list of strings")
        envs = as_msg(pcfg.get("envs"), "process.envs")
        if not all(isinstance(v, str) for v in envs.values()):
            raise RPCError("invalid_argument", "process.envs values must be strings")
        cwd_in = pcfg.get("cwd")
        user = ctx.user
        cwd = self.state.workdir(user, as_str(cwd_in, "cwd") if cwd_in else None)
        if not os.path.isdir(cwd):
            raise RPCError("invalid_argument", f"cwd '{cwd}' does not exist")
        tag = msg.get("tag")
        tag = as_str(tag, "tag") if tag is not None else None
        pty_msg = msg.get("pty")
        use_pty = pty_msg is not None
        # envd compatibility: a request without "stdin" gets a stdin pipe;
        # an explicit false gives the child /dev/null.
        want_stdin = msg.get("stdin") is None or as_bool(msg.get("stdin"))
        env = self.state.process_env(user, envs)

        config: Msg = {"cmd": cmd, "args": list(args), "envs": dict(envs)}
        if cwd_in:
            config["cwd"] = cwd_in
        proc = Proc(self, config, tag, use_pty)
        sub = proc.subscribe()

        kw: dict[str, Any] = {}
        if os.getuid() == 0:
            if user.uid != 0 or user.gid != 0:
                kw.update(user=user.uid, group=user.gid, extra_groups=list(user.groups))
            else:
                kw.update(extra_groups=list(user.groups))
        elif user.uid != os.getuid():
            raise RPCError("permission_denied", "envd is not root and cannot switch users")

        child_fds: list[int] = []
        parent_fds: list[int] = []
        try:
            if use_pty:
                master, slave = os.openpty()
                parent_fds.append(master)
                child_fds.append(slave)
                cols, rows = _pty_size(as_msg(pty_msg, "pty"))
                _set_winsize(master, cols, rows)
                stdin: Any = slave
                stdout: Any = slave
                stderr: Any = slave
                kw["preexec_fn"] = _set_ctty
            else:
                out_r, out_w = os.pipe2(os.O_CLOEXEC)
                err_r, err_w = os.pipe2(os.O_CLOEXEC)
                parent_fds += [out_r, err_r]
                child_fds += [out_w, err_w]
                stdout, stderr = out_w, err_w
                if want_stdin:
                    in_r, in_w = os.pipe2(os.O_CLOEXEC)
                    parent_fds.append(in_w)
                    child_fds.append(in_r)
                    stdin = in_r
                else:
                    stdin = subprocess.DEVNULL
            try:
                popen = subprocess.Popen(
                    [cmd, *args],
                    stdin=stdin,
                    stdout=stdout,
                    stderr=stderr,
                    cwd=cwd,
                    env=env,
                    start_new_session=True,
                    close_fds=True,
                    **kw,
                )
            except FileNotFoundError as e:
                raise RPCError("invalid_argument", f"failed to start process: {e}") from None
            except PermissionError as e:
                raise RPCError("permission_denied", f"failed to start process: {e}") from None
            except (OSError, subprocess.SubprocessError) as e:
                raise RPCError("internal", f"failed to start process: {e}") from None
        except BaseException:
            for fd in parent_fds:
                _close_quiet(fd)
            raise
        finally:
            for fd in child_fds:
                _close_quiet(fd)

        proc.popen = popen
        proc.pid = popen.pid
        if use_pty:
            proc.pty_fd = parent_fds[0]
            proc.out_fds[parent_fds[0]] = "pty"
        else:
            proc.out_fds[parent_fds[0]] = "stdout"
            proc.out_fds[parent_fds[1]] = "stderr"
            if want_stdin:
                proc.stdin_fd = parent_fds[2]
        self.procs[proc.pid] = proc
        proc.start_reading()
        threading.Thread(
            target=_wait_thread,
            args=(proc.loop, proc, proc.pid),
            daemon=True,
            name=f"wait-{proc.pid}",
        ).start()
        return proc, sub

    # -- RPC handlers -------------------------------------------------------

    async def _pump(self, proc: Proc, sub: Subscriber, send: Send) -> None:
        try:
            await send({"event": {"start": {"pid": proc.pid}}})
            while True:
                ev = await sub.get()
                await send(ev)
                if "end" in ev["event"]:
                    return
        finally:
            proc.unsubscribe(sub)

    async def start(self, ctx: Ctx, msg: Msg, send: Send) -> None:
        proc, sub = self.spawn(ctx, msg)
        ctx.on_deadline.append(lambda: proc.signal(signal.SIGKILL))
        await self._pump(proc, sub, send)

    async def connect(self, ctx: Ctx, msg: Msg, send: Send) -> None:
        proc = self.find(msg.get("process"))
        sub = proc.subscribe()
        await self._pump(proc, sub, send)

    async def list(self, ctx: Ctx, msg: Msg) -> Msg:
        return {"processes": [p.info() for p in self.procs.values() if p.status is None]}

    async def send_input(self, ctx: Ctx, msg: Msg) -> Msg:
        proc = self.find(msg.get("process"))
        await self._input(proc, as_msg(msg.get("input"), "input"))
        return {}

    async def _input(self, proc: Proc, inp: Msg) -> None:
        if "pty" in inp:
            if proc.pty_fd is None:
                raise RPCError("failed_precondition", "process has no pty")
            await proc.write_input(proc.pty_fd, b64d(inp["pty"]))
        elif "stdin" in inp:
            if proc.is_pty:
                await proc.write_input(proc.pty_fd, b64d(inp["stdin"]))
            else:
                await proc.write_input(proc.stdin_fd, b64d(inp["stdin"]))

    async def stream_input(self, ctx: Ctx, msgs: AsyncIterator[Msg]) -> Msg:
        proc: Proc | None = None
        async for m in msgs:
            if "start" in m:
                proc = self.find(as_msg(m["start"], "start").get("process"))
            elif "data" in m:
                if proc is None:
                    raise RPCError("failed_precondition", "data before start")
                await self._input(proc, as_msg(as_msg(m["data"], "data").get("input"), "input"))
        return {}

    async def send_signal(self, ctx: Ctx, msg: Msg) -> Msg:
        proc = self.find(msg.get("process"))
        sig = msg.get("signal")
        names = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15}
        num = names.get(sig, 0) if isinstance(sig, str) else as_int(sig, "signal")
        if num not in (9, 15):
            raise RPCError("invalid_argument", f"unsupported signal {sig!r}")
        proc.signal(num)
        return {}

    async def close_stdin(self, ctx: Ctx, msg: Msg) -> Msg:
        proc = self.find(msg.get("process"))
        if proc.is_pty:
            if proc.pty_fd is not None:  # end-of-file for the terminal's reader
                await proc.write_input(proc.pty_fd, b"\x04")
            return {}
        fd = proc.stdin_fd
        if fd is not None:
            proc.stdin_fd = None
            w = proc.writers.pop(fd, None)
            if w is not None:
                w.close()
            _close_quiet(fd)
        return {}

    async def update(self, ctx: Ctx, msg: Msg) -> Msg:
        proc = self.find(msg.get("process"))
        pty = msg.get("pty")
        if pty is not None:
            if proc.pty_fd is None:
                raise RPCError("failed_precondition", "process has no pty")
            cols, rows = _pty_size(as_msg(pty, "pty"))
            try:
                _set_winsize(proc.pty_fd, cols, rows)
            except OSError as e:
                raise RPCError("internal", f"resize failed: {e}") from None
            notify_winch(proc.pty_fd, proc.pid)  # setsid: the session is the pid
        return {}

    def methods(self) -> dict[str, Method]:
        p = "/process.Process/"
        return {
            p + "Start": Method("server", self.start, KEEPALIVE),
            p + "Connect": Method("server", self.connect, KEEPALIVE),
            p + "List": Method("unary", self.list),
            p + "SendInput": Method("unary", self.send_input),
            p + "StreamInput": Method("client", self.stream_input),
            p + "SendSignal": Method("unary", self.send_signal),
            p + "CloseStdin": Method("unary", self.close_stdin),
            p + "Update": Method("unary", self.update),
        }
