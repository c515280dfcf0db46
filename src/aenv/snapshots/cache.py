"""The node's bounded cache of checkpoint (memory) images: ``$AENV_HOME/cache/images``.

Layout::

    cache/images/<snapshot id>/<fingerprint>/   one complete image (runsc --image-path)
    cache/tmp/                                  staging, same filesystem: installing is a rename

The fingerprint identifies the exact image of a manifest (`CheckpointRef.fingerprint`), so
a re-published id (a sandbox hibernated again) never serves a stale image. An entry appears
atomically (renamed in complete) and is never modified afterwards.

Bounded by `capacity` bytes, least recently used first. Only bytes the cache alone holds
count: a file hard-linked with a local repository object (link count > 1) is free to keep
and would free nothing if evicted. Entries of pinned ids are never evicted: pin an id before
fetching it and keep it pinned while a sandbox may read the image (`SnapshotStore.pin`).
Pins live in this process.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..fsutil import fsync_dir, fsync_file, rmtree


@dataclass(frozen=True)
class CacheEntry:
    snapshot_id: str
    fingerprint: str
    path: Path
    size: int  # bytes only the cache holds
    last_used: float


class ImageCache:
    def __init__(self, root: Path, capacity: int, *, tmp: Path | None = None) -> None:
        self.root = Path(root)
        self.tmp = Path(tmp) if tmp is not None else self.root.parent / "tmp"
        self.capacity = int(capacity)
        self._pins: Counter[str] = Counter()  # callers' pins
        self._held: Counter[str] = Counter()  # ids a fetch is installing right now

    # --- pins ---
    @contextlib.contextmanager
    def pin(self, snapshot_id: str) -> Iterator[None]:
        self._pins[snapshot_id] += 1
        try:
            yield
        finally:
            self._pins[snapshot_id] -= 1
            if self._pins[snapshot_id] <= 0:
                del self._pins[snapshot_id]

    @contextlib.contextmanager
    def hold(self, snapshot_id: str) -> Iterator[None]:
        """Like `pin`, for the store's own fetches: protects the id's entries from eviction
        but not an outdated image of the id from being replaced."""
        self._held[snapshot_id] += 1
        try:
            yield
        finally:
            self._held[snapshot_id] -= 1
            if self._held[snapshot_id] <= 0:
                del self._held[snapshot_id]

    def is_pinned(self, snapshot_id: str) -> bool:
        return self._pins.get(snapshot_id, 0) > 0

    def _protected(self, snapshot_id: str) -> bool:
        return self.is_pinned(snapshot_id) or self._held.get(snapshot_id, 0) > 0

    # --- entries ---
    def entry_path(self, snapshot_id: str, fingerprint: str) -> Path:
        return self.root / snapshot_id / fingerprint

    def lookup(self, snapshot_id: str, fingerprint: str) -> Path | None:
        """The entry's directory if cached (and marks it used), else None."""
        p = self.entry_path(snapshot_id, fingerprint)
        if not p.is_dir():
            return None
        with contextlib.suppress(FileNotFoundError):
            os.utime(p)
        return p

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """A fresh directory on the cache's filesystem to assemble an image in; hand it to
        `install`. Whatever is left is removed on exit."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        d = Path(tempfile.mkdtemp(prefix="img-", dir=self.tmp))
        try:
            yield d
        finally:
            rmtree(d)

    def install(self, snapshot_id: str, fingerprint: str, staged: Path) -> Path:
        """Moves a complete staged image into place (one rename). Older images of the same
        id are dropped unless the id is pinned."""
        final = self.entry_path(snapshot_id, fingerprint)
        final.parent.mkdir(parents=True, exist_ok=True)
        if not final.exists():
            _fsync_tree(staged)
            try:
                os.rename(staged, final)
            except OSError:
                if not final.is_dir():  # lost a race to an identical install: fine
                    raise
        with contextlib.suppress(FileNotFoundError):
            os.utime(final)
        if not self.is_pinned(snapshot_id):
            for other in final.parent.iterdir():
                if other.name != fingerprint:
                    self._remove_dir(other)
        return final

    def entries(self) -> list[CacheEntry]:
        out: list[CacheEntry] = []
        if not self.root.is_dir():
            return out
        for id_dir in self.root.iterdir():
            if not id_dir.is_dir():
                continue
            for d in id_dir.iterdir():
                try:
                    st = d.stat()
                except FileNotFoundError:
                    continue
                out.append(CacheEntry(id_dir.name, d.name, d, _owned_bytes(d), st.st_mtime))
        return out

    def usage(self) -> int:
        return sum(e.size for e in self.entries())

    def evict(self, *, keep: frozenset[str] = frozenset()) -> list[CacheEntry]:
        """Removes least recently used entries until the cache fits its capacity; pinned
        ids and ids in `keep` stay. Returns what was removed."""
        entries = sorted(self.entries(), key=lambda e: e.last_used)
        total = sum(e.size for e in entries)
        removed: list[CacheEntry] = []
        for e in entries:
            if total <= self.capacity:
                break
            if self._protected(e.snapshot_id) or e.snapshot_id in keep:
                continue
            self._remove_dir(e.path)
            total -= e.size
            removed.append(e)
        return removed

    def remove(self, snapshot_id: str) -> bool:
        """Drops every image of an id unless it is pinned; True if something was removed."""
        if self._protected(snapshot_id):
            return False
        d = self.root / snapshot_id
        if not d.exists():
            return False
        for entry in list(d.iterdir()):
            self._remove_dir(entry)
        return True

    def _remove_dir(self, path: Path) -> None:
        """Renames the entry away first so nobody ever sees a half-deleted image."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        trash = self.tmp / f"del-{os.getpid()}-{time.monotonic_ns()}"
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        rmtree(trash)
        with contextlib.suppress(OSError):
            path.parent.rmdir()  # the id directory, once empty

    def clean_staging(self) -> None:
        """Removes leftovers of interrupted fetches (call at startup)."""
        if self.tmp.is_dir():
            for entry in self.tmp.iterdir():
                rmtree(entry)


def _owned_bytes(d: Path) -> int:
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(d):
            with contextlib.suppress(FileNotFoundError):
                st = entry.stat(follow_symlinks=False)
                if st.st_nlink == 1:
                    total += st.st_blocks * 512
    return total


def _fsync_tree(d: Path) -> None:
    for entry in os.scandir(d):
        if entry.is_file(follow_symlinks=False):
            fsync_file(entry.path)
    fsync_dir(d)
