"""``process.Process``: start, attach to, feed and signal processes.

Each process runs in its own session (``setsid``); PTY processes get the PTY as controlling
terminal. What happens to a process once started (output fan-out to the Start stream and any
Connect streams, input, exit) is ``child.Proc``'s.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
from typing import TYPE_CHECKING

from . import journal, vspawn
from .child import Proc, Subscriber, close_quiet, wait_thread
from .envrules import env_problem
from .rpc import Ctx, Method, Msg, RPCError, Send, as_bool, as_int, as_msg, as_str, b64d
from .terminal import notify_winch, set_winsize

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from .state import State

KEEPALIVE: Msg = {"event": {"keepalive": {}}}


def _pty_size(pty: Msg) -> tuple[int, int]:
    size = as_msg(pty.get("size"), "pty.size")
    cols = as_int(size.get("cols"), "cols", 80) or 80
    rows = as_int(size.get("rows"), "rows", 24) or 24
    return cols, rows


class ProcessManager:
    def __init__(self, state: State) -> None:
        self.state = state
        self.procs: dict[int, Proc] = {}

    def _forget(self, pid: int) -> None:
        self.procs.pop(pid, None)

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
        import subprocess

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
        problem = env_problem(envs, "process.envs")
        if problem:
            raise RPCError("invalid_argument", problem)
        cwd_in = pcfg.get("cwd")
        user = ctx.user
        try:
            cwd = self.state.workdir(user, as_str(cwd_in, "cwd") if cwd_in else None)
        except ValueError as e:
            raise RPCError("invalid_argument", f"cwd: {e}") from None
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
        proc = Proc(self._forget, config, tag, use_pty)
        sub = proc.subscribe()

        argv = [_shell_fallback(cmd), *args]
        root = os.getuid() == 0
        if not root and user.uid != os.getuid():
            raise RPCError("permission_denied", "envd is not root and cannot switch users")
        creds = vspawn.Credentials(user.uid, user.gid, tuple(user.groups)) if root else None

        child_fds: list[int] = []
        parent_fds: list[int] = []
        try:
            if use_pty:
                master, slave = os.openpty()
                parent_fds.append(master)
                child_fds.append(slave)
                cols, rows = _pty_size(as_msg(pty_msg, "pty"))
                set_winsize(master, cols, rows)
                stdin = stdout = stderr = slave
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
                    stdin = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                    child_fds.append(stdin)
            try:
                pid, popen = vspawn.start(
                    argv, env, cwd=cwd, fds=(stdin, stdout, stderr), ctty=use_pty, creds=creds
                )
            except FileNotFoundError as e:
                raise RPCError("invalid_argument", f"failed to start process: {e}") from None
            except PermissionError as e:
                raise RPCError("permission_denied", f"failed to start process: {e}") from None
            except OSError as e:
                # E2BIG: arguments and environment together past the kernel's bound.
                code = "invalid_argument" if e.errno == errno.E2BIG else "internal"
                raise RPCError(code, f"failed to start process: {e}") from None
            except ValueError as e:  # a NUL byte in cmd or args
                raise RPCError("invalid_argument", f"failed to start process: {e}") from None
            except subprocess.SubprocessError as e:
                raise RPCError("internal", f"failed to start process: {e}") from None
        except BaseException:
            for fd in parent_fds:
                close_quiet(fd)
            raise
        finally:
            for fd in child_fds:
                close_quiet(fd)

        proc.popen = popen
        proc.pid = pid
        if use_pty:
            proc.pty_fd = parent_fds[0]
            proc.out_fds[parent_fds[0]] = "pty"
        else:
            proc.out_fds[parent_fds[0]] = "stdout"
            proc.out_fds[parent_fds[1]] = "stderr"
            if want_stdin:
                proc.stdin_fd = parent_fds[2]
        self.procs[proc.pid] = proc
        journal.record(
            "info",
            "process started",
            pid=proc.pid,
            cmd=cmd,
            args=" ".join(args),
            user=user.name,
            cwd=cwd,
            tag=tag,
            pty="true" if use_pty else None,
        )
        proc.start_reading()
        threading.Thread(
            target=wait_thread,
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
            close_quiet(fd)
        return {}

    async def update(self, ctx: Ctx, msg: Msg) -> Msg:
        proc = self.find(msg.get("process"))
        pty = msg.get("pty")
        if pty is not None:
            if proc.pty_fd is None:
                raise RPCError("failed_precondition", "process has no pty")
            cols, rows = _pty_size(as_msg(pty, "pty"))
            try:
                set_winsize(proc.pty_fd, cols, rows)
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


def _shell_fallback(cmd: str) -> str:
    """The SDK runs every command as `/bin/bash -l -c ...` (as E2B's envd does); an image
    without bash (alpine, distroless-ish) runs it with `/bin/sh`, which takes `-l -c` too."""
    if cmd == "/bin/bash" and not os.path.exists(cmd) and os.path.exists("/bin/sh"):
        return "/bin/sh"
    return cmd
