"""Snapshots: the durable primitive (ARCHITECTURE.md, decision 4).

A snapshot is a manifest (`manifest.Manifest`, JSON) plus artifacts (layer tars, memory
image files) in a `repository.Repository` — a local directory by default, an S3-compatible
bucket when ``AENV_SNAPSHOT_REPO=s3://…``. `store.SnapshotStore` publishes and fetches them
and keeps the node's bounded cache of memory images. Templates and hibernated sandboxes are
snapshots of another `kind`.
"""

from .errors import (
    ArtifactCorrupt,
    ArtifactError,
    ArtifactMissing,
    ManifestCorrupt,
    ObjectNotFound,
    RepositoryConfigError,
    RepositoryError,
    SnapshotNotFound,
)
from .manifest import CheckpointFile, CheckpointRef, LayerRef, Manifest, ObjectRef, Spec
from .repository import (
    LocalRepository,
    ObjectInfo,
    Repository,
    S3Credentials,
    S3Repository,
    open_repository,
)
from .store import SnapshotStore

__all__ = [
    "ArtifactCorrupt",
    "ArtifactError",
    "ArtifactMissing",
    "CheckpointFile",
    "CheckpointRef",
    "LayerRef",
    "LocalRepository",
    "Manifest",
    "ManifestCorrupt",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectRef",
    "Repository",
    "RepositoryConfigError",
    "RepositoryError",
    "S3Credentials",
    "S3Repository",
    "SnapshotNotFound",
    "SnapshotStore",
    "Spec",
    "open_repository",
]
