"""Images for the template tests, served by a loopback `docker-registry` on `TEST_REGISTRY`
(which the session's server trusts as a plain-HTTP registry): a busybox-static rootfs without
Python or glibc, the same with a non-root image user, and small data-only images for the layer
cache bound, built as OCI layouts (oci_layouts.py) and pushed with skopeo. `images` is a
module-scoped fixture, imported by the test modules for pytest to find; the rest are small
helpers on the session's server (unique names, deleting templates, the build sandboxes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import wait_healthy

from .conftest import TEST_REGISTRY, Server
from .oci_layouts import BUSYBOX, REGISTRY_BIN, Entry, Layout
from .registry_servers import Registry, push

PASSWD_ROOT = (
    b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
)
CACHE_IMAGES = 6
CACHE_LAYER_BYTES = 400_000


def busybox_rootfs(passwd: bytes = PASSWD_ROOT, extra: list[Entry] | None = None) -> list[Entry]:
    """A static busybox with every applet linked in /bin, and /bin/bash as a tiny wrapper
    (the SDK runs commands with `/bin/bash -l -c`). No Python, no libc."""
    entries = [
        Entry("bin", "dir", mode=0o755),
        Entry("bin/busybox", data=BUSYBOX.read_bytes(), mode=0o755),
        Entry("bin/bash", data=b'#!/bin/sh\nexec /bin/sh "$@"\n', mode=0o755),
        Entry("etc", "dir", mode=0o755),
        Entry("etc/passwd", data=passwd),
        Entry("etc/group", data=b"root:x:0:\nnobody:x:65534:\napp:x:1000:\n"),
        Entry("root", "dir", mode=0o700),
        Entry("tmp", "dir", mode=0o1777),
        *(extra or []),
    ]
    applets = subprocess.run(
        [str(BUSYBOX), "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    entries += [
        Entry(f"bin/{a}", "symlink", target="busybox")
        for a in applets
        if a not in ("busybox", "bash")
    ]
    return entries


@dataclass
class Images:
    host: str
    busybox: str  # root only; WorkingDir /srv (missing); Cmd writes /tmp/entry.txt
    busybox_user: str  # User 1000 (app), WorkingDir /home/app
    cache: list[str]


def _start_registry(workdir: Path) -> Registry:
    host = TEST_REGISTRY
    storage = workdir / "storage"
    storage.mkdir(parents=True)
    cfg = workdir / "config.yml"
    cfg.write_text(
        json.dumps(
            {
                "version": 0.1,
                "log": {"level": "warn", "accesslog": {"disabled": True}},
                "storage": {"filesystem": {"rootdirectory": str(storage)}},
                "http": {"addr": host, "secret": uuid.uuid4().hex},
            }
        )
    )
    log = workdir / "registry.log"
    proc = subprocess.Popen(
        [REGISTRY_BIN, "serve", str(cfg)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    reg = Registry(host, storage, proc, log)
    try:
        wait_healthy(f"http://{host}", 20, proc=proc, path="/v2/", status=200, log=log)
    except AssertionError:
        reg.stop()
        raise
    return reg


@pytest.fixture(scope="module")
def images() -> Iterator[Images]:
    tmp = Path(tempfile.mkdtemp(prefix="aenv-templates-it-"))
    reg: Registry | None = None
    try:
        reg = _start_registry(tmp / "registry")
        lay = Layout(tmp / "oci-busybox")
        lay.tag(
            "latest",
            lay.image(
                [(busybox_rootfs(), "gzip")],
                {
                    "Env": ["PATH=/bin", "HELLO=from-image"],
                    "WorkingDir": "/srv",
                    "Entrypoint": ["/bin/sh", "-c"],
                    "Cmd": ["echo started > /tmp/entry.txt; exec sleep 3600"],
                },
            ),
        )
        push(lay, "latest", reg, "busybox")
        lay = Layout(tmp / "oci-busybox-user")
        passwd = PASSWD_ROOT + b"app:x:1000:1000:app:/home/app:/bin/sh\n"
        home = [
            Entry("home", "dir", mode=0o755),
            Entry("home/app", "dir", mode=0o750, uid=1000, gid=1000),
        ]
        lay.tag(
            "latest",
            lay.image(
                [(busybox_rootfs(passwd, home), "gzip")],
                {
                    "Env": ["PATH=/bin", "HELLO=from-image"],
                    "WorkingDir": "/home/app",
                    "User": "1000",
                },
            ),
        )
        push(lay, "latest", reg, "busybox-user")
        lay = Layout(tmp / "oci-cache")
        base = [Entry("etc", "dir", mode=0o755), Entry("etc/os-release", data=b"ID=cache\n")]
        for i in range(CACHE_IMAGES):
            own = [Entry(f"data{i}", data=os.urandom(CACHE_LAYER_BYTES))]
            lay.tag(f"c{i}", lay.image([(base, "gzip"), (own, "gzip")]))
            push(lay, f"c{i}", reg, "cache")
        yield Images(
            host=reg.host,
            busybox=f"{reg.host}/busybox:latest",
            busybox_user=f"{reg.host}/busybox-user:latest",
            cache=[f"{reg.host}/cache:c{i}" for i in range(CACHE_IMAGES)],
        )
    finally:
        if reg is not None:
            reg.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def delete_template(server: Server, name: str) -> None:
    with server.client() as c:
        c.delete(f"/templates/{name}")


def build_sandboxes(server: Server) -> list[dict[str, Any]]:
    with server.client() as c:
        return [s for s in c.get("/v2/sandboxes").json() if "aenv.build" in s.get("metadata", {})]
