"""Registry client and pull against an in-process fake registry (httpx MockTransport).

The real thing (Debian's docker-registry, skopeo-pushed images) is exercised in
tests/integration/test_registry.py; these cover the protocol corners that a real registry
does not let us provoke on demand: dropped connections, registries without Range support,
Basic auth, error shapes.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import tarfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.config import ImageSettings
from aenv.errors import BadRequest, Forbidden, NotFound, TooManyRequests, Unauthorized, Unavailable
from aenv.images.auth import Credential, load_docker_config, parse_challenge
from aenv.images.cache import LayerCache
from aenv.images.layers import LayerStore
from aenv.images.manifests import (
    DOCKER_MANIFEST_LIST,
    OCI_INDEX,
    OCI_MANIFEST,
    Descriptor,
    DigestMismatch,
    Platform,
    platform_score,
)
from aenv.images.pull import LayerProgress, pull
from aenv.images.reference import parse_reference
from aenv.images.registry import RegistryClient

REG = "reg.test:5000"


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def layer_tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class _Body(httpx.AsyncByteStream):
    def __init__(self, data: bytes, fail_after: int | None) -> None:
        self.data = data
        self.fail_after = fail_after

    async def __aiter__(self) -> AsyncIterator[bytes]:
        step = 4096
        for i in range(0, len(self.data), step):
            if self.fail_after is not None and i >= self.fail_after:
                raise httpx.ReadError("connection reset by peer")
            yield self.data[i : i + step]


@dataclass
class FakeRegistry:
    """Serves one repository; optional Bearer or Basic auth, failure injection."""

    auth: str | None = None  # None | "bearer" | "basic"
    user: tuple[str, str] = ("alice", "secret")
    anonymous_token: bool = True
    ranges: bool = True
    manifests: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # ref -> (type, body)
    blobs: dict[str, bytes] = field(default_factory=dict)
    fail_blob_after: dict[str, list[int]] = field(default_factory=dict)  # digest -> offsets
    status_override: dict[str, int] = field(default_factory=dict)  # path -> status
    requests: list[httpx.Request] = field(default_factory=list)
    tokens_issued: int = 0

    def add_blob(self, data: bytes) -> str:
        d = sha(data)
        self.blobs[d] = data
        return d

    def add_manifest(self, tag: str | None, media_type: str, body: dict[str, Any]) -> str:
        raw = json.dumps(body).encode()
        d = sha(raw)
        self.manifests[d] = (media_type, raw)
        if tag:
            self.manifests[tag] = (media_type, raw)
        return d

    def add_image(self, tag: str | None, layers: list[bytes], arch: str = "amd64") -> str:
        diff_ids = [sha(gzip.decompress(b)) for b in layers]
        config = json.dumps(
            {
                "architecture": arch,
                "os": "linux",
                "config": {"Env": ["PATH=/bin", "A=1"], "Cmd": ["sh"], "WorkingDir": "/w"},
                "rootfs": {"type": "layers", "diff_ids": diff_ids},
            }
        ).encode()
        cd = self.add_blob(config)
        descs = []
        for b in layers:
            descs.append(
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": self.add_blob(b),
                    "size": len(b),
                }
            )
        return self.add_manifest(
            tag,
            OCI_MANIFEST,
            {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": {
                    "mediaType": "application/vnd.oci.image.config.v1+json",
                    "digest": cd,
                    "size": len(config),
                },
                "layers": descs,
            },
        )

    def _authorized(self, request: httpx.Request) -> bool:
        h = request.headers.get("authorization", "")
        if self.auth is None:
            return True
        if self.auth == "basic":
            want = base64.b64encode(f"{self.user[0]}:{self.user[1]}".encode()).decode()
            return h == f"Basic {want}"
        return h in ("Bearer good-token", "Bearer anon-token") and (
            h == "Bearer good-token" or "pull" in self._anon_scope
        )

    _anon_scope = ""

    def _challenge(self) -> dict[str, str]:
        if self.auth == "basic":
            return {"www-authenticate": 'Basic realm="fake"'}
        return {
            "www-authenticate": f'Bearer realm="https://auth.test/token",service="{REG}",'
            'scope="repository:app:pull"'
        }

    async def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        url = request.url
        if url.host == "auth.test":
            return self._token(request)
        path = url.path
        if path in self.status_override:
            code = self.status_override[path]
            return httpx.Response(
                code, json={"errors": [{"code": "X", "message": f"status {code}"}]}
            )
        if not self._authorized(request):
            return httpx.Response(
                401,
                headers=self._challenge(),
                json={"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]},
            )
        if path == "/v2/":
            return httpx.Response(200, json={})
        if path.startswith("/v2/app/manifests/"):
            ref = path.rsplit("/", 1)[1]
            if ref not in self.manifests:
                return httpx.Response(
                    404,
                    json={"errors": [{"code": "MANIFEST_UNKNOWN", "message": "manifest unknown"}]},
                )
            mt, raw = self.manifests[ref]
            return httpx.Response(
                200, content=raw, headers={"content-type": mt, "docker-content-digest": sha(raw)}
            )
        if path.startswith("/v2/app/blobs/"):
            d = path.rsplit("/", 1)[1]
            if d not in self.blobs:
                return httpx.Response(404, json={"errors": [{"code": "BLOB_UNKNOWN"}]})
            data = self.blobs[d]
            start = 0
            status = 200
            rng = request.headers.get("range")
            if rng and self.ranges:
                start = int(rng.split("=")[1].split("-")[0])
                status = 206
            fails = self.fail_blob_after.get(d) or []
            fail_after = fails.pop(0) - start if fails else None
            body = data[start:]
            headers = {"content-length": str(len(body))}
            if status == 206:
                headers["content-range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return httpx.Response(status, headers=headers, stream=_Body(body, fail_after))
        return httpx.Response(404, json={"errors": [{"code": "NAME_UNKNOWN"}]})

    def _token(self, request: httpx.Request) -> httpx.Response:
        h = request.headers.get("authorization")
        want = "Basic " + base64.b64encode(f"{self.user[0]}:{self.user[1]}".encode()).decode()
        if h is None:
            if not self.anonymous_token:
                return httpx.Response(401)
            self.tokens_issued += 1
            return httpx.Response(200, json={"token": "anon-token", "expires_in": 300})
        if h != want:
            return httpx.Response(401, json={"details": "bad credentials"})
        assert request.url.params["scope"] == "repository:app:pull"
        assert request.url.params["service"] == REG
        self.tokens_issued += 1
        return httpx.Response(200, json={"access_token": "good-token", "expires_in": 300})


def client_for(reg: FakeRegistry, **kw: Any) -> RegistryClient:
    settings = ImageSettings(
        insecure_registries=[REG], docker_config=Path("/nonexistent/config.json")
    )
    return RegistryClient(settings, transport=httpx.MockTransport(reg.handler), retries=2, **kw)


REF = parse_reference(f"{REG}/app:v1")


def gz_layer(files: dict[str, bytes]) -> bytes:
    return gzip.compress(layer_tar(files))


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


# --- pull, end to end against the fake ---
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="unpacking needs root")


@needs_root
async def test_pull_into_store(tmp_path: Path) -> None:
    reg = FakeRegistry()
    l1 = gz_layer({"etc/os-release": b"ID=test\n", "bin/sh": b"#!"})
    l2 = gz_layer({"etc/extra": b"x"})
    reg.add_image("v1", [l1, l2])
    store = LayerStore(tmp_path / "layers")
    events: list[LayerProgress] = []
    settings = ImageSettings(insecure_registries=[REG], layer_cache_gb=0)
    async with client_for(reg) as c:
        img = await pull(
            settings, store, f"{REG}/app:v1", client=c, progress=events.append, holder="template:t1"
        )
    assert img.layers == [sha(l2), sha(l1)]
    assert img.config.env == ["PATH=/bin", "A=1"] and img.config.cmd == ["sh"]
    assert img.config.workdir == "/w" and img.platform == "linux/amd64"
    assert (store.path(sha(l1)) / "etc/os-release").read_bytes() == b"ID=test\n"
    meta = json.loads((store.layer_dir(sha(l1)) / "meta.json").read_text())
    assert meta["diff_id"] == sha(gzip.decompress(l1)) and meta["compression"] == "gzip"
    assert {e.status for e in events} >= {"waiting", "downloading", "done"}
    assert LayerCache(store).held_by("template:t1") == sorted([sha(l1), sha(l2)])
    assert not any(h.startswith("pull:") for d in img.layers for h in LayerCache(store).holders(d))

    # Pulled again: nothing is downloaded.
    reg.requests.clear()
    events.clear()
    async with client_for(reg) as c:
        await pull(settings, store, f"{REG}/app:v1", client=c, progress=events.append)
    assert not [
        r
        for r in reg.requests
        if "/blobs/sha256" in r.url.path and r.url.path.endswith((sha(l1)[7:], sha(l2)[7:]))
    ]
    assert {e.status for e in events} == {"waiting", "present"}


@needs_root
async def test_pull_resumes_from_partial_file(tmp_path: Path) -> None:
    reg = FakeRegistry()
    big = gz_layer({"blob": os.urandom(400_000)})
    reg.add_image("v1", [big])
    d = sha(big)
    # Every attempt of the first pull fails after 100 KiB: the pull fails, a partial remains.
    reg.fail_blob_after[d] = [102_400] * 3
    store = LayerStore(tmp_path / "layers")
    settings = ImageSettings(insecure_registries=[REG], layer_cache_gb=0)
    async with client_for(reg) as c:
        with pytest.raises(Unavailable):
            await pull(settings, store, f"{REG}/app:v1", client=c)
    partial = store.root / ".partial" / f"sha256-{d[7:]}"
    assert partial.stat().st_size == 102_400
    assert not store.has(d)
    reg.requests.clear()
    async with client_for(reg) as c:
        await pull(settings, store, f"{REG}/app:v1", client=c)
    assert store.has(d) and not partial.exists()
    gets = [r for r in reg.requests if r.url.path.endswith(d)]
    assert [r.headers.get("range") for r in gets] == ["bytes=102400-"]


@needs_root
async def test_pull_tampered_layer_fails_and_drops_partial(tmp_path: Path) -> None:
    reg = FakeRegistry()
    layer = gz_layer({"f": os.urandom(10_000)})
    reg.add_image("v1", [layer])
    d = sha(layer)
    bad = bytearray(layer)
    bad[100] ^= 1
    reg.blobs[d] = bytes(bad)
    store = LayerStore(tmp_path / "layers")
    async with client_for(reg) as c:
        with pytest.raises(DigestMismatch, match=f"layer {d} .* failed verification"):
            await pull(ImageSettings(layer_cache_gb=0), store, f"{REG}/app:v1", client=c)
    assert not store.has(d)
    assert not (store.root / ".partial" / f"sha256-{d[7:]}").exists()
    assert list((store.root / ".tmp").iterdir()) == []


@needs_root
async def test_concurrent_pulls_share_downloads(tmp_path: Path) -> None:
    import asyncio

    reg = FakeRegistry()
    layer = gz_layer({"f": os.urandom(200_000)})
    reg.add_image("v1", [layer])
    store = LayerStore(tmp_path / "layers")
    settings = ImageSettings(layer_cache_gb=0)
    async with client_for(reg) as c:
        a, b = await asyncio.gather(
            pull(settings, store, f"{REG}/app:v1", client=c),
            pull(settings, store, f"{REG}/app:v1", client=c),
        )
    assert a.layers == b.layers
    assert len([r for r in reg.requests if r.url.path.endswith(sha(layer))]) == 1


@needs_root
async def test_search_registries_fall_through(tmp_path: Path) -> None:
    reg = FakeRegistry()
    reg.add_image("v1", [gz_layer({"f": b"x"})])
    other = "empty.test:5000"

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "empty.test":
            if request.url.path == "/v2/":
                return httpx.Response(200)
            return httpx.Response(404, json={"errors": [{"code": "NAME_UNKNOWN"}]})
        return await reg.handler(request)

    settings = ImageSettings(
        insecure_registries=[REG, other], search_registries=[other, REG], layer_cache_gb=0
    )
    store = LayerStore(tmp_path / "layers")
    async with RegistryClient(settings, transport=httpx.MockTransport(handler)) as c:
        img = await pull(settings, store, "app:v1", client=c)
        assert img.reference == f"{REG}/app:v1"
        with pytest.raises(NotFound, match="not found in any search registry"):
            await pull(settings, store, "app:nope", client=c)
