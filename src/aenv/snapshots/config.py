"""Settings of the snapshot repository and the node's image cache (``AENV_*`` variables).

They live here rather than in `aenv.config.Settings` so this package owns its knobs; both
read the same environment with the same prefix.

``AENV_SNAPSHOT_REPO``
    ``file:///abs/path`` (default: ``file://$AENV_HOME/repo``) or ``s3://bucket[/prefix]``.
``AENV_S3_ENDPOINT``, ``AENV_S3_REGION``
    For S3-compatible servers (MinIO, Ceph, moto, R2...). Path-style requests are used when
    an endpoint is set; ``http://`` endpoints are allowed. Credentials come from the standard
    ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and ``AWS_SESSION_TOKEN``.
``AENV_SNAPSHOT_CACHE_SIZE``
    Bound of the local checkpoint-image cache, e.g. ``20GiB`` (bytes owned by the cache only:
    files hard-linked with a local repository cost nothing and are not counted).
``AENV_SNAPSHOT_COMPRESSION``
    ``auto`` (zstd for layer tars everywhere and for checkpoint files on S3, none for
    checkpoint files in a local repository, so they can be hard-linked), ``zstd`` or ``none``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ByteSize
from pydantic_settings import BaseSettings, SettingsConfigDict

Compression = Literal["auto", "none", "zstd"]


class SnapshotSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AENV_", extra="ignore")

    snapshot_repo: str | None = None
    s3_endpoint: str | None = None
    s3_region: str | None = None
    # A whole-object GET streams within one request; it must outlive a 1 GiB download.
    s3_timeout_seconds: float = 3600.0
    s3_part_size: ByteSize = ByteSize(8 * 1024 * 1024)
    s3_concurrency: int = 4

    snapshot_cache_size: ByteSize = ByteSize(20 * 1024**3)
    snapshot_compression: Compression = "auto"
    snapshot_zstd_level: int = 1
    # Objects no manifest references are swept only once older than this (another node may
    # be publishing them right now). Objects of a deleted manifest are swept at once.
    snapshot_gc_grace_seconds: float = 3600.0
