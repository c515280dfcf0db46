"""Errors of the snapshot repository, its artifacts and the snapshot store.

All are `aenv.errors.AenvError` subclasses, so the API maps them once like every other
error: an unknown snapshot is a 404, anything wrong with stored data is a 500 whose message
names the snapshot, the artifact and the repository key.
"""

from __future__ import annotations

from ..errors import AenvError, InternalError, NotFound


class RepositoryError(InternalError):
    """The repository backend failed (I/O error, S3 error, permission, bad key)."""


class RepositoryConfigError(AenvError):
    """`AENV_SNAPSHOT_REPO` (or the S3 settings) cannot be understood."""

    status = 500


class ObjectNotFound(RepositoryError):
    """A key that the caller expected is not in the repository."""

    def __init__(self, key: str, where: str = "") -> None:
        super().__init__(
            f"object {key!r} not found in the repository{' ' + where if where else ''}"
        )
        self.key = key


class SnapshotNotFound(NotFound):
    """No manifest with that id in the repository."""

    def __init__(self, snapshot_id: str) -> None:
        super().__init__(f"snapshot {snapshot_id!r} not found")
        self.snapshot_id = snapshot_id


class ArtifactError(InternalError):
    """Stored data of a snapshot cannot be used. Nothing was restored from it."""

    def __init__(self, message: str, *, snapshot_id: str = "", artifact: str = "") -> None:
        super().__init__(message)
        self.snapshot_id = snapshot_id
        self.artifact = artifact


class ArtifactMissing(ArtifactError):
    """A manifest references an object that is not in the repository."""


class ArtifactCorrupt(ArtifactError):
    """An object's checksum or size does not match its manifest, or it does not unpack."""


class ManifestCorrupt(ArtifactError):
    """A manifest exists but is not valid JSON or not a valid manifest."""
