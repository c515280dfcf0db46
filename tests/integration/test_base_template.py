"""Template `base`: debootstrap rootfs (machine-wide cache) imported into a fresh AENV_HOME.

The first run on a fresh machine pays debootstrap (~1 min); afterwards a new AENV_HOME
imports the cached rootfs (hard links; a copy into a btrfs pool), and a registered, current
`base` is left alone."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.builds.base import TEMPLATE_ID, build_base
from aenv.builds.base_rootfs import recipe_hash
from aenv.config import Settings
from aenv.domain import TemplateKind
from aenv.images.layers import LayerStore
from aenv.orchestrator.catalog import Catalog
from aenv.runtime.storage.cowpool import CowPool

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(shutil.which("debootstrap") is None, reason="needs debootstrap"),
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, list[str]]]:
    settings = Settings(home=tmp_path_factory.mktemp("aenv-home"))
    try:
        yield settings, build_base(settings)
    finally:
        CowPool(settings).unmount()  # the home's btrfs pool, if build_base made one


def test_template_is_registered(built: tuple[Settings, list[str]]) -> None:
    settings, layers = built
    cat = Catalog(settings.catalog_path)
    try:
        found = cat.template("base")
    finally:
        cat.close()
    assert found is not None
    assert found.template_id == TEMPLATE_ID and found.names == ["base"]
    assert found.layers == layers and len(layers) == 1
    assert found.kind is TemplateKind.IMAGE and not found.has_memory
    assert found.workdir == "/home/user" and found.user == "user"
    assert found.cpu_count == 2 and found.memory_mb == 512
    assert "/usr/bin" in found.env["PATH"]
    assert found.created_at
    assert found.build.recipe_hash == recipe_hash()
    assert found.build.source == "debootstrap minbase bookworm" and found.build.size
    # The stored document keeps its flat shape (builder keys beside the core's).
    db = sqlite3.connect(str(settings.catalog_path))
    try:
        (raw,) = db.execute("SELECT doc FROM templates WHERE id=?", (TEMPLATE_ID,)).fetchone()
    finally:
        db.close()
    doc = json.loads(raw)
    assert doc["kind"] == "image" and doc["layers"] == layers and doc["user"] == "user"
    assert doc["recipe_hash"] == recipe_hash() and "extra" not in doc


def test_rootfs_content(built: tuple[Settings, list[str]]) -> None:
    settings, layers = built
    store = LayerStore(settings)
    root = store.path(layers[0])
    assert store.info(layers[0]).size > 50_000_000

    home = root / "home/user"
    assert home.is_dir() and home.stat().st_uid == 1000 and home.stat().st_gid == 1000
    assert (home / ".bashrc").is_file()
    passwd = (root / "etc/passwd").read_text()
    assert "user:x:1000:1000::/home/user:/bin/bash" in passwd
    assert any(
        line.startswith("sudo:") and "user" in line.split(":")[3].split(",")
        for line in (root / "etc/group").read_text().splitlines()
    )
    sudoers = root / "etc/sudoers.d/90-aenv-user"
    assert sudoers.read_text().strip() == "user ALL=(ALL:ALL) NOPASSWD: ALL"
    assert stat.S_IMODE(sudoers.stat().st_mode) == 0o440 and sudoers.stat().st_uid == 0
    tools = ("python3", "python", "bash", "sudo", "curl", "git")
    for tool in (f"usr/bin/{t}" for t in tools):
        assert (root / tool).exists(), tool
    assert (root / "etc/hostname").read_text() == "sandbox\n"
    hosts = (root / "etc/hosts").read_text()
    assert "127.0.0.1\tlocalhost sandbox" in hosts
    assert (root / "etc/resolv.conf").is_file() and not (root / "etc/resolv.conf").is_symlink()
    assert (root / "opt/aenv").is_dir() and not list((root / "opt/aenv").iterdir())
    assert not list((root / "var/lib/apt/lists").glob("*_Packages"))
    assert not list((root / "var/cache/apt/archives").glob("*.deb"))


def test_second_call_leaves_a_current_base_alone(built: tuple[Settings, list[str]]) -> None:
    settings, layers = built
    stages: list[str] = []
    assert build_base(settings, progress=lambda stage, _detail: stages.append(stage)) == layers
    assert stages == ["done"]  # no cache lookup, no import, no registration


def test_another_home_imports_from_the_machine_cache(
    built: tuple[Settings, list[str]], tmp_path: Path
) -> None:
    _, layers = built
    other = Settings(home=tmp_path / "other-home")
    stages: list[str] = []
    try:
        assert build_base(other, progress=lambda stage, _detail: stages.append(stage)) == layers
        assert "debootstrap" not in stages and "import" in stages
        a = LayerStore(built[0]).path(layers[0]) / "usr/bin/bash"
        b = LayerStore(other).path(layers[0]) / "usr/bin/bash"
        if a.stat().st_dev == b.stat().st_dev:
            assert a.stat().st_ino == b.stat().st_ino  # hard links to the cache, no copy
        else:  # each home's btrfs pool is a filesystem of its own: a copy each
            assert a.read_bytes() == b.read_bytes()
    finally:
        CowPool(other).unmount()


@pytest.fixture
def overlay(built: tuple[Settings, list[str]], tmp_path: Path) -> Iterator[Path]:
    """The base layer as a read-only overlay lowerdir, like a sandbox sees it."""
    settings, layers = built
    lower = LayerStore(settings).path(layers[0])
    upper, work, merged = tmp_path / "upper", tmp_path / "work", tmp_path / "merged"
    for d in (upper, work, merged):
        d.mkdir()
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(merged)], check=True)
    mounted = [merged]
    try:
        subprocess.run(["mount", "-t", "proc", "proc", str(merged / "proc")], check=True)
        mounted.append(merged / "proc")
        yield merged
    finally:
        for m in reversed(mounted):
            subprocess.run(["umount", str(m)], check=False)


def test_user_has_python_and_passwordless_sudo(overlay: Path) -> None:
    script = "id -u; sudo -n id -u; python3 -c 'import sys; print(sys.version_info[0])'; pwd"
    r = subprocess.run(
        [
            "chroot",
            "--userspec=1000:1000",
            str(overlay),
            "/usr/bin/env",
            "-i",
            "HOME=/home/user",
            "PATH=/usr/local/bin:/usr/bin:/bin",
            "/bin/bash",
            "-c",
            f"cd ~ && {script}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1000", "0", "3", "/home/user"]


@pytest.mark.parametrize(("userspec", "sbin"), [("0:0", True), ("1000:1000", False)])
def test_login_shell_path_without_spawning_id(overlay: Path, userspec: str, sbin: bool) -> None:
    # The SDK runs every command as `bash -l -c`; /etc/profile picks PATH by uid.
    r = subprocess.run(
        [
            "chroot",
            f"--userspec={userspec}",
            str(overlay),
            "/usr/bin/env",
            "-i",
            "HOME=/",
            "/bin/bash",
            "-lx",
            "-c",
            'echo "$PATH"',
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert ("/usr/sbin" in r.stdout.split(":")) is sbin, r.stdout
    assert "id -u" not in r.stderr, r.stderr  # bash's $EUID answered, no extra process
