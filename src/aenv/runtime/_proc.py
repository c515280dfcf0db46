"""Run host commands (runsc, ip, iptables, mount) without blocking the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from aenv.errors import RuntimeFailure

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
