"""`aenv cp SRC DST`: files and directory trees between this machine and a sandbox.

One side is `ID:PATH` (a relative PATH is under the sandbox user's home), the other a local
path (or `-`, stdin/stdout, for one file). As with `docker cp`, an argument is remote when
it has a `:` before any `/`; write `./a:b` for a local file named `a:b`.

Transfers go through envd's `/files` (multipart upload, as the E2B SDK does; plain
download) and its `filesystem.Filesystem` RPCs (Stat, ListDir with a depth, MakeDir),
routed by the server's data plane, over the one envd client on one event loop. Directories
are copied file by file, four files at a time: it needs nothing in the sandbox's image (no tar), and each file streams. File modes
are kept: downloads set them locally; uploads set the ones that differ from envd's
defaults (0644 files, 0755 directories) with one `chmod` run in the sandbox (skipped, with
a warning, when the image has no `sh`/`chmod`). Symlinks to files are copied as files (their
content); symlinks to directories are skipped with a note, never followed (no loops).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import re
import shutil
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Annotated, Any

import typer

from ..envd_client import EnvdClient
from ..envd_errors import EnvdError, EnvdUnreachable
from ..envd_wire import PROCESS_START, start_request
from .connect import cli_error, run_with
from .errors import CliError
from .options import UserOpt, note
from .state import state_of

STAT = "filesystem.Filesystem/Stat"
LIST_DIR = "filesystem.Filesystem/ListDir"
MAKE_DIR = "filesystem.Filesystem/MakeDir"
DIR = "FILE_TYPE_DIRECTORY"
FILE = "FILE_TYPE_FILE"
# How deep ListDir walks a tree being downloaded (one call lists it all).
MAX_DEPTH = 128
WORKERS = 4
# A progress bar (stderr, on a terminal) from this many bytes.
PROGRESS_BYTES = 1 << 20
CHUNK = 1 << 16
# envd's modes for what it creates.
ENVD_FILE_MODE = 0o644
ENVD_DIR_MODE = 0o755

_SANDBOX_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Remote:
    sandbox_id: str
    path: str  # as given; "." for the user's home


def parse_location(arg: str) -> Remote | None:
    """`ID:PATH` as a Remote; None for a local path (or `-`)."""
    if arg == "-" or arg.startswith(("/", "./", "../", "~")):
        return None
    head, sep, path = arg.partition(":")
    if not sep or "/" in head or not _SANDBOX_ID.match(head):
        return None
    return Remote(head, path or ".")


def dest_inside(dst: str, is_dir: bool) -> bool:
    """Whether a copy goes *into* DST (an existing directory, or a path ending in `/`)."""
    return is_dir or dst.endswith("/")


# -- progress -------------------------------------------------------------------------------


class Progress:
    """One bar for the whole transfer on stderr, only on a terminal and for large ones."""

    def __init__(self, total: int, files: int, verb: str) -> None:
        self._bar: Any = None
        self._task: Any = None
        if total < PROGRESS_BYTES or not _stderr_is_tty():
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        from .output import console

        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console(stderr=True),
            transient=False,
        )
        label = f"{verb} {files} file{'s' if files != 1 else ''}"
        self._task = self._bar.add_task(label, total=total)

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class _Counted:
    """A file whose reads are counted (for the multipart upload's progress)."""

    def __init__(self, f: IO[bytes], on_read: Callable[[int], None]) -> None:
        self._f = f
        self._on_read = on_read

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._on_read(len(data))
        return data

    def fileno(self) -> int:
        return self._f.fileno()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()


# -- the sandbox side -----------------------------------------------------------------------


async def stat(envd: EnvdClient, path: str) -> dict[str, Any] | None:
    try:
        entry = (await envd.unary(STAT, {"path": path})).get("entry")
    except EnvdError as exc:
        if exc.code == "not_found":
            return None
        raise
    return entry if isinstance(entry, dict) else None


async def make_dir(envd: EnvdClient, sid: str, path: str) -> None:
    try:
        await envd.unary(MAKE_DIR, {"path": path})
    except EnvdUnreachable:
        raise
    except EnvdError as exc:
        if exc.code != "already_exists":
            raise CliError(f"{sid}:{path}: {cli_error(exc).message}") from None


async def chmod_remote(envd: EnvdClient, modes: dict[str, int]) -> None:
    """Set modes in the sandbox with `chmod` (envd has no chmod RPC): one run per mode,
    paths in batches. A sandbox without sh/chmod gets a warning, not an error."""
    from .session import exit_code_of

    by_mode: dict[int, list[str]] = {}
    for path, mode in modes.items():
        by_mode.setdefault(mode, []).append(path)
    for mode, paths in sorted(by_mode.items()):
        for i in range(0, len(paths), 200):
            args = ["-c", 'exec chmod "$@"', "sh", f"{mode:o}", *paths[i : i + 200]]
            err = b""
            code = 1
            try:
                request = dict(start_request("/bin/sh", args), stdin=False)
                async for event in envd.events(PROCESS_START, request):
                    if event.kind == "stderr":
                        err += event.data
                    elif event.kind == "end":
                        code = exit_code_of(event)
            except EnvdError as exc:
                note(f"warning: file modes not kept ({cli_error(exc).message})")
                return
            if code != 0:
                msg = err.decode(errors="replace").strip() or f"chmod exited {code}"
                note(f"warning: file modes not kept ({msg})")
                return


# -- upload ---------------------------------------------------------------------------------


@dataclass
class _Plan:
    """What one copy does: directories to make (parents first), files as (source,
    destination, size), modes to set afterwards, and what was skipped."""

    dirs: list[str]
    files: list[tuple[str, str, int]]
    modes: dict[str, int]
    skipped: list[str]


def plan_upload(src: Path, target: str) -> _Plan:
    """The tree under local directory `src` copied to sandbox path `target`."""
    plan = _Plan(dirs=[target], files=[], modes={}, skipped=[])
    mode = src.stat().st_mode & 0o7777
    if mode != ENVD_DIR_MODE:
        plan.modes[target] = mode
    for root, dirnames, filenames in os.walk(src, followlinks=False):
        rel = os.path.relpath(root, src)
        rdir = target if rel == "." else posixpath.join(target, *Path(rel).parts)
        for name in sorted(dirnames):
            local = os.path.join(root, name)
            if os.path.islink(local):
                plan.skipped.append(local)  # os.walk does not descend into it either
                continue
            remote = posixpath.join(rdir, name)
            plan.dirs.append(remote)
            mode = os.stat(local).st_mode & 0o7777
            if mode != ENVD_DIR_MODE:
                plan.modes[remote] = mode
        for name in sorted(filenames):
            local = os.path.join(root, name)
            try:
                info = os.stat(local)  # follows a symlink to a file
            except OSError:
                plan.skipped.append(local)  # a broken symlink
                continue
            if not os.path.isfile(local):
                plan.skipped.append(local)  # a fifo, socket, device
                continue
            remote = posixpath.join(rdir, name)
            plan.files.append((local, remote, info.st_size))
            if info.st_mode & 0o7777 != ENVD_FILE_MODE:
                plan.modes[remote] = info.st_mode & 0o7777
    dirnames_sorted = sorted(set(plan.dirs), key=lambda d: (d.count("/"), d))
    plan.dirs = dirnames_sorted
    return plan


async def _put(envd: EnvdClient, remote: str, data: IO[bytes], filename: str) -> None:
    try:
        await envd.upload(remote, data, filename=filename)
    except EnvdError as exc:
        raise cli_error(exc, code=False) from None


async def _upload_one(envd: EnvdClient, local: str, remote: str, progress: Progress) -> None:
    with await asyncio.to_thread(open, local, "rb") as f:
        await _put(envd, remote, _Counted(f, progress.advance), posixpath.basename(remote))  # type: ignore[arg-type]


async def _run_all(jobs: list[Callable[[], Awaitable[None]]]) -> None:
    """Run the jobs a few at a time; the first failure stops the rest and is raised."""
    gate = asyncio.Semaphore(WORKERS)

    async def one(job: Callable[[], Awaitable[None]]) -> None:
        async with gate:
            await job()

    try:
        async with asyncio.TaskGroup() as group:
            for job in jobs:
                group.create_task(one(job))
    except ExceptionGroup as eg:
        raise eg.exceptions[0] from None


@dataclass(frozen=True)
class LocalPath:
    """What a copy needs to know of a local path, read before it calls the sandbox."""

    path: Path
    exists: bool
    is_dir: bool
    is_file: bool

    @classmethod
    def of(cls, path: str) -> LocalPath:
        p = Path(path)
        return cls(p, p.exists(), p.is_dir(), p.is_file())


async def upload(envd: EnvdClient, src: str, dst: Remote, local: LocalPath) -> str:
    """Copy local `src` (`local`, unless `-`) to the sandbox; the sandbox path it went to."""
    sid = dst.sandbox_id
    if src == "-":
        entry = await stat(envd, dst.path)
        if entry is not None and entry.get("type") == DIR:
            raise CliError(f"{sid}:{dst.path} is a directory (name the file to write)")
        with tempfile.TemporaryFile() as tmp:
            shutil.copyfileobj(sys.stdin.buffer, tmp)
            tmp.seek(0)
            await _put(envd, dst.path, tmp, posixpath.basename(dst.path) or "stdin")
        return dst.path
    if not local.exists:
        raise CliError(f"{src}: no such file or directory")
    entry = await stat(envd, dst.path)
    is_dir = entry is not None and entry.get("type") == DIR
    base = str(entry["path"]) if entry is not None and entry.get("path") else dst.path
    name = (await asyncio.to_thread(local.path.resolve)).name
    if local.is_dir:
        contents_only = src.rstrip("/").endswith("/.") or src in (".", "./")
        if entry is not None and not is_dir:
            raise CliError(f"cannot copy directory {src} onto file {sid}:{dst.path}")
        if is_dir and not contents_only:
            target = posixpath.join(base, name)
        elif entry is None and dst.path.endswith("/") and not contents_only:
            target = posixpath.join(dst.path, name)
        else:
            target = base
        plan = await asyncio.to_thread(plan_upload, local.path, target)
        for d in plan.dirs:
            await make_dir(envd, sid, d)
        total = sum(size for _, _, size in plan.files)
        with Progress(total, len(plan.files), "uploading") as progress:
            await _run_all([partial(_upload_one, envd, a, b, progress) for a, b, _ in plan.files])
        if plan.modes:
            await chmod_remote(envd, plan.modes)
        for s in plan.skipped:
            note(f"skipped {s} (a symlink to a directory, or not a regular file)")
        return target
    if not local.is_file:
        raise CliError(f"{src}: not a regular file or directory")
    target = posixpath.join(base, name) if dest_inside(dst.path, is_dir) else dst.path
    info = await asyncio.to_thread(local.path.stat)
    with Progress(info.st_size, 1, "uploading") as progress:
        await _upload_one(envd, str(local.path), target, progress)
    mode = info.st_mode & 0o7777
    if mode != ENVD_FILE_MODE:
        await chmod_remote(envd, {target: mode})
    return target


# -- download -------------------------------------------------------------------------------


async def _download_one(
    envd: EnvdClient, remote: str, out: IO[bytes], progress: Progress | None = None
) -> None:
    try:
        async with contextlib.aclosing(envd.download(remote, chunk_size=CHUNK)) as chunks:
            async for chunk in chunks:
                out.write(chunk)
                if progress is not None:
                    progress.advance(len(chunk))
    except EnvdError as exc:
        raise cli_error(exc, code=False) from None


async def _download_to(
    envd: EnvdClient, remote: str, local: Path, mode: int, progress: Progress
) -> None:
    with await asyncio.to_thread(open, local, "wb") as f:
        await _download_one(envd, remote, f, progress)
    os.chmod(local, mode)


def _mode(entry: dict[str, Any], default: int) -> int:
    mode = entry.get("mode")
    return int(mode) & 0o7777 if isinstance(mode, int) else default


async def download(envd: EnvdClient, src: Remote, dst: str, local: LocalPath) -> Path | None:
    """Copy a sandbox path to local `dst` (`local`, unless `-`: stdout); the local path
    written (None for stdout)."""
    sid = src.sandbox_id
    entry = await stat(envd, src.path)
    if entry is None:
        raise CliError(f"{sid}:{src.path}: no such file or directory")
    rpath = str(entry.get("path") or src.path)
    is_dir = entry.get("type") == DIR
    if dst == "-":
        if is_dir:
            raise CliError(f"{sid}:{src.path} is a directory (only a file goes to stdout)")
        out = sys.stdout.buffer
        await _download_one(envd, rpath, out)
        out.flush()
        return None
    name = posixpath.basename(rpath.rstrip("/")) or "root"
    if not is_dir:
        if entry.get("type") != FILE:
            raise CliError(f"{sid}:{src.path}: not a regular file or directory")
        target = local.path / name if dest_inside(dst, local.is_dir) else local.path
        size = int(entry.get("size") or 0)
        with Progress(size, 1, "downloading") as progress:
            await _download_to(envd, rpath, target, _mode(entry, ENVD_FILE_MODE), progress)
        return target
    contents_only = src.path.rstrip("/").endswith("/.")
    if local.exists and not local.is_dir:
        raise CliError(f"cannot copy directory {sid}:{src.path} onto file {dst}")
    target = local.path / name if local.is_dir and not contents_only else local.path
    listing = (await envd.unary(LIST_DIR, {"path": rpath, "depth": MAX_DEPTH})).get("entries") or []
    dir_modes: list[tuple[Path, int]] = [(target, _mode(entry, ENVD_DIR_MODE))]
    files: list[tuple[str, Path, int, int]] = []
    skipped: list[str] = []
    target.mkdir(parents=True, exist_ok=True)
    for e in listing:
        path = str(e.get("path") or "")
        rel = posixpath.relpath(path, rpath)
        if not path or rel.startswith("..") or posixpath.isabs(rel):
            continue  # not below the source: never written outside the target
        dest = target.joinpath(*rel.split("/"))
        kind = e.get("type")
        if kind == DIR and not e.get("isSymlink"):
            dest.mkdir(parents=True, exist_ok=True)
            dir_modes.append((dest, _mode(e, ENVD_DIR_MODE)))
        elif kind == FILE:
            files.append((path, dest, int(e.get("size") or 0), _mode(e, ENVD_FILE_MODE)))
        else:
            skipped.append(path)
    total = sum(f[2] for f in files)
    with Progress(total, len(files), "downloading") as progress:
        await _run_all([partial(_download_to, envd, r, d, m, progress) for r, d, _, m in files])
    # Directory modes last, deepest first: a read-only directory was still written into.
    for d, m in sorted(dir_modes, key=lambda x: len(x[0].parts), reverse=True):
        with contextlib.suppress(OSError):
            os.chmod(d, m)
    for s in skipped:
        note(f"skipped {sid}:{s} (a symlink to a directory, or not a regular file)")
    return target


# -- the command ----------------------------------------------------------------------------


def cp(
    ctx: typer.Context,
    src: Annotated[str, typer.Argument(help="LOCAL-PATH, ID:PATH, or - (stdin, one file).")],
    dst: Annotated[str, typer.Argument(help="ID:PATH, LOCAL-PATH, or - (stdout, one file).")],
    user: UserOpt = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing on success.")] = False,
) -> None:
    """Copy files or directory trees between this machine and a sandbox.

    One side is ID:PATH (relative to the user's home when not absolute). Into an existing
    directory (or a PATH ending in /), SRC is copied under its own name; otherwise it is
    copied as DST. A source ending in /. copies a directory's contents. Directories are
    copied recursively with their files' modes; a large transfer shows a progress bar on
    a terminal. A paused sandbox must be resumed first (`aenv resume ID`).

    Examples:

    ```
    aenv cp ./project i1a2b3c4d5:/home/user/         # -> /home/user/project
    aenv cp i1a2b3c4d5:/home/user/project ./copy     # the tree back, as ./copy
    aenv cp data.csv i1a2b3c4d5:data.csv             # into the user's home
    aenv cp i1a2b3c4d5:/var/log/app.log - | tail
    tar cz src | aenv cp - i1a2b3c4d5:/tmp/src.tgz
    ```
    """
    src_remote, dst_remote = parse_location(src), parse_location(dst)
    if (src_remote is None) == (dst_remote is None):
        raise CliError("one side of `aenv cp` must be ID:PATH (a sandbox), the other a local path")
    if dst_remote is not None and src != "-" and not os.path.lexists(src):
        raise CliError(f"{src}: no such file or directory")
    state = state_of(ctx)
    remote = src_remote or dst_remote
    assert remote is not None
    envd = state.envd_of(remote.sandbox_id, user)
    if dst_remote is not None:
        local = LocalPath.of(src)
        where = run_with(envd, lambda envd: upload(envd, src, dst_remote, local))
        if not quiet:
            print(f"{src} -> {dst_remote.sandbox_id}:{where}", file=sys.stderr)
    else:
        assert src_remote is not None
        there = LocalPath.of(dst)
        written = run_with(envd, lambda envd: download(envd, src_remote, dst, there))
        if written is not None and not quiet:
            print(f"{src} -> {written}", file=sys.stderr)
