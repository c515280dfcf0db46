"""Pulling from a real registry: Debian's `docker-registry` on loopback.

The tests build their own images as OCI layouts (oci_layouts.py: a busybox rootfs from the
host's static busybox, a three-layer image with whiteouts and an opaque directory in gzip, zstd
and plain layers, a two-platform index, small images for the cache bound), push them with
skopeo, and pull them through `aenv.images.pull`. A second registry instance serves the same
storage behind token auth (registry_servers.py); its token server signs RS256 JWTs with a key
generated for the session. Everything listens on 127.0.0.1 only and is stopped, and every
temporary directory removed, when the module is done.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.config import GIB, ImageSettings
from aenv.errors import NotFound, Unauthorized, Unavailable
from aenv.images.cache import LayerCache
from aenv.images.layers import LayerStore
from aenv.images.manifests import DigestMismatch
from aenv.images.pull import LayerProgress, pull
from aenv.images.registry import RegistryClient
from tests.helpers import free_port

from .oci_layouts import (
    BUSYBOX,
    BUSYBOX_CONFIG,
    LAYERED,
    NEEDS_REGISTRY,
    Entry,
    Layout,
    busybox_rootfs,
)
from .registry_servers import Registry, TokenServer, push, start_registry

pytestmark = [pytest.mark.integration, NEEDS_REGISTRY]


@dataclass
class Env:
    tmp: Path
    open: Registry
    token: Registry
    tokens: TokenServer
    layouts: dict[str, Layout]

    def settings(self, **kw: Any) -> ImageSettings:
        kw.setdefault("insecure_registries", [self.open.host, self.token.host])
        kw.setdefault("docker_config", self.tmp / "no-docker-config.json")
        kw.setdefault("layer_cache_gb", 0)
        return ImageSettings(**kw)

    def store(self) -> LayerStore:
        return LayerStore(Path(tempfile.mkdtemp(prefix="layers-", dir=self.tmp)))


N_CACHE_IMAGES = 6
CACHE_LAYER_BYTES = 300_000


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    tmp = Path(tempfile.mkdtemp(prefix="aenv-registry-it-"))
    started: list[Registry] = []
    tokens: TokenServer | None = None
    try:
        storage = tmp / "storage"
        storage.mkdir()
        open_reg = start_registry(tmp / "open", storage)
        started.append(open_reg)
        tokens = TokenServer(tmp, {"alice": "s3cret"})
        token_reg = start_registry(
            tmp / "token",
            storage,
            auth={
                "token": {
                    "realm": tokens.url,
                    "service": tokens.service,
                    "issuer": tokens.issuer,
                    "rootcertbundle": str(tokens.cert_path),
                }
            },
        )
        started.append(token_reg)

        layouts: dict[str, Layout] = {}
        lay = layouts["busybox"] = Layout(tmp / "oci-busybox")
        lay.tag("v1", lay.image([(busybox_rootfs(), "gzip")], BUSYBOX_CONFIG))
        push(lay, "v1", open_reg, "busybox")
        push(lay, "v1", open_reg, "busybox-v2s2", "--format", "v2s2")

        lay = layouts["layered"] = Layout(tmp / "oci-layered")
        lay.tag("v1", lay.image(LAYERED, {"Cmd": ["/bin/sh"]}))
        push(lay, "v1", open_reg, "layered", "--preserve-digests")  # keeps the plain layer

        lay = layouts["multi"] = Layout(tmp / "oci-multi")
        amd = lay.image([([Entry("arch", data=b"amd64")], "gzip")], arch="amd64")
        arm = lay.image([([Entry("arch", data=b"arm64")], "gzip")], arch="arm64", variant="v8")
        lay.tag("v1", lay.index([arm, amd]))
        push(lay, "v1", open_reg, "multi", "--all")

        lay = layouts["cache"] = Layout(tmp / "oci-cache")
        base = [Entry("etc", "dir", mode=0o755), Entry("etc/os-release", data=b"ID=base\n")]
        for i in range(N_CACHE_IMAGES):
            own = [Entry(f"data{i}", data=os.urandom(CACHE_LAYER_BYTES))]
            lay.tag(f"c{i}", lay.image([(base, "gzip"), (own, "gzip")]))
            push(
                lay,
                f"c{i}",
                open_reg,
                "cache",
            )

        lay = layouts["tamper"] = Layout(tmp / "oci-tamper")
        lay.tag("v1", lay.image([([Entry("f", data=os.urandom(100_000))], "gzip")]))
        push(lay, "v1", open_reg, "tamper")

        yield Env(tmp, open_reg, token_reg, tokens, layouts)
    finally:
        for reg in started:
            reg.stop()
        if tokens is not None:
            tokens.close()
        subprocess.run(["umount", "-R", "-l", str(tmp)], capture_output=True, check=False)
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def overlay(layers: list[Path], target: Path) -> Iterator[Path]:
    """A read-only overlay of layer directories (topmost first), as the runtime mounts it."""
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            "mount",
            "-t",
            "overlay",
            "overlay",
            "-o",
            "ro,lowerdir=" + ":".join(map(str, layers)),
            str(target),
        ],
        check=True,
        capture_output=True,
    )
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=False, capture_output=True)


# --- tests ---
async def test_pull_busybox_image(env: Env) -> None:
    store = env.store()
    events: list[LayerProgress] = []
    img = await pull(env.settings(), store, f"{env.open.host}/busybox:v1", progress=events.append)
    assert len(img.layers) == 1
    rootfs = store.path(img.layers[0])
    assert os.access(rootfs / "bin/busybox", os.X_OK)
    assert os.readlink(rootfs / "bin/sh") == "busybox"
    home = (rootfs / "home/user").stat()
    assert (home.st_uid, home.st_gid, home.st_mode & 0o7777) == (1000, 1000, 0o750)
    assert (rootfs / "tmp").stat().st_mode & 0o7777 == 0o1777
    # The image config, as a sandbox will honour it.
    assert img.config.env == ["PATH=/bin", "GREETING=hello"]
    assert img.config.workdir == "/home/user" and img.config.user == "1000:1000"
    assert img.config.entrypoint == ["/bin/sh", "-c"] and img.config.cmd == ["echo $GREETING"]
    assert img.platform == "linux/amd64"
    # The unpacked rootfs works.
    r = await asyncio.to_thread(
        subprocess.run,
        [
            shutil.which("chroot") or "/usr/sbin/chroot",
            f"--userspec={img.config.user}",
            str(rootfs),
            *img.config.entrypoint,
            *img.config.cmd,
        ],
        env=img.config.env_dict(),
        capture_output=True,
        text=True,
        check=True,
    )
    assert r.stdout == "hello\n"
    # Progress per layer, ending in "done"; byte counts add up.
    mine = [e for e in events if e.digest == img.layers[0]]
    assert mine[0].status == "waiting" and mine[-1].status == "done"
    assert mine[-1].done == mine[-1].total == img.size
    meta = json.loads((store.layer_dir(img.layers[0]) / "meta.json").read_text())
    assert meta["diff_id"] == img.diff_ids[0] and meta["compression"] == "gzip"


async def test_docker_schema2_manifest(env: Env) -> None:
    store = env.store()
    async with RegistryClient(env.settings()) as c:
        from aenv.images.reference import parse_reference

        resolved = await c.resolve(parse_reference(f"{env.open.host}/busybox-v2s2:v1"))
        assert (
            resolved.manifest.media_type == "application/vnd.docker.distribution.manifest.v2+json"
        )
        img = await pull(env.settings(), store, f"{env.open.host}/busybox-v2s2:v1", client=c)
    assert (store.path(img.layers[0]) / "bin/busybox").is_file()
    assert img.config.cmd == ["echo $GREETING"]


async def test_whiteouts_and_opaque_dirs_through_overlay(env: Env) -> None:
    store = env.store()
    img = await pull(env.settings(), store, f"{env.open.host}/layered:v1")
    assert len(img.layers) == 3
    compressions = [
        json.loads((store.layer_dir(d) / "meta.json").read_text())["compression"]
        for d in reversed(img.layers)
    ]
    assert compressions == ["gzip", "zstd", "none"]
    with overlay([store.path(d) for d in img.layers], env.tmp / "mnt-layered") as root:
        assert sorted(os.listdir(root / "etc")) == ["b", "b2", "c", "link"]
        assert (root / "etc/b").read_bytes() == b"new b"
        assert (root / "etc/b2").stat().st_ino == (root / "etc/b").stat().st_ino
        assert (root / "etc/link").read_bytes() == b"new b"
        assert os.listdir(root / "dir") == ["z"]  # opaque: x and y are hidden
        assert (root / "data/keep").read_bytes() == b"keep"
        assert not (root / "olddir").exists()
        assert (root / "bin/tool").stat().st_mode & 0o7777 == 0o4755
        c = (root / "etc/c").stat()
        assert (c.st_uid, c.st_gid, c.st_mode & 0o777) == (1000, 1000, 0o600)


async def test_multi_platform_index(env: Env) -> None:
    ref = f"{env.open.host}/multi:v1"
    for plat, want in (("linux/amd64", b"amd64"), ("linux/arm64", b"arm64")):
        store = env.store()
        img = await pull(env.settings(), store, ref, platform=plat)
        assert (store.path(img.layers[0]) / "arch").read_bytes() == want
        assert img.platform.startswith(plat)
    # The default is the host's platform (or pull_platform).
    store = env.store()
    img = await pull(env.settings(pull_platform="linux/arm64/v8"), store, ref)
    assert (store.path(img.layers[0]) / "arch").read_bytes() == b"arm64"
    with pytest.raises(NotFound, match="no variant for platform linux/s390x"):
        await pull(env.settings(), env.store(), ref, platform="linux/s390x")


async def test_layers_present_are_not_downloaded_again(env: Env) -> None:
    store = env.store()
    ref = f"{env.open.host}/layered:v1"
    await pull(env.settings(), store, ref)
    events: list[LayerProgress] = []
    seen: list[httpx.Request] = []

    class Recording(httpx.AsyncHTTPTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            seen.append(request)
            return await super().handle_async_request(request)

    async with RegistryClient(env.settings(), transport=Recording()) as c:
        await pull(env.settings(), store, ref, client=c, progress=events.append)
    assert {e.status for e in events} == {"waiting", "present"}
    blobs = [r for r in seen if "/blobs/" in r.url.path]
    assert len(blobs) == 1  # the config only


async def test_interrupted_download_resumes_with_range(env: Env) -> None:
    store = env.store()
    lay = env.layouts["busybox"]
    ((digest, blob),) = lay.layer_blobs.items()
    half = len(blob) // 2
    partial_dir = store.root / ".partial"
    partial_dir.mkdir(parents=True)
    (partial_dir / f"sha256-{digest[7:]}").write_bytes(blob[:half])
    seen: list[httpx.Request] = []

    class Recording(httpx.AsyncHTTPTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            seen.append(request)
            return await super().handle_async_request(request)

    async with RegistryClient(env.settings(), transport=Recording()) as c:
        img = await pull(env.settings(), store, f"{env.open.host}/busybox:v1", client=c)
    assert img.layers == [digest]
    gets = [r for r in seen if r.url.path.endswith(digest)]
    assert [r.headers.get("range") for r in gets] == [f"bytes={half}-"]
    want = await asyncio.to_thread(BUSYBOX.read_bytes)
    assert (store.path(digest) / "bin/busybox").read_bytes() == want
    assert not (partial_dir / f"sha256-{digest[7:]}").exists()


async def test_tampered_blob_fails_verification(env: Env) -> None:
    ((digest, blob),) = env.layouts["tamper"].layer_blobs.items()
    data = env.open.storage / "docker/registry/v2/blobs/sha256" / digest[7:9] / digest[7:] / "data"
    original = data.read_bytes()
    tampered = bytearray(original)
    tampered[len(tampered) // 2] ^= 0x55
    data.write_bytes(bytes(tampered))
    try:
        store = env.store()
        with pytest.raises(DigestMismatch, match=f"layer {digest} .* failed verification"):
            await pull(env.settings(), store, f"{env.open.host}/tamper:v1")
        assert not store.has(digest)
        assert not any((store.root / ".partial").glob("sha256-*"))
    finally:
        data.write_bytes(original)


async def test_unknown_image_and_tag(env: Env) -> None:
    with pytest.raises(
        NotFound,
        match=f"image {env.open.host}/nothing:latest not found in registry {env.open.host}",
    ):
        await pull(env.settings(), env.store(), f"{env.open.host}/nothing")
    with pytest.raises(NotFound, match="busybox:nope not found"):
        await pull(env.settings(), env.store(), f"{env.open.host}/busybox:nope")


async def test_unreachable_registry(env: Env) -> None:
    host = f"127.0.0.1:{free_port()}"
    # Refused at once (nothing listens), not after retries that outlast the wait.
    with pytest.raises(Unavailable, match=f"registry {host} unreachable"):
        await asyncio.wait_for(
            pull(env.settings(insecure_registries=[host]), env.store(), f"{host}/x:1"), 15
        )


async def test_plain_http_only_when_listed(env: Env) -> None:
    with pytest.raises(Unavailable, match="AENV_INSECURE_REGISTRIES"):
        await pull(env.settings(insecure_registries=[]), env.store(), f"{env.open.host}/busybox:v1")


async def test_token_auth_with_credentials(env: Env) -> None:
    store = env.store()
    ref = f"{env.token.host}/layered:v1"
    img = await pull(env.settings(), store, ref, credentials={env.token.host: "alice:s3cret"})
    assert len(img.layers) == 3
    assert any(r["auth"] for r in env.tokens.requests)
    scopes = {s for r in env.tokens.requests for s in r["query"].get("scope", [])}
    assert "repository:layered:pull" in scopes


async def test_token_auth_credentials_from_docker_config(env: Env) -> None:
    cfg = env.tmp / "docker-config.json"
    auth = base64.b64encode(b"alice:s3cret").decode()
    cfg.write_text(json.dumps({"auths": {env.token.host: {"auth": auth}}}))
    store = env.store()
    img = await pull(env.settings(docker_config=cfg), store, f"{env.token.host}/busybox:v1")
    assert (store.path(img.layers[0]) / "bin/busybox").is_file()


async def test_token_auth_bad_or_missing_credentials(env: Env) -> None:
    ref = f"{env.token.host}/busybox:v1"
    with pytest.raises(Unauthorized, match=f"bad credentials for registry {env.token.host}"):
        await pull(env.settings(), env.store(), ref, credentials={env.token.host: "alice:wrong"})
    # Anonymous token without access: the registry cannot tell "missing" from "private".
    with pytest.raises(NotFound, match="needs credentials"):
        await pull(env.settings(), env.store(), ref)
    env.tokens.allow_anonymous = False
    try:
        with pytest.raises(Unauthorized, match="requires credentials"):
            await pull(env.settings(), env.store(), ref)
    finally:
        env.tokens.allow_anonymous = True


async def test_cache_bound_and_referenced_layers(env: Env) -> None:
    store = env.store()
    cache = LayerCache(store)
    capacity = 1_000_000
    settings = env.settings(
        layer_cache_gb=capacity / GIB, layer_cache_high=0.9, layer_cache_low=0.6
    )
    ref = f"{env.open.host}/cache"
    # A "running sandbox" on c0: its layers are referenced and mounted.
    running = await pull(settings, store, f"{ref}:c0", holder="sandbox:running")
    with overlay([store.path(d) for d in running.layers], env.tmp / "mnt-running") as root:
        usages = []
        for i in range(1, N_CACHE_IMAGES):
            img = await pull(settings, store, f"{ref}:c{i}")
            usage = cache.usage()
            usages.append(usage)
            assert usage <= 0.9 * capacity, usages
            # The image just pulled is complete.
            assert all(store.has(d) for d in img.layers)
            # The running sandbox's layers were never evicted and its files still read.
            assert all(store.has(d) for d in running.layers)
            assert (root / "data0").stat().st_size == CACHE_LAYER_BYTES
            assert (root / "etc/os-release").read_bytes() == b"ID=base\n"
        assert len(store.list()) < N_CACHE_IMAGES + 1  # something was evicted
    # Evicted images come back on the next pull.
    img = await pull(settings, store, f"{ref}:c1")
    assert all(store.has(d) for d in img.layers)
    cache.release("sandbox:running")


async def test_concurrent_pulls_of_one_image(env: Env) -> None:
    store = env.store()
    ref = f"{env.open.host}/layered:v1"
    a, b, c = await asyncio.gather(*(pull(env.settings(), store, ref) for _ in range(3)))
    assert a.layers == b.layers == c.layers
    assert all(store.has(d) for d in a.layers)
    assert list((store.root / ".tmp").iterdir()) == []
