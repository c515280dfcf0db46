"""The envd runtime bundle: built from the running interpreter, runs without the host's
libc or Python (env -i, and chrooted into a busybox-only rootfs)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.runtime import bundle_build
from aenv.runtime.bundle import MOUNT, EnvdBundle, envd_source_dir
from aenv.runtime.bundle_build import ensure_bundle


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return Settings(home=tmp_path_factory.mktemp("aenv-home"))


@pytest.fixture(scope="module")
def bundle(settings: Settings) -> EnvdBundle:
    return ensure_bundle(settings)


def run_host(b: EnvdBundle, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["env", "-i", *(f"{k}={v}" for k, v in b.host_env().items()), *b.host_args("-c", code)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )


def test_layout(bundle: EnvdBundle, settings: Settings) -> None:
    root = bundle.host_path
    assert root.parent == settings.runtime_dir
    assert root.name == bundle.digest
    assert (root / "bin/python3").is_file()
    assert (root / "lib" / bundle.loader).is_file()
    assert (root / "lib/libc.so.6").is_file()
    lib = root / "lib/python3.11"
    assert (lib / "os.py").is_file()
    assert (lib / "lib-dynload").is_dir()
    for gone in (
        "test",
        "idlelib",
        "tkinter",
        "ensurepip",
        "turtledemo",
        "lib2to3",
        "site-packages",
    ):
        assert not (lib / gone).exists(), gone
    assert not list(lib.rglob("tests")) and not list(lib.rglob("_tkinter*"))
    # Precompiled: the mount is read-only, so nothing could be cached at runtime.
    assert list((lib / "json/__pycache__").glob("__init__.cpython-311.pyc"))
    assert (root / "app/aenv_envd").is_dir()
    app_src = {p.relative_to(envd_source_dir()) for p in envd_source_dir().rglob("*.py")}
    app_dst = {
        p.relative_to(root / "app/aenv_envd") for p in (root / "app/aenv_envd").rglob("*.py")
    }
    assert app_src == app_dst
    assert bundle.meta["size"] < 120_000_000


def test_ensure_is_idempotent(
    bundle: EnvdBundle, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_build(*args: object) -> None:
        raise AssertionError("the bundle exists: nothing to build")

    monkeypatch.setattr(bundle_build, "build_bundle", no_build)
    again = ensure_bundle(settings)
    assert again.host_path == bundle.host_path


def test_init_args_and_env(bundle: EnvdBundle) -> None:
    assert bundle.init_args() == [
        "/opt/aenv/lib/ld-linux-x86-64.so.2",
        "--library-path",
        "/opt/aenv/lib",
        "/opt/aenv/bin/python3",
        "-s",
        "-m",
        "aenv_envd",
        "--port",
        "49983",
    ]
    env = bundle.init_env()
    assert env["PYTHONHOME"] == MOUNT
    assert env["PYTHONPATH"] == "/opt/aenv/app"
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert "/usr/bin" in env["PATH"]
    m = bundle.mount()
    assert (m.source, m.destination, m.readonly) == (bundle.host_path, "/opt/aenv", True)


def test_runs_with_an_empty_environment(bundle: EnvdBundle) -> None:
    r = run_host(bundle, "import json, asyncio, ctypes; print(1)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "1"
    r = run_host(
        bundle,
        "import sys, ssl, pty, termios, fcntl, sqlite3, importlib.util as u; "
        "print(sys.prefix); print(u.find_spec('aenv_envd').origin)",
    )
    assert r.returncode == 0, r.stderr
    prefix, origin = r.stdout.split()
    assert prefix == str(bundle.host_path)
    assert origin.startswith(str(bundle.host_path / "app/aenv_envd"))


def test_changed_app_gives_a_new_bundle(
    settings: Settings, bundle: EnvdBundle, tmp_path: Path
) -> None:
    app = tmp_path / "envd"
    shutil.copytree(envd_source_dir(), app, ignore=shutil.ignore_patterns("__pycache__"))
    (app / "__init__.py").write_text((app / "__init__.py").read_text() + "\nMARK = 42\n")
    changed = ensure_bundle(settings, app_dir=app)
    assert changed.host_path != bundle.host_path
    assert bundle.host_path.is_dir()  # the old one stays
    r = run_host(changed, "import aenv_envd; print(aenv_envd.MARK)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "42"


def _static_busybox() -> str | None:
    bb = shutil.which("busybox")
    if not bb:
        return None
    out = subprocess.run(["file", "-L", bb], capture_output=True, text=True).stdout
    return bb if "statically linked" in out or "static-pie" in out else None


@pytest.fixture
def busybox_root(tmp_path: Path, bundle: EnvdBundle) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("chroot needs root")
    bb = _static_busybox()
    if not bb:
        pytest.skip("needs busybox-static")
    root = tmp_path / "rootfs"
    (root / "bin").mkdir(parents=True)
    (root / "opt/aenv").mkdir(parents=True)
    shutil.copy2(bb, root / "bin/busybox")
    (root / "bin/sh").symlink_to("busybox")
    mnt = root / "opt/aenv"
    subprocess.run(["mount", "--bind", str(bundle.host_path), str(mnt)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mnt)], check=True)
        yield root
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_runs_in_a_busybox_rootfs_without_libc(bundle: EnvdBundle, busybox_root: Path) -> None:
    code = (
        "import os, sys, json, asyncio, ctypes, pty, ssl, sqlite3, threading; "
        "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join(); "
        "print(sys.prefix, sorted(os.listdir('/')))"
    )
    script = " ".join(f"'{a}'" for a in bundle.init_args()[:5]) + f' -c "{code}"'
    env = ["env", "-i", *(f"{k}={v}" for k, v in bundle.init_env().items())]
    r = subprocess.run(
        [
            *env,
            shutil.which("chroot") or "/usr/sbin/chroot",
            str(busybox_root),
            "/bin/sh",
            "-c",
            script,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["thread", "/opt/aenv ['bin', 'opt']"]
    assert not (busybox_root / "lib").exists()
    # Read-only mount: nothing may have been written into the bundle.
    assert not list(bundle.host_path.glob("app/aenv_envd/__pycache__/*.opt-*"))


def test_bundle_from_debian_python(settings: Settings, tmp_path: Path) -> None:
    """The other layout: Debian's /usr/bin/python3.11 (static libpython, /usr/lib/python3.11)."""
    debian = Path("/usr/bin/python3.11")
    if not debian.exists():
        pytest.skip("no /usr/bin/python3.11")
    b = ensure_bundle(settings, python=debian)
    assert b.meta["interpreter"] == "/usr/bin/python3.11"
    assert not (b.host_path / "lib/python3.11/sitecustomize.py").exists()
    r = run_host(b, "import json, asyncio, ctypes, ssl, sqlite3; print(1)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "1"
