"""Image references: `ubuntu:22.04`, `python`, `ghcr.io/o/r:tag`, `host:5000/x@sha256:...`.

The grammar and the defaults follow Docker's (distribution/reference): the first path
component is a registry when it contains `.` or `:`, is `localhost`, or has upper-case
letters; otherwise the name is *unqualified* and lives on a search registry (`docker.io`
unless configured), where single-component names get the `library/` prefix. Without tag or
digest the tag is `latest`. `docker.io` is the name; its API host is `registry-1.docker.io`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..config import ImageSettings
from ..errors import BadRequest, Forbidden
from ..registries import DOCKER_HUB, DOCKER_HUB_API, normalize_registry

_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_PATH_RE = re.compile(rf"^{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*$")
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN_RE = re.compile(
    rf"^(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?$"
)
_TAG_RE = re.compile(r"^[\w][\w.-]{0,127}$")
_DIGEST_RE = re.compile(r"^(sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128})$")


@dataclass(frozen=True)
class Reference:
    registry: str  # "docker.io", "ghcr.io", "127.0.0.1:5000"
    repository: str  # "library/ubuntu"
    tag: str | None = None
    digest: str | None = None

    @property
    def api_host(self) -> str:
        """host[:port] the registry's HTTP API is served from."""
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def reference(self) -> str:
        """What goes into `/v2/<name>/manifests/<reference>`: the digest if pinned."""
        return self.digest or self.tag or "latest"

    @property
    def name(self) -> str:
        """registry/repository without tag or digest."""
        return f"{self.registry}/{self.repository}"

    def with_digest(self, digest: str) -> Reference:
        return Reference(self.registry, self.repository, self.tag, digest)

    def __str__(self) -> str:
        s = self.name
        if self.tag:
            s += f":{self.tag}"
        if self.digest:
            s += f"@{self.digest}"
        return s

    @property
    def familiar(self) -> str:
        """The short form Docker prints (`ubuntu:22.04`, `ghcr.io/o/r:tag`)."""
        name = self.repository
        if self.registry == DOCKER_HUB:
            if name.startswith("library/") and name.count("/") == 1:
                name = name[len("library/") :]
        else:
            name = f"{self.registry}/{name}"
        if self.tag:
            name += f":{self.tag}"
        if self.digest:
            name += f"@{self.digest}"
        return name


def _is_domain(component: str) -> bool:
    return (
        "." in component
        or ":" in component
        or component == "localhost"
        or component.lower() != component
    )


def split_reference(text: str) -> tuple[str | None, str, str | None, str | None]:
    """(registry or None when unqualified, path, tag, digest); validates the grammar."""
    s = text.strip()
    if not s:
        raise BadRequest("empty image reference")
    digest: str | None = None
    if "@" in s:
        s, digest = s.rsplit("@", 1)
        if not _DIGEST_RE.fullmatch(digest):
            raise BadRequest(f"invalid digest in image reference {text!r}")
    tag: str | None = None
    slash = s.rfind("/")
    colon = s.rfind(":")
    if colon > slash:
        s, tag = s[:colon], s[colon + 1 :]
        if not _TAG_RE.fullmatch(tag):
            raise BadRequest(f"invalid tag in image reference {text!r}")
    registry: str | None = None
    first, sep, rest = s.partition("/")
    if sep and _is_domain(first):
        if not _DOMAIN_RE.fullmatch(first):
            raise BadRequest(f"invalid registry in image reference {text!r}")
        registry, s = normalize_registry(first), rest
        if not _is_domain(registry):
            # Only its upper case made it a registry (`Host/x`): lower-cased it would read
            # as a Docker Hub path when printed and parsed again, so it is kept as written.
            registry = first
    if not _PATH_RE.fullmatch(s) or len(s) > 255:
        raise BadRequest(f"invalid image reference {text!r}")
    return registry, s, tag, digest


def parse_reference(text: str, default_registry: str = DOCKER_HUB) -> Reference:
    """Parses a reference, filling in registry, `library/` (Docker Hub only) and `latest`."""
    registry, path, tag, digest = split_reference(text)
    registry = registry or normalize_registry(default_registry)
    if registry == DOCKER_HUB and "/" not in path:
        path = f"library/{path}"
    if tag is None and digest is None:
        tag = "latest"
    return Reference(registry, path, tag, digest)


def is_qualified(text: str) -> bool:
    """True when the reference names its registry."""
    return split_reference(text)[0] is not None


def check_allowed(ref: Reference, settings: ImageSettings) -> None:
    allowed = [normalize_registry(r) for r in settings.allowed_registries]
    if allowed and ref.registry not in allowed:
        raise Forbidden(
            f"registry {ref.registry} is not allowed (allowed: {', '.join(allowed)})",
            error_code="registry_not_allowed",
        )


def candidates(text: str, settings: ImageSettings) -> list[Reference]:
    """The references to try for `text`, in order.

    Qualified names give exactly one (refused when the allowlist excludes its registry);
    unqualified names give one per search registry that the allowlist permits."""
    registry, _path, _tag, _digest = split_reference(text)
    if registry is not None:
        ref = parse_reference(text)
        check_allowed(ref, settings)
        return [ref]
    search = [normalize_registry(r) for r in settings.search_registries] or [DOCKER_HUB]
    allowed = {normalize_registry(r) for r in settings.allowed_registries}
    refs = [parse_reference(text, r) for r in search if not allowed or r in allowed]
    if not refs:
        raise Forbidden(
            f"none of the search registries ({', '.join(search)}) is allowed for {text!r}",
            error_code="registry_not_allowed",
        )
    return refs
