"""The repository interface: immutable-ish blobs under string keys.

Keys are ``/``-separated relative paths (``manifests/x.json``, ``layers/sha256-…/….tar.zst``).
A key's components are non-empty, never ``.``/``..``, never start with a dot (names starting
with a dot are the backends' own, e.g. a local repository's ``.tmp``) and hold no NUL or
backslash. Prefixes (`list`, `delete_prefix`) are directory-like: ``list("layers")`` and
``list("layers/")`` both return the objects strictly below ``layers/``.

Every write is atomic: a reader sees either the previous object or the complete new one,
never a part of it. Large files stream in both directions; nothing holds a whole object in
memory except `put_bytes`/`get_bytes`, which are meant for manifests.
"""

from __future__ import annotations

import abc
import hashlib
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from ..errors import ArtifactCorrupt, RepositoryError

CHUNK = 4 * 1024 * 1024
_BAD_CHARS = re.compile(r"[\x00-\x1f\\]")


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    last_modified: float  # Unix time


class ChecksumMismatch(ArtifactCorrupt):
    """`get_file` read an object whose sha256 or size is not what the caller expected."""

    def __init__(self, key: str, *, expected: str, actual: str) -> None:
        super().__init__(
            f"object {key!r} is corrupt: expected {expected}, got {actual}", artifact=key
        )
        self.key = key
        self.expected = expected
        self.actual = actual


def check_key(key: str) -> str:
    """Returns key if it is a valid object key, raises RepositoryError otherwise."""
    if not isinstance(key, str) or not key or len(key) > 1024 or _BAD_CHARS.search(key):
        raise RepositoryError(f"invalid repository key {key!r}")
    for part in key.split("/"):
        if not part or part.startswith("."):
            raise RepositoryError(f"invalid repository key {key!r}")
    return key


def norm_prefix(prefix: str) -> str:
    """``"a/b/"`` → ``"a/b"``; ``""`` stays ``""`` (everything)."""
    p = prefix.strip("/")
    if p:
        check_key(p)
    return p


def under(key: str, prefix: str) -> bool:
    return not prefix or key.startswith(prefix + "/")


class Repository(abc.ABC):
    """Where snapshots live. Backends: `LocalRepository` (a directory) and `S3Repository`."""

    #: Where it is, for logs and messages (never carries credentials).
    url: str
    #: True when `local_path` can return files (objects live on a local filesystem).
    local_path_capable: bool = False

    @abc.abstractmethod
    async def put_file(self, key: str, path: Path, *, move: bool = False) -> None:
        """Stores the file at path under key (streamed). With move=True the caller gives the
        file up: a backend may rename it into place instead of copying; it is gone after."""

    @abc.abstractmethod
    async def get_file(
        self, key: str, dest: Path, *, sha256: str | None = None, size: int | None = None
    ) -> str:
        """Streams the object into dest (written to a temp file beside it, renamed into
        place when complete) and returns the sha256 hex of its bytes. With sha256/size given,
        a mismatch raises `ChecksumMismatch` and dest is left untouched. Raises
        `ObjectNotFound` if the key is not there."""

    @abc.abstractmethod
    async def put_bytes(self, key: str, data: bytes) -> None: ...

    @abc.abstractmethod
    async def get_bytes(self, key: str) -> bytes:
        """Raises `ObjectNotFound` if the key is not there."""

    @abc.abstractmethod
    async def stat(self, key: str) -> ObjectInfo | None:
        """Size and modification time of an object, or None if it is not there."""

    async def exists(self, key: str) -> bool:
        return await self.stat(key) is not None

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Removes an object; a missing key is not an error."""

    @abc.abstractmethod
    async def delete_prefix(self, prefix: str) -> int:
        """Removes every object below prefix; returns how many there were."""

    @abc.abstractmethod
    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Objects strictly below prefix (all objects for ""), sorted by key."""

    def local_path(self, key: str) -> Path | None:
        """The object's file if the backend keeps it on a local filesystem (read it, link
        it, never write to it), else None."""
        return None

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Releases connections; the default has nothing to release."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class HashingFileWriter:
    """Writes chunks to a temp file beside dest, hashing them; `commit` verifies and renames
    into place, `abort` removes the temp. Used by every backend's `get_file`."""

    def __init__(self, dest: Path) -> None:
        self.dest = Path(dest)
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.dest.with_name(f".{self.dest.name}.{uuid.uuid4().hex[:12]}.part")
        self._f = open(self.tmp, "wb")  # noqa: SIM115 - closed in commit/abort
        self._h = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes | memoryview) -> None:
        self._h.update(chunk)
        self._f.write(chunk)
        self.size += len(chunk)

    def commit(self, key: str, *, sha256: str | None, size: int | None) -> str:
        digest = self._h.hexdigest()
        try:
            if size is not None and size != self.size:
                raise ChecksumMismatch(key, expected=f"{size} bytes", actual=f"{self.size} bytes")
            if sha256 is not None and sha256 != digest:
                raise ChecksumMismatch(key, expected=f"sha256:{sha256}", actual=f"sha256:{digest}")
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self.tmp, self.dest)
        except BaseException:
            self.abort()
            raise
        return digest

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self.tmp.unlink(missing_ok=True)
