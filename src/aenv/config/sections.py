"""The two sections of `Settings` that the image and snapshot code take on their own."""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from ..registries import normalize_registry

GIB = 1 << 30

Compression = Literal["auto", "none", "zstd"]


def _split_list(value: Any) -> Any:
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    return value


# E2B's base image and the SDK's `from_base_image()`; E2B's code-interpreter image; a bare
# `FROM base` (Docker Hub has no such image worth pulling; this node's default template).
DEFAULT_IMAGE_ALIASES: dict[str, str] = {
    "e2bdev/base": "base",
    "base": "base",
    "e2bdev/code-interpreter": "code-interpreter-v1",
}


class ImageSettings(BaseModel):
    """Registries, pulls and the layer cache bound."""

    model_config = ConfigDict(extra="ignore")

    # Registries reached over plain HTTP (`host:port`, as written in references). Every other
    # registry is spoken to over HTTPS with certificate verification.
    insecure_registries: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Where short names (`ubuntu`, `org/app`) are looked up, in order.
    search_registries: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["docker.io"])
    # When non-empty, only these registries may be pulled from.
    allowed_registries: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # host -> "user:password" (takes precedence over the docker config file).
    registry_credentials: dict[str, str] = Field(default_factory=dict)
    # A docker `config.json` (default: $DOCKER_CONFIG/config.json, else ~/.docker/config.json).
    docker_config: Path | None = None
    # Layers downloaded at once per pull.
    pull_concurrency: int = Field(default=3, ge=1, le=32)
    # `os/arch[/variant]` to select from multi-platform images (default: the host's).
    pull_platform: str | None = None
    # Image references that stand for local templates in builds (`fromImage`, Dockerfile
    # FROM): image -> template name; an entry whose template does not exist is pulled as
    # usual. Env: JSON object or `image=template,...`. Default: builds/aliases.py.
    image_aliases: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=lambda: dict(DEFAULT_IMAGE_ALIASES)
    )

    # The layer cache: capacity in GiB (0 = unbounded) and watermarks as fractions of it.
    # When usage exceeds `high`, unreferenced layers are evicted (least recently used first)
    # until usage is below `low`.
    layer_cache_gb: float = Field(default=20.0, ge=0)
    layer_cache_high: float = Field(default=0.9, gt=0, le=1)
    layer_cache_low: float = Field(default=0.7, gt=0, le=1)

    @field_validator(
        "insecure_registries", "search_registries", "allowed_registries", mode="before"
    )
    @classmethod
    def _lists(cls, value: Any) -> Any:
        return _split_list(value)

    @field_validator("image_aliases", mode="before")
    @classmethod
    def _aliases(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("{"):
                return json.loads(text)
            pairs = [p.partition("=") for p in text.split(",") if p.strip()]
            if any(not sep or not k.strip() for k, sep, _v in pairs):
                raise ValueError("image_aliases: use image=template[,image=template...]")
            return {k.strip(): v.strip() for k, _sep, v in pairs}
        return value

    @field_validator("insecure_registries", "search_registries", "allowed_registries")
    @classmethod
    def _hosts(cls, value: list[str]) -> list[str]:
        return [normalize_registry(v) for v in value]

    @model_validator(mode="after")
    def _watermarks(self) -> ImageSettings:
        if self.layer_cache_low > self.layer_cache_high:
            raise ValueError("layer_cache_low must not exceed layer_cache_high")
        return self

    @property
    def layer_cache_bytes(self) -> int:
        return int(self.layer_cache_gb * GIB)


class SnapshotSettings(BaseModel):
    """The snapshot repository and the node's cache of memory images.

    ``snapshot_repo`` (``AENV_SNAPSHOT_REPO``)
        ``file:///abs/path`` (default: ``file://$AENV_HOME/repo``) or ``s3://bucket[/prefix]``.
    ``s3_endpoint``, ``s3_region``
        For S3-compatible servers (MinIO, Ceph, moto, R2...). Path-style requests are used
        when an endpoint is set; ``http://`` endpoints are allowed. Credentials come from the
        standard ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and ``AWS_SESSION_TOKEN``.
    ``snapshot_cache_size``
        Bound of the local checkpoint-image cache, e.g. ``20GiB`` (bytes owned by the cache
        only: files hard-linked with a local repository cost nothing and are not counted).
    ``snapshot_compression``
        ``auto`` (zstd for layer tars everywhere and for checkpoint files on S3, none for
        checkpoint files in a local repository, so they can be hard-linked), ``zstd`` or
        ``none``.
    """

    model_config = ConfigDict(extra="ignore")

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


SECRETS_KEY_BYTES = 32


def parse_secrets_key(text: str) -> bytes:
    """A key as AENV_SECRETS_KEY or the key file holds it: base64 (standard or URL-safe) of
    32 bytes."""
    raw = text.strip().replace("-", "+").replace("_", "/")
    try:
        key = base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the secrets key is not base64") from None
    if len(key) != SECRETS_KEY_BYTES:
        raise ValueError(
            f"the secrets key must be {SECRETS_KEY_BYTES} bytes (base64), not {len(key)}"
        )
    return key
