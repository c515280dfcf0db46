"""The OCI image data model: media types, digests, platforms, descriptors and manifests.

Plain records parsed from registry JSON, with the checks every consumer relies on (a
descriptor's digest is well-formed, a platform is selected from an index by fit).
"""

from __future__ import annotations

import hashlib
import platform as _platform
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import BadGateway, BadRequest, NotFound
from .reference import Reference

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_SCHEMA1 = "application/vnd.docker.distribution.manifest.v1+json"
DOCKER_SCHEMA1_SIGNED = "application/vnd.docker.distribution.manifest.v1+prettyjws"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"

IMAGE_MANIFESTS = (OCI_MANIFEST, DOCKER_MANIFEST)
INDEXES = (OCI_INDEX, DOCKER_MANIFEST_LIST)
ACCEPT = ", ".join((OCI_INDEX, DOCKER_MANIFEST_LIST, OCI_MANIFEST, DOCKER_MANIFEST))

_DIGEST_RE = re.compile(r"^(sha256|sha512):([0-9a-f]+)$")


class DigestMismatch(BadGateway):
    """Content from a registry does not hash to the digest that names it."""


def compute_digest(data: bytes, algo: str = "sha256") -> str:
    return f"{algo}:{hashlib.new(algo, data).hexdigest()}"


def is_digest(text: str) -> bool:
    return bool(_DIGEST_RE.match(text))


def digest_algo(digest: str) -> str:
    m = _DIGEST_RE.match(digest)
    if not m:
        raise BadGateway(f"unsupported digest {digest!r}")
    return m.group(1)


# --- platforms ---
@dataclass(frozen=True)
class Platform:
    os: str
    architecture: str
    variant: str | None = None

    def __str__(self) -> str:
        s = f"{self.os}/{self.architecture}"
        return f"{s}/{self.variant}" if self.variant else s

    @classmethod
    def parse(cls, text: str) -> Platform:
        parts = text.strip().lower().split("/")
        if len(parts) == 1:
            parts = ["linux", parts[0]]
        if len(parts) not in (2, 3) or not all(parts):
            raise BadRequest(f"invalid platform {text!r} (want os/arch[/variant])")
        os_, arch = parts[0], _ARCH_ALIASES.get(parts[1], parts[1])
        return cls(os_, arch, parts[2] if len(parts) == 3 else None)

    @classmethod
    def host(cls) -> Platform:
        machine = _platform.machine().lower()
        arch, variant = _MACHINES.get(machine, (machine, None))
        return cls("linux", arch, variant)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Platform:
        return cls(
            str(obj.get("os", "")),
            str(obj.get("architecture", "")),
            obj.get("variant") or None,
        )


_ARCH_ALIASES = {"x86_64": "amd64", "x86-64": "amd64", "aarch64": "arm64", "i386": "386"}
_MACHINES: dict[str, tuple[str, str | None]] = {
    "x86_64": ("amd64", None),
    "amd64": ("amd64", None),
    "aarch64": ("arm64", "v8"),
    "arm64": ("arm64", "v8"),
    "armv7l": ("arm", "v7"),
    "armv6l": ("arm", "v6"),
    "i386": ("386", None),
    "i686": ("386", None),
    "ppc64le": ("ppc64le", None),
    "s390x": ("s390x", None),
    "riscv64": ("riscv64", None),
}
# The variant an entry without one is taken to have.
_DEFAULT_VARIANT = {"arm64": "v8", "arm": "v7"}


def platform_score(want: Platform, have: Platform) -> int | None:
    """How well an index entry's platform fits: None if not at all, higher is better."""
    if have.os != want.os or have.architecture != want.architecture:
        return None
    default = _DEFAULT_VARIANT.get(want.architecture)
    want_v = want.variant or default
    have_v = have.variant or default
    if want_v == have_v:
        return 2 if have.variant == want.variant else 1
    if want.variant is None:
        return 0  # no preference stated: any variant will do, after the better ones
    return None


# --- descriptors and manifests ---
@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: Platform | None = None
    annotations: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Descriptor:
        try:
            digest = str(obj["digest"])
            size = int(obj["size"])
        except (KeyError, TypeError, ValueError):
            raise BadGateway(f"malformed descriptor in manifest: {obj!r}") from None
        digest_algo(digest)
        plat = obj.get("platform")
        return cls(
            media_type=str(obj.get("mediaType", "")),
            digest=digest,
            size=size,
            platform=Platform.from_json(plat) if isinstance(plat, Mapping) else None,
            annotations=dict(obj.get("annotations") or {}),
        )


@dataclass(frozen=True)
class Manifest:
    media_type: str
    digest: str
    raw: bytes
    body: Mapping[str, Any]

    @property
    def is_index(self) -> bool:
        return self.media_type in INDEXES

    @property
    def entries(self) -> list[Descriptor]:
        return [Descriptor.from_json(m) for m in self.body.get("manifests") or []]

    @property
    def config(self) -> Descriptor:
        cfg = self.body.get("config")
        if not isinstance(cfg, Mapping):
            raise BadGateway(f"manifest {self.digest} has no config")
        return Descriptor.from_json(cfg)

    @property
    def layers(self) -> list[Descriptor]:
        """Layer descriptors, bottom first (as in the manifest)."""
        return [Descriptor.from_json(m) for m in self.body.get("layers") or []]


@dataclass(frozen=True)
class ResolvedImage:
    reference: Reference
    digest: str  # what the reference resolved to (the index's digest for multi-platform)
    manifest: Manifest  # the image manifest (for the selected platform)
    platform: Platform | None  # the selected platform, when chosen from an index


def select_platform(index: Manifest, want: Platform, ref: Reference) -> tuple[Descriptor, Platform]:
    best: tuple[int, Descriptor, Platform] | None = None
    available: list[str] = []
    for entry in index.entries:
        plat = entry.platform
        if plat is None or plat.os == "unknown" or entry.media_type not in IMAGE_MANIFESTS + ("",):
            continue  # attestation manifests and the like
        available.append(str(plat))
        score = platform_score(want, plat)
        if score is not None and (best is None or score > best[0]):
            best = (score, entry, plat)
    if best is None:
        raise NotFound(
            f"image {ref.familiar} has no variant for platform {want} "
            f"(available: {', '.join(available) or 'none'})",
            error_code="platform_not_found",
        )
    return best[1], best[2]
