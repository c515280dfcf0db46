"""`aenv cp SRC DST`: files and directory trees between this machine and a sandbox.

One side is `ID:PATH` (a relative PATH is under the sandbox user's home), the other a local
path (or `-`, stdin/stdout, for one file). As with `docker cp`, an argument is remote when
it has a `:` before any `/`; write `./a:b` for a local file named `a:b`.

Transfers go through envd's `/files` (multipart upload, as the E2B SDK does; plain
download) and its `filesystem.Filesystem` RPCs (Stat, ListDir with a depth, MakeDir),
routed by the server's data plane. Directories are copied file by file, four files at a
time: it needs nothing in the sandbox's image (no tar), and each file streams. File modes
are kept: downloads set them locally; uploads set the ones that differ from envd's
defaults (0644 files, 0755 directories) with one `chmod` run in the sandbox (skipped, with
a warning, when the image has no `sh`/`chmod`). Symlinks to files are copied as files (their
content); symlinks to directories are skipped with a note, never followed (no loops).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Annotated, Any

import typer

from ..envd_wire import PROCESS_START, start_request
from .connect import ConnectError, EnvdClient
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
    """One bar for the whole transfer on stderr, only on a terminal and for large ones;
    `advance` is safe from the worker threads."""

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


def stat(envd: EnvdClient, path: str) -> dict[str, Any] | None:
    try:
        entry = envd.unary(STAT, {"path": path}).get("entry")
    except ConnectError as exc:
        if exc.code == "not_found":
            return None
        raise
    return entry if isinstance(entry, dict) else None


def make_dir(envd: EnvdClient, path: str) -> None:
    try:
        envd.unary(MAKE_DIR, {"path": path})
    except ConnectError as exc:
        if exc.code != "already_exists":
            raise CliError(f"{envd.sandbox_id}:{path}: {exc.message}") from None


def chmod_remote(envd: EnvdClient, modes: dict[str, int]) -> None:
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
                for event in envd.process(PROCESS_START, request):
                    if event.kind == "stderr":
                        err += event.data
                    elif event.kind == "end":
                        code = exit_code_of(event)
            except CliError as exc:
                note(f"warning: file modes not kept ({exc.message})")
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


def _upload_one(envd: EnvdClient, local: str, remote: str, progress: Progress) -> None:
    with open(local, "rb") as f:
        envd.upload(remote, _Counted(f, progress.advance), posixpath.basename(remote))  # type: ignore[arg-type]


def _run_all(jobs: list[Callable[[], None]]) -> None:
    """Run the jobs on a few threads; the first failure stops the rest and is raised."""
    if len(jobs) <= 1:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="aenv-cp") as pool:
        futures = [pool.submit(job) for job in jobs]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        for f in futures:
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]


def upload(envd: EnvdClient, src: str, dst: Remote) -> str:
    """Copy local `src` to the sandbox; the sandbox path it went to."""
    sid = envd.sandbox_id
    if src == "-":
        entry = stat(envd, dst.path)
        if entry is not None and entry.get("type") == DIR:
            raise CliError(f"{sid}:{dst.path} is a directory (name the file to write)")
        with tempfile.TemporaryFile() as tmp:
            shutil.copyfileobj(sys.stdin.buffer, tmp)
            tmp.seek(0)
            envd.upload(dst.path, tmp, posixpath.basename(dst.path) or "stdin")
        return dst.path
    local = Path(src)
    if not local.exists():
        raise CliError(f"{src}: no such file or directory")
    entry = stat(envd, dst.path)
    is_dir = entry is not None and entry.get("type") == DIR
    base = str(entry["path"]) if entry is not None and entry.get("path") else dst.path
    name = local.resolve().name
    if local.is_dir():
        contents_only = src.rstrip("/").endswith("/.") or src in (".", "./")
        if entry is not None and not is_dir:
            raise CliError(f"cannot copy directory {src} onto file {sid}:{dst.path}")
        if is_dir and not contents_only:
            target = posixpath.join(base, name)
        elif entry is None and dst.path.endswith("/") and not contents_only:
            target = posixpath.join(dst.path, name)
        else:
            target = base
        plan = plan_upload(local, target)
        for d in plan.dirs:
            make_dir(envd, d)
        total = sum(size for _, _, size in plan.files)
        with Progress(total, len(plan.files), "uploading") as progress:
            _run_all([partial(_upload_one, envd, a, b, progress) for a, b, _ in plan.files])
        if plan.modes:
            chmod_remote(envd, plan.modes)
        for s in plan.skipped:
            note(f"skipped {s} (a symlink to a directory, or not a regular file)")
        return target
    if not local.is_file():
        raise CliError(f"{src}: not a regular file or directory")
    target = posixpath.join(base, name) if dest_inside(dst.path, is_dir) else dst.path
    size = local.stat().st_size
    with Progress(size, 1, "uploading") as progress:
        _upload_one(envd, str(local), target, progress)
    mode = local.stat().st_mode & 0o7777
    if mode != ENVD_FILE_MODE:
        chmod_remote(envd, {target: mode})
    return target


# -- download -------------------------------------------------------------------------------


def _download_one(
    envd: EnvdClient, remote: str, out: IO[bytes], progress: Progress | None = None
) -> None:
    with envd.download(remote) as resp:
        for chunk in resp.iter_bytes(CHUNK):
            out.write(chunk)
            if progress is not None:
                progress.advance(len(chunk))


def _download_to(envd: EnvdClient, remote: str, local: Path, mode: int, progress: Progress) -> None:
    with open(local, "wb") as f:
        _download_one(envd, remote, f, progress)
    os.chmod(local, mode)


def _mode(entry: dict[str, Any], default: int) -> int:
    mode = entry.get("mode")
    return int(mode) & 0o7777 if isinstance(mode, int) else default


def download(envd: EnvdClient, src: Remote, dst: str) -> Path | None:
    """Copy a sandbox path to local `dst` (None: to stdout); the local path written."""
    sid = envd.sandbox_id
    entry = stat(envd, src.path)
    if entry is None:
        raise CliError(f"{sid}:{src.path}: no such file or directory")
    rpath = str(entry.get("path") or src.path)
    is_dir = entry.get("type") == DIR
    if dst == "-":
        if is_dir:
            raise CliError(f"{sid}:{src.path} is a directory (only a file goes to stdout)")
        out = sys.stdout.buffer
        _download_one(envd, rpath, out)
        out.flush()
        return None
    local = Path(dst)
    name = posixpath.basename(rpath.rstrip("/")) or "root"
    if not is_dir:
        if entry.get("type") != FILE:
            raise CliError(f"{sid}:{src.path}: not a regular file or directory")
        target = local / name if dest_inside(dst, local.is_dir()) else local
        size = int(entry.get("size") or 0)
        with Progress(size, 1, "downloading") as progress:
            _download_to(envd, rpath, target, _mode(entry, ENVD_FILE_MODE), progress)
        return target
    contents_only = src.path.rstrip("/").endswith("/.")
    if local.exists() and not local.is_dir():
        raise CliError(f"cannot copy directory {sid}:{src.path} onto file {dst}")
    target = local / name if local.is_dir() and not contents_only else local
    listing = envd.unary(LIST_DIR, {"path": rpath, "depth": MAX_DEPTH}).get("entries") or []
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
        _run_all([partial(_download_to, envd, r, d, m, progress) for r, d, _, m in files])
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
    with state.envd_of(remote.sandbox_id, user) as envd:
        if dst_remote is not None:
            where = upload(envd, src, dst_remote)
            if not quiet:
                print(f"{src} -> {dst_remote.sandbox_id}:{where}", file=sys.stderr)
        else:
            assert src_remote is not None
            written = download(envd, src_remote, dst)
            if written is not None and not quiet:
                print(f"{src} -> {written}", file=sys.stderr)
