"""What changed between two layer stacks (each topmost first, a sandbox's upper on top): the
paths added, changed and deleted, as a list, a unified text diff or a tar of the new files.

The cost is what changed, not the size of the tree: the layers both stacks share at the
bottom (a fork child and its fork point share all but the child's upper) are never walked;
only the paths the other layers hold are looked up in both stacks and compared.
"""

from __future__ import annotations

import difflib
import fnmatch
import io
import json
import os
import stat
import tarfile
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO, Literal

from .overlay import is_opaque, is_whiteout, lookup

ChangeKind = Literal["added", "changed", "deleted"]
EntryType = Literal["file", "dir", "symlink", "other"]

# Left out unless asked for: caches, and the files aenv itself writes into every sandbox
# (a fork child's fresh identity, envd_identity.py) — not what an agent changed.
DEFAULT_EXCLUDE: tuple[str, ...] = (
    "__pycache__",
    "*.pyc",
    ".cache",
    "/etc/machine-id",
    "/var/lib/dbus/machine-id",
    "/run/aenv",
)
# Text diffs are made for files up to this size; larger ones are "Binary files ... differ".
MAX_TEXT = 4 << 20
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Change:
    path: str  # absolute, as the sandbox sees it
    change: ChangeKind
    type: EntryType
    size: int
    mode: int  # permission bits
    # Where its content is on the host, in the newer stack and in the base.
    new: Path | None = None
    old: Path | None = None


def _type(st: os.stat_result) -> EntryType:
    if stat.S_ISREG(st.st_mode):
        return "file"
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    if stat.S_ISLNK(st.st_mode):
        return "symlink"
    return "other"


class Excluder:
    """`exclude` globs: one without a slash matches any path component (`__pycache__`,
    `*.pyc`); one with a slash matches the path from the root and everything below it."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self.names = [p for p in patterns if "/" not in p.strip("/")]
        self.paths = [p.strip("/") for p in patterns if "/" in p.strip("/")]

    def __call__(self, rel: str) -> bool:
        if any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(rel, p + "/*") for p in self.paths):
            return True
        parts = rel.split("/")
        return any(fnmatch.fnmatch(part, p) for p in self.names for part in parts)


def _walk(root: Path, rel: str = "") -> Iterator[tuple[str, bool]]:
    """Paths under `root/rel` (relative to root) and whether each hides what is below it
    (a whiteout or an opaque dir), parents before children."""
    base = root / rel if rel else root
    try:
        entries = list(os.scandir(base))
    except (FileNotFoundError, NotADirectoryError):
        return
    for e in entries:
        path = f"{rel}/{e.name}" if rel else e.name
        st = e.stat(follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            yield path, is_opaque(Path(e.path))
            yield from _walk(root, path)
        else:
            yield path, is_whiteout(st)


def _candidates(top: list[Path], everything: list[Path]) -> set[str]:
    """Every path the layers in `top` hold, and under what they hide, what `everything`
    holds there (a deleted directory's files are deleted too)."""
    found: set[str] = set()
    for layer in top:
        for rel, hides in _walk(layer):
            found.add(rel)
            if hides:
                for other in everything:
                    found.update(p for p, _ in _walk(other, rel))
    return found


def _same_content(a: Path, b: Path) -> bool:
    try:
        with open(a, "rb") as fa, open(b, "rb") as fb:
            while True:
                x, y = fa.read(_CHUNK), fb.read(_CHUNK)
                if x != y:
                    return False
                if not x:
                    return True
    except OSError:
        return False


def differ(a: tuple[Path, os.stat_result], b: tuple[Path, os.stat_result]) -> bool:
    (pa, sa), (pb, sb) = a, b
    if _type(sa) != _type(sb):
        return True
    if (stat.S_IMODE(sa.st_mode), sa.st_uid, sa.st_gid) != (
        stat.S_IMODE(sb.st_mode),
        sb.st_uid,
        sb.st_gid,
    ):
        return _type(sa) != "symlink"  # a symlink's own mode means nothing
    if pa == pb:
        return False
    kind = _type(sa)
    if kind == "file":
        if sa.st_size != sb.st_size:
            return True
        # git's and rsync's quick check: the same size and modification time (to the
        # nanosecond) is the same file — a snapshot's copy of an upper keeps both, so the
        # parent of a fork is not read whole to find what it changed since.
        return sa.st_mtime_ns != sb.st_mtime_ns and not _same_content(pa, pb)
    if kind == "symlink":
        return os.readlink(pa) != os.readlink(pb)
    if kind == "other":
        return sa.st_rdev != sb.st_rdev
    return False  # a directory: its entries are listed on their own


def _shared_bottom(a: list[Path], b: list[Path]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return n


Found = tuple[Path, os.stat_result] | None


def _compare(now: Found, was: Found) -> ChangeKind | None:
    if was is None:
        return None if now is None else "added"
    if now is None:
        return "deleted"
    return "changed" if differ(now, was) else None


def changed_among(new: list[Path], old: list[Path], paths: Iterable[str]) -> set[str]:
    """Which of `paths` (absolute) differ between the stacks, each looked up on its own: what
    `diff_stacks` would say of them, at a cost bounded by how many they are (an apply's
    conflict check, however much the target changed elsewhere)."""
    return {p for p in paths if _compare(lookup(new, p.lstrip("/")), lookup(old, p.lstrip("/")))}


def diff_stacks(new: list[Path], old: list[Path], exclude: Sequence[str] = ()) -> list[Change]:
    """What `new` changed relative to `old` (both stacks topmost first), by path."""
    shared = _shared_bottom(new, old)
    tops = new[: len(new) - shared] + old[: len(old) - shared]
    skip = Excluder(exclude)
    changes: list[Change] = []
    for rel in sorted(_candidates(tops, new + old)):
        if skip(rel):
            continue
        now, was = lookup(new, rel), lookup(old, rel)
        kind = _compare(now, was)
        if kind is None:
            continue
        path, st = now if now is not None else was  # type: ignore[misc]
        changes.append(
            Change(
                path="/" + rel,
                change=kind,
                type=_type(st),
                size=st.st_size if stat.S_ISREG(st.st_mode) else 0,
                mode=stat.S_IMODE(st.st_mode),
                new=None if now is None else now[0],
                old=None if was is None else was[0],
            )
        )
    return changes


# -- the changes as a unified diff ------------------------------------------------------


def _text(path: Path | None) -> list[str] | None:
    """A file's lines if it is text (UTF-8, no NUL, not huge); [] for none; None if binary."""
    if path is None:
        return []
    try:
        if path.stat().st_size > MAX_TEXT:
            return None
        raw = path.read_bytes()
    except OSError:
        return None
    if b"\0" in raw:
        return None
    try:
        return raw.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError:
        return None


def _hunks(lines: Iterable[str]) -> Iterator[str]:
    for line in lines:
        if line.endswith("\n"):
            yield line
        else:
            yield line + "\n\\ No newline at end of file\n"


def unified(changes: Iterable[Change]) -> Iterator[str]:
    """The file changes as a git-style unified diff (`git apply`/`patch -p1` take it)."""
    for c in changes:
        if c.type != "file":
            continue
        rel = c.path.lstrip("/")
        head = [f"diff --git a/{rel} b/{rel}\n"]
        if c.change == "added":
            head.append(f"new file mode 100{c.mode:o}\n")
        elif c.change == "deleted":
            head.append(f"deleted file mode 100{c.mode:o}\n")
        old_lines, new_lines = _text(c.old), _text(c.new)
        a = "/dev/null" if c.change == "added" else f"a/{rel}"
        b = "/dev/null" if c.change == "deleted" else f"b/{rel}"
        if old_lines is None or new_lines is None:
            yield from head
            yield f"Binary files {a} and {b} differ\n"
            continue
        body = list(difflib.unified_diff(old_lines, new_lines, a, b, n=3))
        if not body:
            if c.change == "changed":
                continue  # only its mode or owner changed
            body = [f"--- {a}\n", f"+++ {b}\n"]
        yield from head
        yield body[0].rstrip("\n") + "\n"
        yield body[1].rstrip("\n") + "\n"
        yield from _hunks(body[2:])


# -- the changes as a tar ---------------------------------------------------------------


def write_tar(changes: Iterable[Change], out: BinaryIO, delete_member: str | None = None) -> int:
    """Added and changed entries (files, dirs, symlinks) into a tar at `out`, with their
    modes and owners, paths relative to /; returns how many. Deletions have no form in a
    tar: they are in the list, or (`delete_member`) a first member of that name holding
    the deleted paths as JSON, for an unpacker that knows it (envd's `/tree`)."""
    changes = list(changes)
    n = 0
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        if delete_member is not None:
            doc = json.dumps([c.path for c in changes if c.change == "deleted"]).encode()
            info = tarfile.TarInfo(delete_member)
            info.size = len(doc)
            tar.addfile(info, io.BytesIO(doc))
        for c in changes:
            if c.new is None or c.type == "other":
                continue
            tar.add(c.new, arcname=c.path.lstrip("/"), recursive=False)
            n += 1
    return n


def tar_file(changes: Iterable[Change], delete_member: str | None = None) -> IO[bytes]:
    """`write_tar` into an anonymous temporary file, rewound for reading (blocking)."""
    f = tempfile.TemporaryFile()  # noqa: SIM115 (the caller closes it)
    try:
        write_tar(changes, f, delete_member)
        f.seek(0)
    except BaseException:
        f.close()
        raise
    return f
