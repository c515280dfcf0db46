"""OCI images built here as layouts, for the tests that push images to a local registry
(test_registry.py, test_templates*.py, test_cli_cold.py): tar layers of entries (files, dirs,
links, devices, whiteouts) in gzip, zstd or plain, image layouts with configs, indexes and
tags, a busybox rootfs from the host's static busybox, a three-layer image with whiteouts and
an opaque directory; what such a test needs (`NEEDS_REGISTRY`).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zstandard

REGISTRY_BIN = shutil.which("docker-registry") or "/usr/bin/docker-registry"
SKOPEO = shutil.which("skopeo")
BUSYBOX = Path("/bin/busybox")

# What a test that pushes images to a local registry needs (here and beside it).
NEEDS_REGISTRY = pytest.mark.skipif(
    os.geteuid() != 0
    or not os.path.exists(REGISTRY_BIN)
    or SKOPEO is None
    or not BUSYBOX.is_file(),
    reason="needs root, docker-registry, skopeo and busybox-static (scripts/install-system.sh)",
)


OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_TYPES = {
    "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
    "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
    "none": "application/vnd.oci.image.layer.v1.tar",
}
MTIME = 1_700_000_000


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# --- building images ---
@dataclass
class Entry:
    name: str
    kind: str = "file"  # file | dir | symlink | hardlink
    data: bytes = b""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    target: str = ""


def tar_of(entries: list[Entry]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.mode, info.uid, info.gid, info.mtime = e.mode, e.uid, e.gid, MTIME
            if e.kind == "dir":
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            elif e.kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, e.target
                tf.addfile(info)
            elif e.kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, e.target
                tf.addfile(info)
            else:
                info.size = len(e.data)
                tf.addfile(info, io.BytesIO(e.data))
    return buf.getvalue()


def compress(tar: bytes, kind: str) -> bytes:
    if kind == "gzip":
        return gzip.compress(tar, mtime=0)
    if kind == "zstd":
        return zstandard.ZstdCompressor().compress(tar)
    return tar


class Layout:
    """An OCI image layout directory (what `skopeo copy oci:<dir>:<tag>` reads)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "blobs/sha256").mkdir(parents=True)
        (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        self.tags: dict[str, dict[str, Any]] = {}
        self.layer_blobs: dict[str, bytes] = {}

    def put(self, data: bytes, media_type: str) -> dict[str, Any]:
        d = sha(data)
        (self.root / "blobs/sha256" / d[7:]).write_bytes(data)
        return {"mediaType": media_type, "digest": d, "size": len(data)}

    def image(
        self,
        layers: list[tuple[list[Entry], str]],
        config: dict[str, Any] | None = None,
        arch: str = "amd64",
        variant: str | None = None,
    ) -> dict[str, Any]:
        descs, diff_ids = [], []
        for entries, kind in layers:
            tar = tar_of(entries)
            blob = compress(tar, kind)
            diff_ids.append(sha(tar))
            descs.append(self.put(blob, LAYER_TYPES[kind]))
            self.layer_blobs[sha(blob)] = blob
        cfg: dict[str, Any] = {
            "architecture": arch,
            "os": "linux",
            "config": config or {},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
        if variant:
            cfg["variant"] = variant
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": self.put(json.dumps(cfg).encode(), OCI_CONFIG),
            "layers": descs,
        }
        desc = self.put(json.dumps(manifest).encode(), OCI_MANIFEST)
        desc["platform"] = {"os": "linux", "architecture": arch}
        if variant:
            desc["platform"]["variant"] = variant
        return desc

    def index(self, manifests: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests}
        return self.put(json.dumps(body).encode(), OCI_INDEX)

    def tag(self, name: str, desc: dict[str, Any]) -> None:
        entry = {k: v for k, v in desc.items() if k != "platform"}
        entry["annotations"] = {"org.opencontainers.image.ref.name": name}
        self.tags[name] = entry
        index = {"schemaVersion": 2, "manifests": list(self.tags.values())}
        (self.root / "index.json").write_text(json.dumps(index))


def busybox_rootfs() -> list[Entry]:
    bb = BUSYBOX.read_bytes()
    entries = [
        Entry("bin", "dir", mode=0o755),
        Entry("bin/busybox", data=bb, mode=0o755),
        Entry("etc", "dir", mode=0o755),
        Entry(
            "etc/passwd",
            data=b"root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n",
        ),
        Entry("etc/group", data=b"root:x:0:\nuser:x:1000:\n"),
        Entry("home", "dir", mode=0o755),
        Entry("home/user", "dir", mode=0o750, uid=1000, gid=1000),
        Entry("root", "dir", mode=0o700),
        Entry("tmp", "dir", mode=0o1777),
    ]
    for tool in ("sh", "ls", "cat", "echo", "id"):
        entries.append(Entry(f"bin/{tool}", "symlink", target="busybox"))
    return entries


BUSYBOX_CONFIG = {
    "Env": ["PATH=/bin", "GREETING=hello"],
    "WorkingDir": "/home/user",
    "User": "1000:1000",
    "Entrypoint": ["/bin/sh", "-c"],
    "Cmd": ["echo $GREETING"],
}

LAYERED = [
    (
        [
            Entry("etc", "dir", mode=0o755),
            Entry("etc/a", data=b"a"),
            Entry("etc/b", data=b"old b"),
            Entry("dir", "dir", mode=0o755),
            Entry("dir/x", data=b"x"),
            Entry("dir/y", data=b"y"),
            Entry("data", "dir", mode=0o755),
            Entry("data/keep", data=b"keep"),
            Entry("olddir", "dir", mode=0o755),
            Entry("olddir/f", data=b"f"),
            Entry("bin", "dir", mode=0o755),
            Entry("bin/tool", data=b"#!/bin/sh\n", mode=0o4755),
        ],
        "gzip",
    ),
    (
        [
            Entry("etc", "dir", mode=0o755),
            Entry("etc/.wh.a"),
            Entry("etc/b", data=b"new b"),
            Entry("etc/b2", "hardlink", target="etc/b"),
            Entry("dir", "dir", mode=0o755),
            Entry("dir/.wh..wh..opq"),
            Entry("dir/z", data=b"z"),
        ],
        "zstd",
    ),
    (
        [
            Entry(".wh.olddir"),
            Entry("etc", "dir", mode=0o755),
            Entry("etc/c", data=b"c", uid=1000, gid=1000, mode=0o600),
            Entry("etc/link", "symlink", target="b"),
        ],
        "none",
    ),
]
