"""The ``sudo`` client's side of a terminal: the caller's terminal put in raw mode and the
pseudo-terminal the command gets instead (as sudo's ``use_pty``).

Standard library only, relative imports only: it is imported on every ``sudo``.
"""

from __future__ import annotations

import contextlib
import os


class Terminal:
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

        if not self.raw and foreground():
            with contextlib.suppress(OSError):
                tty.setraw(0, termios.TCSADRAIN)
                self.raw = True
            self.copy_winsize()


def foreground() -> bool:
    try:
        return os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


def write_all(fd: int, data: bytes) -> bool:
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
