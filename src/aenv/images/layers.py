"""Content-addressed store of read-only layer directories under `settings.layers_dir`.

Layout::

    layers/
      sha256-<hex>/
        rootfs/        the unpacked files (an overlayfs lowerdir, never written to)
        meta.json      {"digest", "size", "files", "created", "source"}
      .tmp/            staging area on the same filesystem, so publishing is one rename(2)

A layer is addressed by a digest ``<algo>:<hex>`` (OCI style); its directory name is
``<algo>-<hex>``. A layer appears in the store atomically (it is staged under ``.tmp`` and
renamed into place) and is immutable afterwards: nothing in aenv writes below ``rootfs/``
once it was added, which is also what makes sharing inodes with other copies (``cp -al``)
safe.

Digests of locally built layers come from `tree_digest`: a sha256 over the sorted tree
(path, type, mode, uid, gid, size, mtime, link target, device, file content). Layers pulled
from a registry will be keyed by their OCI diff-id instead; both live side by side.

Not here yet (a later issue): OCI pulls, reference counts held by templates/snapshots/
sandboxes, and LRU eviction bounded by a size budget. The hook for that is `LayerStore.touch`
(records last use in meta.json) and `LayerStore.list` (sizes and timestamps to rank by);
eviction will call `remove` for unreferenced layers.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import stat
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from ..config import Settings
from ..errors import AenvError, BadRequest, NotFound
from ..fsutil import fsync_dir, rmtree

DIGEST_RE = re.compile(r"^(sha256|sha512):([0-9a-f]{32,128})$")
_DIRNAME_RE = re.compile(r"^(sha256|sha512)-([0-9a-f]{32,128})$")
_CHUNK = 1 << 20

AddMode = Literal["move", "copy", "link"]


class LayerError(AenvError):
    """A layer could not be added, read or removed."""


@dataclass(frozen=True)
class LayerInfo:
    digest: str
    path: Path  # the rootfs directory
    size: int  # apparent bytes of regular files
    files: int  # number of entries (files, dirs, links, devices)
    created: str  # ISO 8601, UTC
    source: str  # free text: "local", "debootstrap bookworm", an OCI reference, ...
    last_used: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "size": self.size,
            "files": self.files,
            "created": self.created,
            "source": self.source,
            "last_used": self.last_used,
        }


def parse_digest(digest: str) -> tuple[str, str]:
    """Validates ``<algo>:<hex>`` and returns (algo, hex). Raises BadRequest otherwise."""
    m = DIGEST_RE.match(digest)
    if not m:
        raise BadRequest(f"invalid layer digest {digest!r} (want sha256:<hex>)")
    return m.group(1), m.group(2)


def tree_digest(root: Path) -> tuple[str, int, int]:
    """Deterministic sha256 of a directory tree; returns (digest, size, entries).

    Covers, in sorted path order, each entry's relative path, type, permission bits, uid,
    gid, size, mtime (seconds, not for directories), symlink target, device number and the
    content of regular files. Directory mtimes are left out: they change with every build
    step and say nothing about the content. Hard links hash as separate files.
    """
    h = hashlib.sha256()
    size = 0
    entries = 0
    h.update(b"aenv-tree-v1\0")
    for rel, st in _walk_sorted(root):
        entries += 1
        kind = stat.S_IFMT(st.st_mode)
        mtime = 0 if kind == stat.S_IFDIR else int(st.st_mtime)
        head = f"{rel}\0{kind:o}\0{stat.S_IMODE(st.st_mode):o}\0{st.st_uid}\0{st.st_gid}\0{mtime}\0"
        h.update(head.encode("utf-8", "surrogateescape"))
        if kind == stat.S_IFREG:
            size += st.st_size
            h.update(f"{st.st_size}\0".encode())
            with open(root / rel, "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
        elif kind == stat.S_IFLNK:
            h.update(os.readlink(root / rel).encode("utf-8", "surrogateescape"))
        elif kind in (stat.S_IFCHR, stat.S_IFBLK):
            h.update(f"{os.major(st.st_rdev)},{os.minor(st.st_rdev)}".encode())
        h.update(b"\n")
    return f"sha256:{h.hexdigest()}", size, entries


def tree_size(root: Path) -> tuple[int, int]:
    """(apparent bytes of regular files, number of entries) — stat only, no reads."""
    size = 0
    entries = 0
    for _rel, st in _walk_sorted(root):
        entries += 1
        if stat.S_ISREG(st.st_mode):
            size += st.st_size
    return size, entries


def _walk_sorted(root: Path) -> Iterator[tuple[str, os.stat_result]]:
    """Yields (relative path, lstat) for every entry below root, depth first, names sorted
    bytewise. Never follows symlinks."""
    stack: list[str] = [""]
    while stack:
        rel = stack.pop()
        base = os.path.join(root, rel) if rel else str(root)
        with os.scandir(base) as it:
            names = sorted((e.name for e in it), key=os.fsencode)
        subdirs: list[str] = []
        for name in names:
            child = f"{rel}/{name}" if rel else name
            st = os.lstat(os.path.join(root, child))
            yield child, st
            if stat.S_ISDIR(st.st_mode):
                subdirs.append(child)
        stack.extend(reversed(subdirs))


def copy_tree(src: Path, dst: Path, *, link: bool) -> None:
    """`cp -a` (or `cp -al`: hard links for files) of src's content into a new dir dst.

    Hard links fall back to a real copy when src and dst are on different filesystems."""
    if dst.exists():
        raise LayerError(f"{dst} exists")
    flags = "-al" if link else "-a"
    # A copy on one btrfs/XFS filesystem shares the files' extents (metadata only).
    cmd = ["cp", flags] if link else ["cp", flags, "--reflink=auto"]
    r = subprocess.run(
        [*cmd, "--", str(src), str(dst)], capture_output=True, text=True, check=False
    )
    if r.returncode != 0:
        if link and ("cross-device" in r.stderr.lower() or "invalid cross" in r.stderr.lower()):
            rmtree(dst)
            copy_tree(src, dst, link=False)
            return
        rmtree(dst)
        raise LayerError(f"cp {flags} {src} {dst} failed: {r.stderr.strip()}")


class LayerStore:
    """The node's layer directories. Cheap to construct; all state is on disk."""

    def __init__(self, settings_or_root: Settings | Path) -> None:
        if isinstance(settings_or_root, Settings):
            self.root = settings_or_root.layers_dir
        else:
            self.root = Path(settings_or_root)
        self.tmp = self.root / ".tmp"

    # --- addressing ---
    def layer_dir(self, digest: str) -> Path:
        algo, hexd = parse_digest(digest)
        return self.root / f"{algo}-{hexd}"

    def path(self, digest: str) -> Path:
        """The rootfs directory of a layer (whether or not it exists)."""
        return self.layer_dir(digest) / "rootfs"

    def has(self, digest: str) -> bool:
        d = self.layer_dir(digest)
        return (d / "meta.json").is_file() and (d / "rootfs").is_dir()

    # --- reading ---
    def info(self, digest: str) -> LayerInfo:
        d = self.layer_dir(digest)
        try:
            meta = json.loads((d / "meta.json").read_text())
        except FileNotFoundError:
            raise NotFound(f"layer {digest} not found") from None
        return LayerInfo(
            digest=digest,
            path=d / "rootfs",
            size=int(meta.get("size", 0)),
            files=int(meta.get("files", 0)),
            created=str(meta.get("created", "")),
            source=str(meta.get("source", "")),
            last_used=meta.get("last_used"),
        )

    def size(self, digest: str) -> int:
        return self.info(digest).size

    def list(self) -> list[LayerInfo]:
        if not self.root.is_dir():
            return []
        out: list[LayerInfo] = []
        for entry in sorted(os.listdir(self.root)):
            m = _DIRNAME_RE.match(entry)
            if not m:
                continue
            digest = f"{m.group(1)}:{m.group(2)}"
            with contextlib.suppress(NotFound, ValueError, json.JSONDecodeError):
                out.append(self.info(digest))
        return out

    # --- writing ---
    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """A fresh empty directory on the store's filesystem to build a layer in.

        Pass it (or a directory inside it) to `add_dir(..., mode="move")`; whatever is
        left behind is removed on exit."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        d = Path(tempfile.mkdtemp(prefix="stage-", dir=self.tmp))
        try:
            yield d
        finally:
            rmtree(d)

    def add_dir(
        self,
        src: Path,
        digest: str | None = None,
        *,
        mode: AddMode = "move",
        source: str = "local",
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """Adds the tree at src as a layer and returns its digest.

        mode: "move" renames src into the store (falls back to a copy across filesystems;
        src is gone afterwards), "copy" copies it, "link" hard-links its files (`cp -al`;
        only for sources that are themselves never modified). Without a digest the tree is
        hashed with `tree_digest`. If the layer exists already, the store keeps the existing
        copy and src is discarded (move) or left alone (copy/link). `extra` adds keys to
        meta.json (e.g. an OCI layer's diff_id and media type).
        """
        src = Path(src)
        if not src.is_dir() or src.is_symlink():
            raise LayerError(f"{src} is not a directory")
        if digest is None:
            digest, size, files = tree_digest(src)
        else:
            parse_digest(digest)
            size, files = tree_size(src)
        if self.has(digest):
            if mode == "move":
                rmtree(src)
            return digest

        self.tmp.mkdir(parents=True, exist_ok=True)
        stage = self.tmp / f"add-{uuid.uuid4().hex}"
        stage.mkdir()
        # A move across filesystems is a copy: the source goes only once the layer is in
        # the store, so a crash in between leaves one whole copy or the other.
        copied = False
        try:
            rootfs = stage / "rootfs"
            if mode == "move":
                try:
                    os.rename(src, rootfs)
                except OSError as e:
                    if e.errno != errno.EXDEV:
                        raise
                    copy_tree(src, rootfs, link=False)
                    copied = True
            else:
                copy_tree(src, rootfs, link=(mode == "link"))
            meta = {
                **(extra or {}),
                "digest": digest,
                "size": size,
                "files": files,
                "created": datetime.now(UTC).isoformat(timespec="seconds"),
                "source": source,
            }
            (stage / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
            fsync_dir(stage)
            try:
                os.rename(stage, self.layer_dir(digest))
            except OSError as e:
                # Someone else published the same layer meanwhile: theirs is as good as ours.
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not self.has(digest):
                    raise
            else:
                fsync_dir(self.root)
        finally:
            if stage.exists():
                rmtree(stage)
        if copied:
            rmtree(src)
        return digest

    def remove(self, digest: str) -> bool:
        """Deletes a layer; returns False if it was not there. The layer disappears from
        the store atomically (renamed away first), then its files are deleted. The caller
        makes sure no template, snapshot or sandbox still uses it."""
        d = self.layer_dir(digest)
        self.tmp.mkdir(parents=True, exist_ok=True)
        trash = self.tmp / f"del-{uuid.uuid4().hex}"
        try:
            os.rename(d, trash)
        except FileNotFoundError:
            return False
        rmtree(trash)
        return True

    def touch(self, digest: str) -> None:
        """Records that a layer was used now (for the future LRU eviction)."""
        d = self.layer_dir(digest)
        meta_path = d / "meta.json"
        try:
            meta = json.loads(meta_path.read_text())
        except FileNotFoundError:
            raise NotFound(f"layer {digest} not found") from None
        meta["last_used"] = time.time()
        tmp = d / f".meta-{uuid.uuid4().hex}"
        tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, meta_path)

    def clean_staging(self) -> None:
        """Removes leftovers of interrupted adds/removes (call at startup, single process)."""
        if self.tmp.is_dir():
            for entry in self.tmp.iterdir():
                rmtree(entry)
