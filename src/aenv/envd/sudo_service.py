"""The privileged exec service behind the sandbox's ``sudo`` (client: ``sudo.py``).

envd (root) listens on a unix socket inside the sandbox (``/run/aenv/sudo.sock``, mode 0666
in a root-owned 0755 directory; ``$AENV_ENVD_SUDO_SOCKET`` moves it, ``off`` disables it;
outside a sandbox, i.e. unless envd is PID 1 from the runtime bundle, it is off by default).
Per connection:

1. The client sends one frame (4-byte big-endian length + JSON object) and, with its
   first byte, its credentials (SCM_CREDENTIALS: pid, uid, gid; the kernel refuses ids
   the sender does not have) and three fds (SCM_RIGHTS): the command's stdin, stdout and
   stderr.
2. Allowed: uid 0 or a user whose groups (``/etc/passwd`` + ``/etc/group``, or the gid
   sent) include ``sudo``, ``wheel`` or ``admin``; sudoers is not parsed. Refused →
   ``{"error", "exit": 1}``. (Not SO_PEERCRED: runsc 20240729 answers it with the
   credentials of the listening process, i.e. root, whoever connected.)
3. envd starts the command as the target user (root by default) in a new session on the
   received fds (``tty``: fd 0 becomes its controlling terminal), replies
   ``{"started": pid}``, then relays ``{"signal": n}`` frames to the command's process
   group (``{"winch": true}``: SIGWINCH to the command's session, after the client resized
   the command's pty where the kernel does not signal it) and finally replies ``{"exit": code, "signal":
   n|null}`` (code 128+n when killed by signal n). If the client goes away first, the
   process group is SIGKILLed.

``{"op": "check"}`` requests (``sudo -v``/``-l``) carry no fds and get ``{"ok": true,
"user", "host"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import struct
import threading
from typing import TYPE_CHECKING, Any

from . import vspawn
from .httpserver import log
from .sudo_plan import Plan, Refused, authorize, plan
from .sudo_protocol import (
    PROTOCOL,
    SCM_CREDENTIALS,
    SO_PASSCRED,
    SOCKET_ENV,
    FrameError,
    encode_frame,
    take_frames,
)

if TYPE_CHECKING:
    from .state import State

REQUEST_TIMEOUT = 30.0
MAX_FDS = 3
ANC_SPACE = socket.CMSG_SPACE(MAX_FDS * 4) + socket.CMSG_SPACE(12)
# Relayed to the command on the client's request.
ALLOWED_SIGNALS = {
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGTERM,
    signal.SIGKILL,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
    signal.SIGWINCH,
    signal.SIGSTOP,
    signal.SIGCONT,
}


class SudoService:
    def __init__(self, state: State, path: str) -> None:
        self.state = state
        self.path = path
        self.sock: socket.socket | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.loop: asyncio.AbstractEventLoop | None = None

    # -- listening ------------------------------------------------------------------------

    def start(self) -> None:
        d = os.path.dirname(self.path) or "."
        os.makedirs(d, mode=0o755, exist_ok=True)
        st = os.lstat(d)
        if st.st_uid != os.geteuid():
            raise OSError(f"{d} is not owned by uid {os.geteuid()}")
        os.chmod(d, 0o755)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # stale, from before a restart
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_PASSCRED, 1)
            sock.bind(self.path)
            os.chmod(self.path, 0o666)
            sock.listen(64)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(sock.fileno(), self._accept)

    def close(self) -> None:
        if self.sock is None:
            return
        if self.loop is not None:
            with contextlib.suppress(Exception):
                self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        self.sock = None
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def _accept(self) -> None:
        assert self.sock is not None and self.loop is not None
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log(f"sudo: accept failed: {e}")
                return
            conn.setblocking(False)
            task = self.loop.create_task(self._serve(conn))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    # -- one connection ---------------------------------------------------------------------

    async def _serve(self, conn: socket.socket) -> None:
        fds: list[int] = []
        creds: list[tuple[int, int, int]] = []
        try:
            conn.setsockopt(socket.SOL_SOCKET, SO_PASSCRED, 1)
            buf = bytearray()
            try:
                req = await asyncio.wait_for(
                    self._read_request(conn, buf, fds, creds), REQUEST_TIMEOUT
                )
            except (TimeoutError, FrameError, ConnectionError, EOFError):
                return
            try:
                if not creds:
                    raise Refused("sudo: the request carries no credentials")
                pid, uid, gid = creds[0]
                authorize(self.state.users, uid, gid)
                if req.get("v") != PROTOCOL:
                    raise Refused(f"sudo: unsupported protocol version {req.get('v')!r}")
                op = req.get("op")
                if op == "check":
                    caller = self.state.users.by_uid(uid)
                    await self._send(
                        conn,
                        {
                            "ok": True,
                            "user": caller.name if caller else str(uid),
                            "host": socket.gethostname(),
                        },
                    )
                    return
                if op != "run":
                    raise Refused(f"sudo: bad request: unknown op {op!r}")
                if len(fds) != 3:
                    raise Refused("sudo: bad request: expected stdin, stdout and stderr fds")
                what = plan(self.state.users, req, uid, gid)
                child_pid, popen = self._spawn(what, fds)
            except Refused as e:
                await self._send(conn, {"error": str(e), "exit": 1})
                return
            finally:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                fds.clear()
            log(f"sudo: uid {uid} (pid {pid}) runs {what.argv[:8]!r} as uid {what.uid}")
            await self._supervise(conn, child_pid, popen, buf)
        except Exception as e:  # never take envd down
            log(f"sudo: connection failed: {e!r}")
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            conn.close()

    async def _read_request(
        self,
        conn: socket.socket,
        buf: bytearray,
        fds: list[int],
        creds: list[tuple[int, int, int]],
    ) -> dict[str, Any]:
        """The first frame; `fds` and `creds` get what came with its first byte."""
        assert self.loop is not None
        first = True
        while True:
            frames = take_frames(buf)
            if frames:
                return frames[0]  # frames after it (signals) are read later
            try:
                data, anc, flags, _ = conn.recvmsg(65536, ANC_SPACE, socket.MSG_CMSG_CLOEXEC)
            except (BlockingIOError, InterruptedError):
                await self._readable(conn)
                continue
            for level, kind, payload in anc:
                if level != socket.SOL_SOCKET:
                    continue
                if kind == socket.SCM_RIGHTS:
                    n = len(payload) // 4
                    fds.extend(struct.unpack(f"{n}i", payload[: n * 4]))
                elif kind == SCM_CREDENTIALS and first and len(payload) >= 12:
                    pid, uid, gid = struct.unpack("3i", payload[:12])
                    creds.append((pid, uid, gid))
            if flags & socket.MSG_CTRUNC or len(fds) > MAX_FDS:
                raise FrameError("too many fds")
            if not data:
                raise EOFError
            first = False
            buf += data

    async def _readable(self, conn: socket.socket) -> None:
        assert self.loop is not None
        fut: asyncio.Future[None] = self.loop.create_future()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        self.loop.add_reader(conn.fileno(), ready)
        try:
            await fut
        finally:
            self.loop.remove_reader(conn.fileno())

    async def _send(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        assert self.loop is not None
        with contextlib.suppress(OSError):
            await self.loop.sock_sendall(conn, encode_frame(msg))

    # -- running it -------------------------------------------------------------------------

    def _spawn(self, what: Plan, fds: list[int]) -> tuple[int, Any]:
        """(pid, the Popen when subprocess started it) of the planned command."""
        import subprocess

        try:
            return vspawn.start(
                what.argv,
                what.env,
                executable=what.executable,
                cwd=what.cwd,
                fds=(fds[0], fds[1], fds[2]),
                ctty=what.tty,
                creds=vspawn.Credentials(what.uid, what.gid, tuple(what.groups)),
                umask=what.umask,
            )
        except FileNotFoundError:
            raise Refused(f"sudo: {what.argv[0]}: command not found") from None
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            msg = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise Refused(f"sudo: unable to execute {what.executable}: {msg}") from None

    async def _supervise(self, conn: socket.socket, pid: int, popen: Any, buf: bytearray) -> None:
        assert self.loop is not None
        loop = self.loop
        exited: asyncio.Future[int] = loop.create_future()

        def on_exit(status: int) -> None:
            if not exited.done():
                exited.set_result(status)

        def wait() -> None:
            while True:
                try:
                    _, status = os.waitpid(pid, 0)
                    break
                except ChildProcessError:
                    status = 0xFF00
                    break
                except InterruptedError:
                    continue
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(on_exit, status)

        threading.Thread(target=wait, daemon=True, name=f"sudo-wait-{pid}").start()
        await self._send(conn, {"started": pid})
        relay = loop.create_task(self._relay(conn, pid, buf))
        try:
            waiting: set[asyncio.Future[Any]] = {exited, relay}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if not exited.done():  # the client is gone: so is the command
                _kill(pid, signal.SIGKILL)
                status = await exited
                if popen is not None:  # so subprocess never waits for it again
                    popen.returncode = os.waitstatus_to_exitcode(status)
                return
            status = exited.result()
            if popen is not None:
                popen.returncode = os.waitstatus_to_exitcode(status)
            if os.WIFSIGNALED(status):
                sig = os.WTERMSIG(status)
                await self._send(conn, {"exit": 128 + sig, "signal": sig})
            else:
                await self._send(conn, {"exit": os.WEXITSTATUS(status), "signal": None})
        finally:
            relay.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await relay

    async def _relay(self, conn: socket.socket, pid: int, buf: bytearray) -> None:
        """Signals from the client until it closes the connection."""
        assert self.loop is not None
        while True:
            for msg in take_frames(buf):
                sig = msg.get("signal")
                if isinstance(sig, int) and sig in ALLOWED_SIGNALS:
                    _kill(pid, sig)
                if msg.get("winch") is True:  # the client resized the command's pty
                    from .terminal import session_winch

                    session_winch(pid)  # the command is a session leader
            try:
                data = await self.loop.sock_recv(conn, 65536)
            except OSError:
                return
            if not data:
                return
            buf += data


def _kill(pid: int, sig: int) -> None:
    """The command's process group (it is a session leader), else the command itself."""
    try:
        os.killpg(pid, sig)
    except OSError:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def start_service(state: State, environ: dict[str, str] | None = None) -> SudoService | None:
    """Starts listening on ``$AENV_ENVD_SUDO_SOCKET`` (set by ``__main__`` in a sandbox;
    envd must be root); None when unset, ``off`` or impossible (logged)."""
    env = os.environ if environ is None else environ
    path = env.get(SOCKET_ENV, "")
    if not path or path.lower() in ("off", "0", "none", "disabled"):
        return None
    if os.geteuid() != 0:
        return None
    svc = SudoService(state, path)
    try:
        svc.start()
    except OSError as e:
        log(f"sudo: service not available at {path}: {e}")
        return None
    return svc
