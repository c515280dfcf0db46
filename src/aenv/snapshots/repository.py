"""Where snapshots, templates and hibernated sandboxes live: `Repository` and its backends.

`open_repository` picks the backend from ``snapshot_repo`` (``AENV_SNAPSHOT_REPO``):

- ``file:///abs/path`` (or a bare absolute path): `LocalRepository`; the default is the
  node's own directory (``$AENV_HOME/repo``);
- ``s3://bucket[/prefix]``: `S3Repository`, with ``AENV_S3_ENDPOINT`` / ``AENV_S3_REGION``
  and the standard ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from ..config import SnapshotSettings
from .errors import RepositoryConfigError
from .repos.base import ChecksumMismatch, ObjectInfo, Repository, check_key
from .repos.local import LocalRepository
from .repos.s3 import S3Credentials, S3Repository

__all__ = [
    "ChecksumMismatch",
    "LocalRepository",
    "ObjectInfo",
    "Repository",
    "S3Credentials",
    "S3Repository",
    "check_key",
    "open_repository",
    "repository_url",
]

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def repository_url(snap: SnapshotSettings, default_dir: Path) -> str:
    return snap.snapshot_repo or f"file://{default_dir}"


def open_repository(snap: SnapshotSettings, default_dir: Path) -> Repository:
    """The repository configured by ``snapshot_repo`` (see the module doc), else a local
    one in `default_dir` (`Settings.repo_dir`). Raises `RepositoryConfigError` with the
    offending value on anything malformed."""
    url = repository_url(snap, default_dir).strip()
    if url.startswith("/"):
        return LocalRepository(Path(url))
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise RepositoryConfigError(
                f"AENV_SNAPSHOT_REPO={url!r}: a file URL has no host; use file:///abs/path"
            )
        path = unquote(parts.path)
        if not path.startswith("/") or parts.query or parts.fragment:
            raise RepositoryConfigError(f"AENV_SNAPSHOT_REPO={url!r}: want file:///absolute/path")
        return LocalRepository(Path(path))
    if scheme == "s3":
        return _open_s3(url, snap)
    raise RepositoryConfigError(
        f"AENV_SNAPSHOT_REPO={url!r}: unsupported repository; "
        "use file:///absolute/path or s3://bucket/prefix"
    )


def _open_s3(url: str, snap: SnapshotSettings) -> S3Repository:
    parts = urlsplit(url)
    bucket = parts.netloc
    if "@" in bucket or ":" in bucket:
        raise RepositoryConfigError(
            f"AENV_SNAPSHOT_REPO={url!r}: put no credentials or port in the URL; use "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY and AENV_S3_ENDPOINT"
        )
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise RepositoryConfigError(
            f"AENV_SNAPSHOT_REPO={url!r}: {bucket!r} is not a valid bucket name"
        )
    if parts.query or parts.fragment:
        raise RepositoryConfigError(f"AENV_SNAPSHOT_REPO={url!r}: want s3://bucket/prefix")
    prefix = unquote(parts.path).strip("/")
    if prefix:
        try:
            check_key(prefix)
        except Exception:
            raise RepositoryConfigError(
                f"AENV_SNAPSHOT_REPO={url!r}: invalid prefix {prefix!r}"
            ) from None

    endpoint = snap.s3_endpoint
    if endpoint:
        ep = urlsplit(endpoint)
        if ep.scheme not in ("http", "https") or not ep.hostname or ep.path not in ("", "/"):
            raise RepositoryConfigError(
                f"AENV_S3_ENDPOINT={endpoint!r}: want http(s)://host[:port]"
            )
        endpoint = endpoint.rstrip("/")

    key_id = os.environ.get("AWS_ACCESS_KEY_ID")
    secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
    if bool(key_id) != bool(secret):
        raise RepositoryConfigError(
            "set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or neither"
        )
    creds = None
    if key_id and secret:
        creds = S3Credentials(key_id, secret, os.environ.get("AWS_SESSION_TOKEN") or None)
    region = (
        snap.s3_region
        or os.environ.get("AWS_REGION")
        or os.environ.get("AWS_DEFAULT_REGION")
        or "us-east-1"
    )
    return S3Repository(
        bucket,
        prefix,
        endpoint=endpoint,
        region=region,
        credentials=creds,
        part_size=int(snap.s3_part_size),
        concurrency=snap.s3_concurrency,
        timeout_seconds=snap.s3_timeout_seconds,
    )
