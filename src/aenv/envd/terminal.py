"""Controlling terminals and window sizes of envd's children (processes and sudo commands).

Each child runs in its own session (``setsid``), so its pid is its session id.
"""

from __future__ import annotations

import contextlib
import os
import signal


def set_ctty() -> None:  # runs in the child between fork and exec
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def set_winsize(fd: int, cols: int, rows: int) -> None:
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
