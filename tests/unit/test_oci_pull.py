"""Pulling an image into the layer store, end to end against the in-process fake registry
(tests/unit/fake_registry.py): layers unpacked into the store, a partial download resumed, a
tampered layer refused with its partial file dropped, concurrent pulls sharing downloads, and
the search registries tried in turn.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import httpx
import pytest

from aenv.config import ImageSettings
from aenv.errors import NotFound, Unavailable
from aenv.images.cache import LayerCache
from aenv.images.layers import LayerStore
from aenv.images.manifests import DigestMismatch
from aenv.images.pull import LayerProgress, pull
from aenv.images.registry import RegistryClient
from tests.unit.fake_registry import REG, FakeRegistry, client_for, gz_layer, sha

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
