"""``sudo`` for gVisor sandboxes: the client side of envd's privileged exec service.

gVisor sets ``PR_SET_NO_NEW_PRIVS`` on every process, so a setuid ``sudo`` never gains
privileges. Instead, the image's ``/usr/bin/sudo`` is a ``/bin/sh`` wrapper
(:data:`SHIM_SCRIPT`) that runs this module with envd's bundled interpreter; it parses
sudo's command line and asks envd (PID 1, root) over a unix socket to run the command. envd
checks the caller's credentials (SCM_CREDENTIALS, verified by the kernel: uid 0 or a member
of group sudo/wheel/admin), builds the
environment the way sudo does (env_reset, secure_path, SUDO_*), starts the command as the
target user on the caller's stdin/stdout/stderr (passed with SCM_RIGHTS) and reports its
exit status. See ``sudo_service`` and the README for the protocol.

When stdin and stdout are a terminal and we are in its foreground process group, the
command gets a new pseudo-terminal (as sudo's ``use_pty``): this client allocates it, puts
the caller's terminal in raw mode and relays bytes and window size, so ``sudo bash`` is a
full interactive shell with job control (the command cannot join the caller's session:
envd's children live in sessions of envd's).

Standard library only, relative imports only, small imports: it starts on every ``sudo``.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import struct
import sys
from typing import Any

from .sudo_args import HELP, USAGE, VERSION, Options, UsageError, parse_args
from .sudo_protocol import (
    PROTOCOL,
    SCM_CREDENTIALS,
    SECURE_PATH,
    FrameError,
    encode_frame,
    socket_path,
    take_frames,
)
from .sudo_tty import Terminal, foreground, write_all

# What the image's /usr/bin/sudo becomes (Debian's binary is diverted to sudo.distrib).
SHIM_SCRIPT = """\
#!/bin/sh
# aenv: sudo for gVisor sandboxes. gVisor sets no_new_privs on every process, so the setuid
# sudo (diverted to /usr/bin/sudo.distrib) cannot become root; this asks envd (PID 1, root)
# over /run/aenv/sudo.sock instead. Code: aenv_envd/sudo.py in the runtime bundle.
b=/opt/aenv
case "$0" in */sudoedit | sudoedit) set -- -e "$@" ;; esac
if [ -x "$b/bin/python3" ] && [ -d "$b/app/aenv_envd" ]; then
    PYTHONHOME=$b PYTHONPATH=$b/app PYTHONUTF8=1 PYTHONCOERCECLOCALE=0
    export PYTHONHOME PYTHONPATH PYTHONUTF8 PYTHONCOERCECLOCALE
    exec "$b/lib/ld-linux-x86-64.so.2" --library-path "$b/lib" "$b/bin/python3" -s -P \\
        -m aenv_envd.sudo "$@"
fi
# Not in an aenv sandbox: the real sudo.
if [ -x /usr/bin/sudo.distrib ]; then
    exec /usr/bin/sudo.distrib "$@"
fi
echo "sudo: the aenv runtime is not mounted at $b" >&2
exit 1
"""

# Signals relayed to the command (SIGWINCH only without a pty of our own).
RELAYED = (
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGTERM,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
    signal.SIGWINCH,
)
# A command killed by one of these: kill ourselves with it too (as sudo does), so a shell
# sees the same status (128+n) and, for SIGINT, stops its loop.
RERAISE = {
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGKILL,
    signal.SIGPIPE,
    signal.SIGALRM,
    signal.SIGUSR1,
    signal.SIGUSR2,
}


# --- talking to envd ------------------------------------------------------------------------


class ServiceError(Exception):
    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _err(msg: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, (msg.rstrip("\n") + "\n").encode(errors="replace"))


def _connect() -> socket.socket:
    path = socket_path()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.connect(path)
    except OSError as e:
        sock.close()
        raise ServiceError(
            f"sudo: cannot reach the sandbox's privilege service at {path}: {e.strerror or e}"
        ) from None
    return sock


def _request(o: Options, op: str, tty: bool) -> dict[str, Any]:
    try:
        cwd: str | None = os.getcwd()
    except OSError:
        cwd = None
    mask = os.umask(0o022)
    os.umask(mask)
    return {
        "v": PROTOCOL,
        "op": op,
        "argv": o.command,
        "env": dict(os.environ),
        "cwd": cwd,
        "chdir": o.chdir,
        "user": o.user,
        "group": o.group,
        "login": o.login,
        "shell": o.shell,
        "preserve_env": o.preserve_env,
        "keep": o.keep,
        "set_home": o.set_home,
        "assign": o.assign,
        "tty": tty,
        "umask": mask,
    }


def _send(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    """The request with our credentials (SCM_CREDENTIALS: the kernel refuses ids that are
    not ours, and envd trusts nothing else) and the command's fds (SCM_RIGHTS)."""
    creds = struct.pack("3i", os.getpid(), os.getuid(), os.getgid())
    anc = [(socket.SOL_SOCKET, SCM_CREDENTIALS, creds)]
    if fds:
        anc.append((socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds)))
    sent = sock.sendmsg([data], anc)
    if sent < len(data):
        sock.sendall(data[sent:])


def _recv_one(sock: socket.socket) -> dict[str, Any]:
    buf = bytearray()
    while True:
        frames = take_frames(buf)
        if frames:
            return frames[0]
        chunk = sock.recv(65536)
        if not chunk:
            raise ServiceError("sudo: the sandbox's privilege service closed the connection")
        buf += chunk


def _check(o: Options) -> dict[str, Any]:
    sock = _connect()
    try:
        _send(sock, encode_frame(_request(o, "check", False)), [])
        reply = _recv_one(sock)
    finally:
        sock.close()
    if "error" in reply:
        raise ServiceError(str(reply["error"]), int(reply.get("exit") or 1))
    return reply


def _which(cmd: str) -> str | None:
    if "/" in cmd:
        return os.path.abspath(cmd) if os.path.isfile(cmd) else None
    for d in SECURE_PATH.split(":"):
        p = os.path.join(d, cmd)
        if os.path.isfile(p) and os.access(p, os.X_OK, effective_ids=False):
            return p
    return None


def _list(o: Options) -> int:
    reply = _check(o)
    if o.command:
        path = _which(o.command[0])
        if path is None:
            return 1
        sys.stdout.write(" ".join([path, *o.command[1:]]) + "\n")
        return 0
    sys.stdout.write(
        f"User {reply.get('user')} may run the following commands on {reply.get('host')}:\n"
        "    (ALL : ALL) NOPASSWD: ALL\n"
    )
    return 0


# --- running a command ---------------------------------------------------------------------


def _open_std_fds() -> None:
    """/dev/null for a closed stdin/stdout/stderr (`sudo x <&-`), before any fd of ours
    could take its number."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free number: `fd`


class _Runner:
    def __init__(self, o: Options) -> None:
        self.o = o
        self.pending: list[int] = []
        self.wake_r, self.wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.term: Terminal | None = None
        self.to_master = bytearray()
        self.stdin_open = False
        self.master_open = False
        self.started = False

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.pending.append(signum)

    def run(self) -> int:
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        for sig in (*RELAYED, signal.SIGTSTP):
            signal.signal(sig, self._on_signal)
        # A caller that blocked them (a mask is inherited across exec) would leave them
        # pending here forever: the command would never get them.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [*RELAYED, signal.SIGTSTP])
        sock = _connect()
        try:
            use_pty = os.isatty(0) and os.isatty(1) and foreground()
            fds = [0, 1, 2]
            if use_pty:
                try:
                    self.term = Terminal()
                except OSError:
                    self.term = None
            if self.term is not None:
                s = self.term.slave
                fds = [s, s, s if os.isatty(2) else 2]
                self.stdin_open = self.master_open = True
            try:
                _send(sock, encode_frame(_request(self.o, "run", self.term is not None)), fds)
            finally:
                if self.term is not None:
                    os.close(self.term.slave)
            return self._loop(sock)
        finally:
            sock.close()
            if self.term is not None:
                self.term.restore()
                os.close(self.term.master)

    def _loop(self, sock: socket.socket) -> int:
        buf = bytearray()
        poller = select.poll()
        while True:
            # (re)build the poll set
            for fd in (sock.fileno(), self.wake_r, 0, *([self.term.master] if self.term else [])):
                with contextlib.suppress(KeyError):
                    poller.unregister(fd)
            poller.register(sock.fileno(), select.POLLIN)
            poller.register(self.wake_r, select.POLLIN)
            if self.term is not None:
                if self.stdin_open and not self.to_master and self.term.raw:
                    poller.register(0, select.POLLIN)
                if self.master_open:
                    ev = select.POLLIN | (select.POLLOUT if self.to_master else 0)
                    poller.register(self.term.master, ev)
            try:
                events = poller.poll()
            except InterruptedError:
                events = []
            # signals first: a resize must reach the pty before the input typed after it
            self._handle_signals(sock)
            for fd, ev in events:
                if fd == sock.fileno():
                    chunk = sock.recv(65536)
                    if not chunk:
                        raise ServiceError(
                            "sudo: lost the connection to the sandbox's privilege service"
                        )
                    buf += chunk
                    for msg in take_frames(buf):
                        code = self._on_message(msg)
                        if code is not None:
                            return code
                elif fd == self.wake_r:
                    with contextlib.suppress(OSError):
                        while os.read(self.wake_r, 512):
                            pass
                elif fd == 0:
                    self._stdin_readable()
                elif self.term is not None and fd == self.term.master:
                    if ev & select.POLLOUT:
                        self._flush_master()
                    if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                        self._master_readable()

    def _on_message(self, msg: dict[str, Any]) -> int | None:
        if "error" in msg:
            raise ServiceError(str(msg["error"]), int(msg.get("exit") or 1))
        if "started" in msg:
            self.started = True
            return None
        if "exit" in msg:
            self._drain_master()
            if self.term is not None:
                self.term.restore()
            sig = msg.get("signal")
            if isinstance(sig, int) and sig in RERAISE:
                sys.stdout.flush()
                signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
                os.kill(os.getpid(), sig)
            return int(msg["exit"])
        return None

    def _handle_signals(self, sock: socket.socket) -> None:
        while self.pending:
            sig = self.pending.pop(0)
            if sig == signal.SIGTSTP:
                self._suspend(sock)
            elif sig == signal.SIGWINCH and self.term is not None:
                self.term.copy_winsize()
                # Linux signals the pty's foreground group itself; gVisor does not (and
                # does not say which group that is): envd signals the command's session
                try:
                    os.tcgetpgrp(self.term.master)
                except OSError:
                    with contextlib.suppress(OSError):
                        sock.sendall(encode_frame({"winch": True}))
            else:
                self._relay(sock, sig)

    def _relay(self, sock: socket.socket, sig: int) -> None:
        with contextlib.suppress(OSError):
            sock.sendall(encode_frame({"signal": int(sig)}))

    def _suspend(self, sock: socket.socket) -> None:
        """^Z (or SIGTSTP): stop the command, then ourselves; continue both on SIGCONT."""
        self._relay(sock, signal.SIGSTOP)
        if self.term is not None:
            self.term.restore()
        os.kill(os.getpid(), signal.SIGSTOP)
        # continued
        if self.term is not None:
            self.term.reraw()
        self._relay(sock, signal.SIGCONT)

    def _stdin_readable(self) -> None:
        assert self.term is not None
        try:
            data = os.read(0, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.stdin_open = False
            return
        self.to_master += data
        self._flush_master()

    def _flush_master(self) -> None:
        assert self.term is not None
        while self.to_master:
            try:
                n = os.write(self.term.master, self.to_master)
            except BlockingIOError:
                return
            except OSError:
                self.to_master.clear()
                return
            del self.to_master[:n]

    def _master_readable(self) -> bool:
        """Copies what the pty has to our terminal; False at its end."""
        assert self.term is not None
        try:
            data = os.read(self.term.master, 65536)
        except BlockingIOError:
            return True
        except OSError:  # EIO: every slave fd is closed
            data = b""
        if not data:
            self.master_open = False
            return False
        if not write_all(1, data):
            self.master_open = False
            return False
        return True

    def _drain_master(self) -> None:
        """After the command's exit: what it wrote last (a background child holding the pty
        open does not keep us waiting for more than a moment)."""
        if self.term is None or not self.master_open:
            return
        idle = 0
        for _ in range(400):
            r, _, _ = select.select([self.term.master], [], [], 0.02)
            if not r:
                idle += 1
                if idle >= 3:
                    return
                continue
            idle = 0
            if not self._master_readable():
                return


# --- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    _open_std_fds()
    args = sys.argv[1:] if argv is None else argv
    try:
        o = parse_args(args)
    except UsageError as e:
        msg = str(e)
        if msg:
            _err(f"sudo: {msg}")
        if e.show_usage:
            sys.stderr.write(USAGE)
        return 1
    if o.mode == "help":
        sys.stdout.write(HELP)
        return 0
    if o.mode == "version":
        sys.stdout.write(
            f"Sudo version {VERSION}\n"
            "aenv sandbox sudo: commands are run by envd (no setuid under gVisor)\n"
        )
        return 0
    if o.mode == "kill":
        return 0
    try:
        if o.mode == "validate":
            _check(o)
            return 0
        if o.mode == "list":
            return _list(o)
        return _Runner(o).run()
    except ServiceError as e:
        _err(str(e))
        return e.code
    except FrameError as e:
        _err(f"sudo: protocol error: {e}")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    code = main()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(code)
