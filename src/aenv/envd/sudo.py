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
import json
import os
import select
import signal
import socket
import struct
import sys
from typing import Any

SCM_CREDENTIALS = getattr(socket, "SCM_CREDENTIALS", 2)
SO_PASSCRED = getattr(socket, "SO_PASSCRED", 16)
SOCKET_ENV = "AENV_ENVD_SUDO_SOCKET"
DEFAULT_SOCKET = "/run/aenv/sudo.sock"
PROTOCOL = 1
MAX_FRAME = 16 * 1024 * 1024
SUDO_GROUPS = ("sudo", "wheel", "admin")
SECURE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
VERSION = "1.9.13p3"

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

USAGE = """\
usage: sudo -h | -K | -k | -V
usage: sudo -v [-AknS] [-g group] [-u user]
usage: sudo -l [-AknS] [-g group] [-u user] [command [arg ...]]
usage: sudo [-AEHkNnPS] [-C num] [-D directory] [-g group] [-p prompt] [-u user]
            [VAR=value] [-i | -s] [command [arg ...]]
"""

HELP = (
    "sudo - execute a command as another user (aenv sandbox edition: no password, "
    "commands are run by envd)\n\n"
    + USAGE
    + """
Options:
  -A, --askpass                 ignored (never prompts)
  -C, --close-from=num          ignored
  -D, --chdir=directory         change the working directory before running command
  -E, --preserve-env            preserve user environment when running command
      --preserve-env=list       preserve specific environment variables
  -g, --group=group             run command as the specified group name or ID
  -H, --set-home                set HOME variable to target user's home dir
  -h, --help                    display help message and exit
  -i, --login                   run login shell as the target user; a command may also be
                                specified
  -K, --remove-timestamp        no-op (there are no credentials to forget)
  -k, --reset-timestamp         no-op
  -l, --list                    list user's privileges or check a specific command
  -n, --non-interactive         non-interactive mode (always the case here)
  -P, --preserve-groups         ignored
  -p, --prompt=prompt           ignored
  -S, --stdin                   ignored (no password is read)
  -s, --shell                   run shell as the target user; a command may also be
                                specified
  -u, --user=user               run command as specified user name or ID
  -V, --version                 display version information and exit
  -v, --validate                check that the user may use sudo
  --                            stop processing command line arguments
"""
)

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


# --- framing (shared with sudo_service) --------------------------------------------------


def encode_frame(msg: dict[str, Any]) -> bytes:
    """A 4-byte big-endian length, then the UTF-8 JSON object."""
    data = json.dumps(msg, separators=(",", ":")).encode()
    return struct.pack(">I", len(data)) + data


class FrameError(Exception):
    pass


def take_frames(buf: bytearray) -> list[dict[str, Any]]:
    """Removes every complete frame from `buf` and returns them decoded."""
    out: list[dict[str, Any]] = []
    while len(buf) >= 4:
        (n,) = struct.unpack(">I", buf[:4])
        if n > MAX_FRAME:
            raise FrameError(f"frame too large ({n} bytes)")
        if len(buf) < 4 + n:
            break
        try:
            msg = json.loads(bytes(buf[4 : 4 + n]))
        except ValueError as e:
            raise FrameError(f"bad frame: {e}") from None
        del buf[: 4 + n]
        if not isinstance(msg, dict):
            raise FrameError("frame is not a JSON object")
        out.append(msg)
    return out


def socket_path() -> str:
    return os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


# --- command line ----------------------------------------------------------------------------


class UsageError(Exception):
    def __init__(self, message: str, show_usage: bool = True) -> None:
        super().__init__(message)
        self.show_usage = show_usage


class Options:
    def __init__(self) -> None:
        self.mode = "run"  # run | help | version | validate | list | kill
        self.user: str | None = None
        self.group: str | None = None
        self.login = False
        self.shell = False
        self.preserve_env = False
        self.keep: list[str] = []
        self.set_home = False
        self.chdir: str | None = None
        self.reset_ts = False
        self.assign: dict[str, str] = {}
        self.command: list[str] = []


_SHORT_ARG = {"u": "user", "g": "group", "p": "prompt", "C": "close-from", "D": "chdir"}
_SHORT_FLAG = {
    "A": "askpass",
    "E": "preserve-env",
    "H": "set-home",
    "h": "help",
    "i": "login",
    "K": "remove-timestamp",
    "k": "reset-timestamp",
    "l": "list",
    "N": "no-update",
    "n": "non-interactive",
    "P": "preserve-groups",
    "S": "stdin",
    "s": "shell",
    "V": "version",
    "v": "validate",
}
_LONG_ARG = {"user", "group", "prompt", "close-from", "chdir"}
_LONG_FLAG = set(_SHORT_FLAG.values())
_UNSUPPORTED = {
    "b": "background",
    "e": "edit",
    "R": "chroot",
    "r": "role",
    "t": "type",
    "T": "command-timeout",
    "U": "other-user",
    "B": "bell",
}


def _set(o: Options, name: str, value: str | None) -> None:
    if name in ("askpass", "no-update", "non-interactive", "preserve-groups", "stdin"):
        return
    if name in ("prompt", "close-from"):
        return
    if name == "user":
        o.user = value
    elif name == "group":
        o.group = value
    elif name == "chdir":
        o.chdir = value
    elif name == "preserve-env":
        if value is None:
            o.preserve_env = True
        else:
            o.keep += [v for v in value.split(",") if v]
    elif name == "set-home":
        o.set_home = True
    elif name == "login":
        o.login = True
    elif name == "shell":
        o.shell = True
    elif name in ("reset-timestamp", "remove-timestamp"):
        o.reset_ts = True
        if name == "remove-timestamp":
            o.mode = "kill"
    elif name == "help":
        o.mode = "help"
    elif name == "version":
        o.mode = "version"
    elif name == "validate":
        o.mode = "validate"
    elif name == "list":
        o.mode = "list"


def parse_args(argv: list[str]) -> Options:
    """sudo's command line (getopt_long with "+": options stop at the first operand)."""
    o = Options()
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            i += 1
            break
        if a.startswith("--"):
            name, eq, value = a[2:].partition("=")
            if name in _LONG_ARG:
                if not eq:
                    i += 1
                    if i >= len(argv):
                        raise UsageError(f"option '--{name}' requires an argument")
                    value = argv[i]
                _set(o, name, value)
            elif name == "preserve-env":
                _set(o, name, value if eq else None)
            elif name in _LONG_FLAG:
                if eq:
                    raise UsageError(f"option '--{name}' doesn't allow an argument")
                _set(o, name, None)
            elif name in _UNSUPPORTED.values():
                raise UsageError(f"option '--{name}' is not supported in this sandbox", False)
            else:
                raise UsageError(f"unrecognized option '{a}'")
            i += 1
            continue
        if not a.startswith("-") or a == "-":
            break
        j = 1
        while j < len(a):
            c = a[j]
            if c in _SHORT_ARG:
                value = a[j + 1 :]
                if not value:
                    i += 1
                    if i >= len(argv):
                        raise UsageError(f"option requires an argument -- '{c}'")
                    value = argv[i]
                _set(o, _SHORT_ARG[c], value)
                break
            if c in _SHORT_FLAG:
                _set(o, _SHORT_FLAG[c], None)
            elif c in _UNSUPPORTED:
                raise UsageError(f"option '-{c}' is not supported in this sandbox", False)
            else:
                raise UsageError(f"invalid option -- '{c}'")
            j += 1
        i += 1
    rest = argv[i:]
    # VAR=value before the command
    while rest and not rest[0].startswith("=") and "=" in rest[0]:
        k, _, v = rest[0].partition("=")
        o.assign[k] = v
        rest = rest[1:]
    o.command = rest
    if o.login and o.shell:
        raise UsageError("you may not specify both the -i and -s options")
    if o.mode == "run" and not o.command and not (o.login or o.shell):
        if o.reset_ts:
            o.mode = "kill"
        else:
            raise UsageError("")
    return o


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


class _Terminal:
    """The caller's terminal in raw mode, and the pty the command gets instead."""

    def __init__(self) -> None:
        import termios
        import tty

        self.saved = termios.tcgetattr(0)
        self.master, self.slave = os.openpty()
        termios.tcsetattr(self.slave, termios.TCSANOW, self.saved)
        self.copy_winsize()
        tty.setraw(0, termios.TCSADRAIN)
        self.raw = True
        os.set_blocking(self.master, False)

    def copy_winsize(self) -> None:
        import fcntl
        import termios

        with contextlib.suppress(OSError):
            ws = fcntl.ioctl(0, termios.TIOCGWINSZ, b"\0" * 8)
            fcntl.ioctl(self.master, termios.TIOCSWINSZ, ws)

    def restore(self) -> None:
        import termios

        if self.raw:
            self.raw = False
            with contextlib.suppress(OSError):
                termios.tcsetattr(0, termios.TCSADRAIN, self.saved)

    def reraw(self) -> None:
        import termios
        import tty

        if not self.raw and _foreground():
            with contextlib.suppress(OSError):
                tty.setraw(0, termios.TCSADRAIN)
                self.raw = True
            self.copy_winsize()


def _open_std_fds() -> None:
    """/dev/null for a closed stdin/stdout/stderr (`sudo x <&-`), before any fd of ours
    could take its number."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free number: `fd`


def _foreground() -> bool:
    try:
        return os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


def _write_all(fd: int, data: bytes) -> bool:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        except OSError:
            return False
        view = view[n:]
    return True


class _Runner:
    def __init__(self, o: Options) -> None:
        self.o = o
        self.pending: list[int] = []
        self.wake_r, self.wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.term: _Terminal | None = None
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
        sock = _connect()
        try:
            use_pty = os.isatty(0) and os.isatty(1) and _foreground()
            fds = [0, 1, 2]
            if use_pty:
                try:
                    self.term = _Terminal()
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
        if not _write_all(1, data):
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
