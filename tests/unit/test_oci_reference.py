"""Image references, search registries, allowlist and the image settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.config import ImageSettings, Settings
from aenv.errors import BadRequest, Forbidden
from aenv.images.reference import (
    Reference,
    candidates,
    is_qualified,
    normalize_registry,
    parse_reference,
)

D = "sha256:" + "a" * 64


@pytest.mark.parametrize(
    ("text", "registry", "repo", "tag", "digest"),
    [
        ("ubuntu:22.04", "docker.io", "library/ubuntu", "22.04", None),
        ("python", "docker.io", "library/python", "latest", None),
        ("org/app", "docker.io", "org/app", "latest", None),
        ("docker.io/ubuntu", "docker.io", "library/ubuntu", "latest", None),
        ("index.docker.io/library/ubuntu:20.04", "docker.io", "library/ubuntu", "20.04", None),
        ("ghcr.io/o/r:tag", "ghcr.io", "o/r", "tag", None),
        ("ghcr.io/o/sub/r", "ghcr.io", "o/sub/r", "latest", None),
        (f"host:5000/x@{D}", "host:5000", "x", None, D),
        (f"host:5000/x:v1@{D}", "host:5000", "x", "v1", D),
        ("localhost:5000/x", "localhost:5000", "x", "latest", None),
        ("localhost/x", "localhost", "x", "latest", None),
        ("127.0.0.1:5000/a/b-c_d.e:1.0-rc", "127.0.0.1:5000", "a/b-c_d.e", "1.0-rc", None),
        # As Docker: kept as written (lower-cased it would print as a Docker Hub path).
        ("Registry/x", "Registry", "x", "latest", None),
    ],
)
def test_parse(text: str, registry: str, repo: str, tag: str | None, digest: str | None) -> None:
    ref = parse_reference(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (registry, repo, tag, digest)


def test_api_host_and_forms() -> None:
    ref = parse_reference("ubuntu:22.04")
    assert ref.api_host == "registry-1.docker.io"
    assert str(ref) == "docker.io/library/ubuntu:22.04"
    assert ref.familiar == "ubuntu:22.04"
    assert ref.reference == "22.04"
    pinned = parse_reference(f"ghcr.io/o/r:t@{D}")
    assert pinned.reference == D and pinned.familiar == f"ghcr.io/o/r:t@{D}"
    assert parse_reference("localhost:5000/x").api_host == "localhost:5000"
    assert Reference("docker.io", "org/app", "1").familiar == "org/app:1"


@pytest.mark.parametrize(
    "text",
    ["", "UPPER", "a//b", "a:b:c", "x@sha256:123", "-x", "x:" + "t" * 200, "x:-tag", "a/B"],
)
def test_invalid(text: str) -> None:
    with pytest.raises(BadRequest):
        parse_reference(text)


def test_qualified_and_normalize() -> None:
    assert not is_qualified("ubuntu")
    assert not is_qualified("org/app:1")
    assert is_qualified("quay.io/x")
    assert is_qualified("localhost/x")
    assert normalize_registry("https://index.docker.io/v1/") == "docker.io"
    assert normalize_registry("HTTP://Registry.Example:5000/") == "registry.example:5000"


def test_candidates_search_and_allowlist() -> None:
    s = ImageSettings(search_registries=["quay.io", "docker.io"])
    got = candidates("app:1", s)
    assert [str(r) for r in got] == ["quay.io/app:1", "docker.io/library/app:1"]
    assert [str(r) for r in candidates("ghcr.io/o/r", s)] == ["ghcr.io/o/r:latest"]

    s = ImageSettings(search_registries=["quay.io", "docker.io"], allowed_registries=["docker.io"])
    assert [str(r) for r in candidates("app", s)] == ["docker.io/library/app:latest"]
    with pytest.raises(Forbidden, match="not allowed"):
        candidates("ghcr.io/o/r", s)
    s = ImageSettings(search_registries=["quay.io"], allowed_registries=["ghcr.io"])
    with pytest.raises(Forbidden):
        candidates("app", s)


def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AENV_CONFIG_FILE", str(tmp_path / "absent.toml"))
    monkeypatch.setenv("AENV_INSECURE_REGISTRIES", "127.0.0.1:5000, localhost:5001")
    monkeypatch.setenv("AENV_SEARCH_REGISTRIES", '["quay.io", "index.docker.io"]')
    monkeypatch.setenv("AENV_ALLOWED_REGISTRIES", "")
    monkeypatch.setenv("AENV_REGISTRY_CREDENTIALS", '{"ghcr.io": "u:p"}')
    monkeypatch.setenv("AENV_LAYER_CACHE_GB", "1.5")
    s = Settings(home=tmp_path).images
    assert s.insecure_registries == ["127.0.0.1:5000", "localhost:5001"]
    assert s.search_registries == ["quay.io", "docker.io"]
    assert s.allowed_registries == []
    assert s.registry_credentials == {"ghcr.io": "u:p"}
    assert s.layer_cache_bytes == int(1.5 * (1 << 30))
    with pytest.raises(ValueError):
        ImageSettings(layer_cache_high=0.5, layer_cache_low=0.8)
