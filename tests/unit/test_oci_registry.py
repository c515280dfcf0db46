"""The registry client against an in-process fake registry (tests/unit/fake_registry.py):
anonymous, bearer and Basic auth, docker config and challenge parsing, error shapes, manifest
digests and platform selection, blob downloads that resume after dropped connections.

The real thing (Debian's docker-registry, skopeo-pushed images) is exercised in
tests/integration/test_registry.py; these cover the protocol corners that a real registry
does not let us provoke on demand: dropped connections, registries without Range support,
Basic auth, error shapes.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.config import ImageSettings
from aenv.errors import BadRequest, Forbidden, NotFound, TooManyRequests, Unauthorized, Unavailable
from aenv.images.auth import Credential, load_docker_config, parse_challenge
from aenv.images.manifests import (
    DOCKER_MANIFEST_LIST,
    OCI_INDEX,
    OCI_MANIFEST,
    Descriptor,
    DigestMismatch,
    Platform,
    platform_score,
)
from aenv.images.reference import parse_reference
from aenv.images.registry import RegistryClient
from tests.unit.fake_registry import REF, REG, FakeRegistry, client_for, gz_layer, sha


async def test_anonymous_manifest_and_blob() -> None:
    reg = FakeRegistry()
    layer = gz_layer({"hello": b"world"})
    mdigest = reg.add_image("v1", [layer])
    async with client_for(reg) as c:
        img = await c.resolve(REF)
        assert img.digest == mdigest and img.manifest.media_type == OCI_MANIFEST
        assert img.manifest.layers[0].digest == sha(layer)
        chunks = [ch async for ch in c.iter_blob(REF, img.manifest.layers[0])]
        assert b"".join(chunks) == layer
    assert reg.requests[0].url == httpx.URL(f"http://{REG}/v2/")


async def test_bearer_token_flow_with_credentials() -> None:
    reg = FakeRegistry(auth="bearer", anonymous_token=False)
    reg.add_image("v1", [gz_layer({"a": b"1"})])
    async with client_for(reg, credentials={REG: "alice:secret"}) as c:
        img = await c.resolve(REF)
        await c.get_blob(REF, img.manifest.config)
    assert reg.tokens_issued == 1  # cached for the scope


async def test_bearer_bad_credentials_and_none() -> None:
    reg = FakeRegistry(auth="bearer", anonymous_token=False)
    reg.add_image("v1", [gz_layer({"a": b"1"})])
    async with client_for(reg, credentials={REG: ("alice", "wrong")}) as c:
        with pytest.raises(Unauthorized, match="bad credentials for registry reg.test:5000"):
            await c.resolve(REF)
    async with client_for(reg) as c:
        with pytest.raises(Unauthorized, match="requires credentials"):
            await c.resolve(REF)


async def test_anonymous_token_without_access_is_not_found() -> None:
    # Docker Hub's answer for missing (or private) repositories.
    reg = FakeRegistry(auth="bearer", anonymous_token=True)
    reg.add_image("v1", [gz_layer({"a": b"1"})])
    async with client_for(reg) as c:
        with pytest.raises(NotFound, match="not found in registry .* needs credentials"):
            await c.resolve(REF)


async def test_basic_auth_registry(tmp_path: Path) -> None:
    reg = FakeRegistry(auth="basic")
    reg.add_image("v1", [gz_layer({"a": b"1"})])
    cfg = tmp_path / "config.json"
    auth = base64.b64encode(b"alice:secret").decode()
    cfg.write_text(json.dumps({"auths": {f"https://{REG}": {"auth": auth}}}))
    settings = ImageSettings(insecure_registries=[REG], docker_config=cfg)
    async with RegistryClient(settings, transport=httpx.MockTransport(reg.handler)) as c:
        await c.resolve(REF)
    async with client_for(reg, credentials={REG: "alice:nope"}) as c:
        with pytest.raises(Unauthorized, match="bad credentials"):
            await c.resolve(REF)


def test_docker_config_parsing(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "auths": {
                    "https://index.docker.io/v1/": {"auth": base64.b64encode(b"u:p:w").decode()},
                    "ghcr.io": {"username": "x", "password": "y"},
                    "broken": {"auth": "!!!"},
                    "empty": {},
                },
                "credsStore": "desktop",
            }
        )
    )
    creds = load_docker_config(cfg)
    assert creds["docker.io"] == Credential("u", "p:w")
    assert creds["ghcr.io"] == Credential("x", "y")
    assert "empty" not in creds
    assert load_docker_config(tmp_path / "missing.json") == {}


def test_challenge_parsing() -> None:
    c = parse_challenge(
        'Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
        'scope="repository:library/ubuntu:pull,push",error="insufficient_scope"'
    )
    assert c is not None and c.scheme == "bearer"
    assert c.params["realm"] == "https://auth.docker.io/token"
    assert c.params["scope"] == "repository:library/ubuntu:pull,push"
    assert c.params["error"] == "insufficient_scope"
    b = parse_challenge("Basic realm=Registry")
    assert b is not None and b.scheme == "basic" and b.params["realm"] == "Registry"
    assert parse_challenge("") is None


async def test_error_mapping() -> None:
    reg = FakeRegistry()
    reg.add_image("v1", [gz_layer({"a": b"1"})])
    async with client_for(reg) as c:
        with pytest.raises(NotFound, match=f"image {REG}/app:nope not found in registry {REG}"):
            await c.resolve(parse_reference(f"{REG}/app:nope"))
        with pytest.raises(NotFound):
            await c.resolve(parse_reference(f"{REG}/other:v1"))
    for code, exc in ((403, Forbidden), (429, TooManyRequests)):
        reg.status_override["/v2/app/manifests/v1"] = code
        async with client_for(reg) as c:
            with pytest.raises(exc):
                await c.resolve(REF)


async def test_unreachable_registry() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused")

    settings = ImageSettings(insecure_registries=[REG])
    async with RegistryClient(settings, transport=httpx.MockTransport(refuse), retries=1) as c:
        with pytest.raises(Unavailable, match=f"registry {REG} unreachable: .*refused"):
            await c.resolve(REF)


async def test_manifest_digest_is_verified() -> None:
    reg = FakeRegistry()
    d = reg.add_image("v1", [gz_layer({"a": b"1"})])
    mt, raw = reg.manifests[d]
    reg.manifests[d] = (mt, raw + b" ")
    async with client_for(reg) as c:
        with pytest.raises(DigestMismatch, match="failed verification"):
            await c.get_manifest(REF, d)


async def test_schema1_is_refused() -> None:
    reg = FakeRegistry()
    reg.add_manifest(
        "old", "application/vnd.docker.distribution.manifest.v1+prettyjws", {"schemaVersion": 1}
    )
    async with client_for(reg) as c:
        with pytest.raises(BadRequest, match="schema 1"):
            await c.resolve(parse_reference(f"{REG}/app:old"))


@pytest.mark.parametrize("index_type", [OCI_INDEX, DOCKER_MANIFEST_LIST])
async def test_platform_selection(index_type: str) -> None:
    reg = FakeRegistry()
    amd = reg.add_image(None, [gz_layer({"arch": b"amd64"})], arch="amd64")
    arm = reg.add_image(None, [gz_layer({"arch": b"arm64"})], arch="arm64")

    def entry(d: str, arch: str, variant: str | None = None, os_: str = "linux") -> dict[str, Any]:
        plat: dict[str, str] = {"os": os_, "architecture": arch}
        if variant:
            plat["variant"] = variant
        return {
            "mediaType": OCI_MANIFEST,
            "digest": d,
            "size": len(reg.manifests[d][1]),
            "platform": plat,
        }

    idx = reg.add_manifest(
        "multi",
        index_type,
        {
            "schemaVersion": 2,
            "mediaType": index_type,
            "manifests": [
                entry(arm, "arm64", "v8"),
                entry(amd, "amd64"),
                entry(amd, "unknown", os_="unknown"),
            ],
        },
    )
    ref = parse_reference(f"{REG}/app:multi")
    async with client_for(reg) as c:
        a = await c.resolve(ref, Platform.parse("linux/amd64"))
        assert a.digest == idx and a.manifest.digest == amd and str(a.platform) == "linux/amd64"
        b = await c.resolve(ref, Platform.parse("linux/arm64"))
        assert b.manifest.digest == arm
        with pytest.raises(NotFound, match="no variant for platform linux/s390x .*linux/arm64/v8"):
            await c.resolve(ref, Platform.parse("linux/s390x"))


def test_platform_matching() -> None:
    p = Platform.parse
    assert platform_score(p("linux/arm64"), p("linux/arm64/v8")) is not None
    assert platform_score(p("linux/arm64/v8"), p("linux/arm64")) is not None
    assert platform_score(p("linux/arm/v7"), p("linux/arm/v6")) is None
    assert platform_score(p("linux/amd64"), p("linux/arm64")) is None
    assert platform_score(p("linux/amd64"), p("linux/amd64")) == 2
    assert p("x86_64") == Platform("linux", "amd64")
    assert Platform.host().os == "linux"


@pytest.mark.parametrize("ranges", [True, False])
async def test_blob_download_resumes_after_drops(ranges: bool) -> None:
    reg = FakeRegistry(ranges=ranges)
    data = os.urandom(100_000)
    d = reg.add_blob(data)
    reg.fail_blob_after[d] = [20_480, 61_440]
    desc = Descriptor("application/octet-stream", d, len(data))
    async with client_for(reg) as c:
        got = b"".join([ch async for ch in c.iter_blob(REF, desc)])
    assert got == data
    blob_gets = [r for r in reg.requests if "/blobs/" in r.url.path]
    assert len(blob_gets) == 3
    if ranges:
        assert blob_gets[1].headers["range"] == "bytes=20480-"
        assert blob_gets[2].headers["range"] == "bytes=61440-"


async def test_blob_download_gives_up_after_retries() -> None:
    reg = FakeRegistry()
    data = os.urandom(50_000)
    d = reg.add_blob(data)
    reg.fail_blob_after[d] = [8192] * 4  # no progress after the first drop
    async with client_for(reg) as c:
        with pytest.raises(Unavailable, match="failed at byte"):
            async for _ in c.iter_blob(REF, Descriptor("x", d, len(data))):
                pass
