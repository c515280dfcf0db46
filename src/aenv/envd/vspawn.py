"""Starting envd's commands through its spawn library (`spawn.c`, compiled into the bundle
as `lib/libaenv-spawn.so`): one vfork and one exec, the credentials switched in the child.

What it replaces costs more in gVisor: subprocess forks envd (20-40 ms) whenever the child
must change user or take a controlling terminal. Without the library (envd run from its
sources, no C compiler when the bundle was built) `available()` is None and envd uses
subprocess.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LIB_NAME = "libaenv-spawn.so"
# In the bundle: /opt/aenv/app/aenv_envd/vspawn.py -> /opt/aenv/lib/libaenv-spawn.so
LIB_PATH = Path(__file__).resolve().parents[2] / "lib" / LIB_NAME

_STAGES = {
    1: "descriptors",
    2: "setsid",
    3: "controlling terminal",
    4: "chdir",
    5: "setgroups",
    6: "setgid",
    7: "setuid",
    8: "exec",
}
_REPORT = struct.Struct("=ii")


@dataclass(frozen=True)
class Credentials:
    uid: int
    gid: int
    groups: tuple[int, ...] = ()


def _c_strings(items: Sequence[bytes], what: str) -> ctypes.Array[ctypes.c_char_p]:
    """A NULL-terminated char* array; a NUL inside an item is refused as subprocess does
    (ctypes would cut the string there silently)."""
    for item in items:
        if b"\0" in item:
            raise ValueError(f"embedded null byte in {what}")
    return (ctypes.c_char_p * (len(items) + 1))(*items, None)


def _candidates(program: str, env: Mapping[str, str]) -> list[bytes]:
    """Where to exec `program` from, in order: as given when it has a slash, else each
    directory of the PATH it will run with (as subprocess looks it up)."""
    name = os.fsencode(program)
    if b"/" in name:
        return [name]
    return [os.path.join(os.fsencode(d), name) for d in os.get_exec_path(dict(env))]


class Spawner:
    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path), use_errno=True)
        fn = lib.aenv_spawn
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.POINTER(ctypes.c_char_p),  # paths
            ctypes.POINTER(ctypes.c_char_p),  # argv
            ctypes.POINTER(ctypes.c_char_p),  # envp
            ctypes.c_char_p,  # cwd
            ctypes.c_int,  # stdin
            ctypes.c_int,  # stdout
            ctypes.c_int,  # stderr
            ctypes.c_int,  # ctty
            ctypes.c_long,  # uid (-1: unchanged)
            ctypes.c_long,  # gid
            ctypes.c_int,  # ngroups
            ctypes.POINTER(ctypes.c_uint),  # groups
            ctypes.c_int,  # umask (-1: inherited)
            ctypes.c_int,  # errfd
        ]
        self._spawn = fn

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        cwd: str | None,
        stdin: int,
        stdout: int,
        stderr: int,
        ctty: bool = False,
        creds: Credentials | None = None,
        executable: str | None = None,
        umask: int | None = None,
    ) -> int:
        """Starts `argv` (the program `executable`, else argv[0]) in a new session with
        fds 0-2 as given and no other descriptor; its pid. OSError (FileNotFoundError,
        PermissionError, ...) as subprocess raises when the program cannot be started;
        ValueError for a NUL byte."""
        if not argv:
            raise ValueError("an empty command line")
        program = executable or argv[0]
        paths = _c_strings(_candidates(program, env), "the program")
        args = _c_strings([os.fsencode(a) for a in argv], "the arguments")
        envp = _c_strings(
            [os.fsencode(k) + b"=" + os.fsencode(v) for k, v in env.items()], "the environment"
        )
        c_cwd = os.fsencode(cwd) if cwd is not None else None
        if c_cwd is not None and b"\0" in c_cwd:
            raise ValueError("embedded null byte in the working directory")
        groups = creds.groups if creds else ()
        c_groups = (ctypes.c_uint * max(1, len(groups)))(*groups)
        uid, gid = (creds.uid, creds.gid) if creds else (-1, -1)
        report_r, report_w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = self._spawn(
                paths, args, envp, c_cwd, stdin, stdout, stderr, int(ctty),
                uid, gid, len(groups), c_groups, -1 if umask is None else umask, report_w,
            )  # fmt: skip
            if pid < 0:
                code = ctypes.get_errno()
                raise OSError(code, os.strerror(code))
            os.close(report_w)
            report_w = -1
            data = b""
            while chunk := os.read(report_r, _REPORT.size):
                data += chunk
        finally:
            if report_w >= 0:
                os.close(report_w)
            os.close(report_r)
        if not data:
            return pid
        os.waitpid(pid, 0)  # it exited 127 after the report
        stage, code = _REPORT.unpack(data[: _REPORT.size]) if len(data) >= 8 else (0, errno.EIO)
        where = _STAGES.get(stage, "spawn")
        if where == "exec":
            raise OSError(code, os.strerror(code), program)
        if where == "chdir":
            raise OSError(code, os.strerror(code), cwd)
        raise OSError(code, f"{os.strerror(code)} ({where})")


def start(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    cwd: str | None,
    fds: tuple[int, int, int],
    ctty: bool = False,
    creds: Credentials | None = None,
    executable: str | None = None,
    umask: int | None = None,
) -> tuple[int, Any]:
    """Starts a command in a session of its own (fds 0-2 as given, `ctty`: fd 0 its
    controlling terminal): (pid, the Popen when subprocess started it). Through the
    library when the bundle has it, else subprocess, which forks envd to switch user or
    take a terminal. OSError/ValueError as subprocess raises them."""
    stdin, stdout, stderr = fds
    spawner = available()
    if spawner is not None:
        pid = spawner.spawn(
            argv, env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, ctty=ctty,
            creds=creds, executable=executable, umask=umask,
        )  # fmt: skip
        return pid, None
    import fcntl  # noqa: F401  (imported before the fork: the terminal hook runs in the child)
    import subprocess
    import termios  # noqa: F401

    from .terminal import set_ctty

    kw: dict[str, Any] = {}
    if creds is not None:
        kw.update(user=creds.uid, group=creds.gid, extra_groups=list(creds.groups))
    if ctty:
        kw["preexec_fn"] = set_ctty
    popen = subprocess.Popen(
        list(argv),
        executable=executable,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        cwd=cwd,
        env=dict(env),
        umask=-1 if umask is None else umask,
        start_new_session=True,
        close_fds=True,
        **kw,
    )
    return popen.pid, popen


@functools.cache
def available() -> Spawner | None:
    """The bundle's spawner, or None without the library (loaded once)."""
    if not LIB_PATH.is_file():
        return None
    try:
        return Spawner(LIB_PATH)
    except (OSError, AttributeError):
        return None
