"""The snapshot manifest: what a snapshot, template or hibernated sandbox is made of.

Stored as JSON at ``manifests/<id>.json`` in the repository, written last when publishing,
so a manifest never points at data that is not (yet) there. Objects it references:

- ``layers/<algo>-<hex>/<object sha256>.tar[.zst]`` — a layer's tar; the key carries the
  stored object's checksum, so an object under a key never changes and two nodes publishing
  the same layer at once cannot overwrite each other's bytes;
- ``images/<id>/<object sha256>/<file name>[.zst]`` — the files of a checkpoint (memory)
  image, each its own object so a 1 GiB ``pages.img`` streams without a tar around it.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import BadRequest
from ..images.layers import DIGEST_RE
from .artifacts import Compression
from .errors import ManifestCorrupt

MANIFEST_VERSION = 1
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

Kind = Literal["snapshot", "template", "hibernation"]


def check_id(snapshot_id: str) -> str:
    if not isinstance(snapshot_id, str) or not ID_RE.match(snapshot_id) or ".." in snapshot_id:
        raise BadRequest(f"invalid snapshot id {snapshot_id!r}")
    return snapshot_id


def manifest_key(snapshot_id: str) -> str:
    return f"manifests/{check_id(snapshot_id)}.json"


class ObjectRef(BaseModel):
    """One object in the repository and what its bytes must be."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str
    sha256: str  # hex, of the stored bytes
    size: int  # stored bytes
    compression: Compression = "none"
    raw_size: int | None = None  # bytes after decompression

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        if not _SHA256_RE.match(v):
            raise ValueError("sha256 must be 64 lowercase hex digits")
        return v


class LayerRef(BaseModel):
    """A layer of the snapshot's filesystem. `object` is None only in a draft that
    `SnapshotStore.publish` has not completed yet."""

    model_config = ConfigDict(extra="forbid")

    digest: str  # the layer's digest in the layer store (sha256:<hex>)
    size: int = 0  # apparent bytes of its files, unpacked
    object: ObjectRef | None = None

    @field_validator("digest")
    @classmethod
    def _digest(cls, v: str) -> str:
        if not DIGEST_RE.match(v):
            raise ValueError(f"invalid layer digest {v!r} (want sha256:<hex>)")
        return v


class CheckpointFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str  # file name inside the image directory
    mode: int = 0o644
    object: ObjectRef

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v or "/" in v or v.startswith(".") or "\0" in v:
            raise ValueError(f"invalid checkpoint file name {v!r}")
        return v


class CheckpointRef(BaseModel):
    """A memory image: the directory a runtime checkpointed into (e.g. runsc's
    ``checkpoint.img``, ``pages_meta.img``, ``pages.img``)."""

    model_config = ConfigDict(extra="forbid")

    files: list[CheckpointFile]

    @property
    def size(self) -> int:
        """Bytes of the image once restored locally."""
        return sum(f.object.raw_size or f.object.size for f in self.files)

    def fingerprint(self) -> str:
        """Short stable id of this exact image (changes when the image is replaced)."""
        body = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(body).hexdigest()[:16]


class Spec(BaseModel):
    """What the sandbox ran with; free for the orchestrator to extend."""

    model_config = ConfigDict(extra="allow")

    cpu_count: int | None = None
    memory_mb: int | None = None
    disk_mb: int | None = None
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    start_cmd: str | None = None
    ready_cmd: str | None = None


class Manifest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    version: int = MANIFEST_VERSION
    id: str
    kind: Kind = "snapshot"
    parent: str | None = None  # the snapshot/template this one descends from
    layers: list[LayerRef] = Field(default_factory=list)  # topmost first
    checkpoint: CheckpointRef | None = None
    spec: Spec = Field(default_factory=Spec)
    envd: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    backend: str = "gvisor"
    names: list[str] = Field(default_factory=list)
    metadata: dict[str, str] = Field(default_factory=dict)

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not ID_RE.match(v) or ".." in v:
            raise ValueError(f"invalid snapshot id {v!r}")
        return v

    @field_validator("version")
    @classmethod
    def _version(cls, v: int) -> int:
        if v > MANIFEST_VERSION:
            raise ValueError(f"manifest version {v} is newer than this node understands")
        return v

    @property
    def key(self) -> str:
        return manifest_key(self.id)

    @property
    def layer_digests(self) -> list[str]:
        return [layer.digest for layer in self.layers]

    def objects(self) -> list[ObjectRef]:
        """Every repository object this manifest needs (not counting itself)."""
        out = [layer.object for layer in self.layers if layer.object is not None]
        if self.checkpoint is not None:
            out.extend(f.object for f in self.checkpoint.files)
        return out

    def is_complete(self) -> bool:
        return all(layer.object is not None for layer in self.layers)

    def to_json(self) -> bytes:
        return (self.model_dump_json(indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes | str, *, snapshot_id: str = "") -> Manifest:
        try:
            return cls.model_validate_json(data)
        except ValidationError as e:
            where = f"manifest of snapshot {snapshot_id!r}" if snapshot_id else "manifest"
            errs = e.errors()
            detail = (
                f"{'.'.join(str(p) for p in errs[0]['loc'])}: {errs[0]['msg']}" if errs else str(e)
            )
            raise ManifestCorrupt(
                f"{where} is invalid ({detail})", snapshot_id=snapshot_id, artifact="manifest"
            ) from None
