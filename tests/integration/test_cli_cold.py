"""`aenv start --cold IMAGE`: a sandbox straight from an OCI image (a static busybox pushed
to a loopback registry the session's server trusts), then `cp` of a tree into and out of
it: file by file, with no tar, Python or bash in the image."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import AENV, Server
from .oci_layouts import NEEDS_REGISTRY, Layout
from .registry_servers import push
from .template_images import _start_registry, busybox_rootfs

pytestmark = [pytest.mark.integration, NEEDS_REGISTRY]


@pytest.fixture(scope="module")
def busybox_image() -> Iterator[str]:
    tmp = Path(tempfile.mkdtemp(prefix="aenv-cli-cold-"))
    reg = None
    try:
        reg = _start_registry(tmp / "registry")
        lay = Layout(tmp / "oci")
        lay.tag(
            "cli",
            lay.image(
                [(busybox_rootfs(), "gzip")],
                {"Env": ["PATH=/bin", "HELLO=from-image"], "WorkingDir": "/root"},
            ),
        )
        push(lay, "cli", reg, "cli-busybox")
        yield f"{reg.host}/cli-busybox:cli"
    finally:
        if reg is not None:
            reg.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _aenv(server: Server, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, AENV_URL=server.url, AENV_API_KEY=server.api_key)
    return subprocess.run(
        [AENV, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def _hashes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): (
            "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        )
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.timeout(900)
def test_start_cold_then_cp_without_tar(server: Server, busybox_image: str, tmp_path: Path) -> None:
    res = _aenv(server, "start", "--cold", busybox_image, "-d", "-m", "via=cli-cold", "-e", "B=2")
    assert res.returncode == 0, res.stderr
    sid = res.stdout.strip()
    try:
        assert len(sid.splitlines()) == 1  # --detach prints only the id (progress: stderr)
        assert f"pulled {busybox_image}@sha256:" in res.stderr
        out = _aenv(server, "exec", sid, "--", "echo $HELLO $B; id -un; pwd")
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["from-image", "2", "root", "/root"]
        info = json.loads(_aenv(server, "inspect", sid, "-o", "json").stdout)
        assert info["metadata"]["via"] == "cli-cold"

        src = tmp_path / "src"
        (src / "d" / "e").mkdir(parents=True)
        (src / "d" / "e" / "f.bin").write_bytes(os.urandom(300_000))
        (src / "empty").write_bytes(b"")
        (src / "tool").write_text("#!/bin/sh\necho tool-ran\n")
        (src / "tool").chmod(0o755)
        assert _aenv(server, "cp", str(src), f"{sid}:/srv/").returncode == 0
        ran = _aenv(server, "exec", sid, "--", "/srv/src/tool")
        assert ran.stdout == "tool-ran\n", ran.stderr
        res = _aenv(server, "cp", f"{sid}:/srv/src", str(tmp_path / "back"))
        assert res.returncode == 0, res.stderr
        assert _hashes(tmp_path / "back") == _hashes(src)
        assert os.stat(tmp_path / "back" / "tool").st_mode & 0o777 == 0o755
    finally:
        _aenv(server, "rm", sid)

    # Both a template and an image: a usage mistake, one line, aenv's own failure (125).
    res = _aenv(server, "start", "base", "--cold", busybox_image, "-d")
    assert res.returncode == 125 and res.stderr.count("\n") == 1
    res = _aenv(server, "start", "--cold", "127.0.0.1:1/nope:1", "-d")
    assert res.returncode == 125 and res.stderr.startswith("aenv: ")
    assert res.stderr.count("\n") == 1, res.stderr
