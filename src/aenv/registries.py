"""Registry names, which settings and the image layer both read: Docker Hub's several
spellings fold into one name, so an allowlist, a credential or a mirror set for any of them
applies to all."""

from __future__ import annotations

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"
_HUB_ALIASES = {"docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com"}


def normalize_registry(host: str) -> str:
    """Canonical registry name: lower-case host, no scheme or path, Docker Hub aliases folded.

    Accepts the key forms found in docker config files (`https://index.docker.io/v1/`)."""
    h = host.strip()
    for scheme in ("https://", "http://"):
        if h.lower().startswith(scheme):
            h = h[len(scheme) :]
    h = h.split("/", 1)[0].lower()
    if h in _HUB_ALIASES:
        return DOCKER_HUB
    return h
