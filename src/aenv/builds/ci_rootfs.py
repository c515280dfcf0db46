"""The Debian packages of template `code-interpreter-v1`, as one layer over base's rootfs.

apt-get runs in a chroot of a host overlay whose lower dir is base's cached rootfs
(`base_rootfs.py`), so the upper dir is exactly what the packages add or change — a regular
overlay layer (whiteouts, opaque dirs) that stacks on base's layer. It is kept in the same
machine-wide cache as base (`/var/cache/aenv/code-interpreter-<recipe>/`): the install
(minutes, most of it apt unpacking) runs once per machine and recipe; the downloaded .debs
stay in `debs-ci/` for rebuilds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..config import Settings
from ..fsutil import flock
from ..images.layers import tree_digest
from .base_rootfs import (
    PATH,
    BaseBuildError,
    ProgressFn,
    _empty_dir,
    _mounts_under,
    _remove_build_dir,
    cache_root,
    ensure_cached_rootfs,
    publish_build_dir,
)
from .base_rootfs import (
    recipe_hash as base_recipe_hash,
)

# IPython kernels and matplotlib (PNG charts) from bookworm. gdb-minimal satisfies
# python3-pydevd's `gdb | gdb-minimal` (ipykernel → debugpy → pydevd) without gdb's
# Python and source-highlight dependencies.
PACKAGES: tuple[str, ...] = (
    "python3-ipykernel",
    "python3-jupyter-client",
    "python3-matplotlib",
    "python3-numpy",
    "python3-pil",
    "gdb-minimal",
    # fonttools (matplotlib) takes python3-munkres or python3-scipy; scipy brings a C++
    # toolchain with it (pythran).
    "python3-munkres",
)
# Bump when the install or cleanup below changes.
SETUP_VERSION = 1


def recipe() -> dict[str, Any]:
    return {
        "base": base_recipe_hash(),
        "packages": sorted(PACKAGES),
        "setup_version": SETUP_VERSION,
    }


def recipe_hash() -> str:
    raw = json.dumps(recipe(), sort_keys=True).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def _run(args: list[str], what: str) -> None:
    r = subprocess.run(args, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise BaseBuildError(f"{what}: {(r.stderr or r.stdout).strip()[-2000:]}")


@contextlib.contextmanager
def _overlay_chroot(lower: Path, work: Path, debs: Path) -> Iterator[Path]:
    """`work/merged`: an overlay of `lower` with upper `work/upper`, with /proc, /dev, the
    host's resolver and the .deb cache bound in for apt; all unmounted on exit."""
    upper, ovl_work, merged = work / "upper", work / "ovl-work", work / "merged"
    for d in (upper, ovl_work, merged):
        d.mkdir(parents=True, exist_ok=True)
    opts = f"lowerdir={lower},upperdir={upper},workdir={ovl_work},redirect_dir=off,metacopy=off,index=off"
    _run(["mount", "-t", "overlay", "aenv-ci-build", "-o", opts, str(merged)], "overlay mount")
    try:
        _run(["mount", "-t", "proc", "proc", str(merged / "proc")], "mount proc")
        _run(["mount", "--bind", "/dev", str(merged / "dev")], "bind /dev")
        _run(["mount", "--bind", "/etc/resolv.conf", str(merged / "etc/resolv.conf")], "resolver")
        _run(["mount", "--bind", str(debs), str(merged / "var/cache/apt/archives")], "deb cache")
        yield merged
    finally:
        for mp in sorted(_mounts_under(merged), key=len, reverse=True):
            subprocess.run(["umount", "-l", mp], capture_output=True, check=False)
        subprocess.run(["umount", str(merged)], capture_output=True, check=False)


def _apt(merged: Path, args: list[str], progress: ProgressFn | None) -> None:
    env = {k: v for k, v in os.environ.items() if k.lower().endswith("_proxy")}
    env.update({"PATH": PATH, "LC_ALL": "C", "HOME": "/root", "DEBIAN_FRONTEND": "noninteractive"})
    proc = subprocess.Popen(
        ["chroot", str(merged), "apt-get", "-q", "-o", "Dpkg::Use-Pty=0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    tail: list[str] = []
    for line in proc.stdout:
        line = line.rstrip()
        if line:
            tail = [*tail[-29:], line]
            if progress:
                progress("apt", line)
    if proc.wait() != 0:
        raise BaseBuildError(f"apt-get {' '.join(args)} failed:\n" + "\n".join(tail))


def _cleanup(merged: Path) -> None:
    """Through the overlay (so removals of base's files become whiteouts): apt lists and
    caches, logs; the dpkg excludes of base already kept docs and locales out."""
    _empty_dir(merged / "var/lib/apt/lists", keep=("partial", "lock"))
    _empty_dir(merged / "var/lib/apt/lists/partial")
    for p in (merged / "var/cache/apt").glob("*.bin"):
        p.unlink()
    for p in (merged / "var/log").rglob("*"):
        if p.is_file() and not p.is_symlink() and p.stat().st_size:
            p.write_bytes(b"")
    for p in [
        *(merged / "var/cache/debconf").glob("*-old"),
        *(merged / "var/lib/dpkg").glob("*-old"),
    ]:
        p.unlink()


def ensure_cached_layer(
    settings: Settings,
    *,
    force: bool = False,
    progress: ProgressFn | None = None,
    cache_dir: Path | None = None,
) -> tuple[Path, dict[str, Any]]:
    """The machine-wide cached packages layer for the current recipe, built if missing.

    Returns (layer dir, meta) with at least `digest` and `base_digest` (the layer of base's
    rootfs it was installed over)."""
    cache = cache_dir or cache_root()
    base_rootfs, base_meta = ensure_cached_rootfs(settings, progress=progress, cache_dir=cache)
    rh = recipe_hash()
    final = cache / f"code-interpreter-{rh}"
    meta_path = final / "meta.json"
    with flock(cache / f"code-interpreter-{rh}.lock"):
        if not force and meta_path.is_file() and (final / "layer").is_dir():
            return final / "layer", json.loads(meta_path.read_text())
        for stale in cache.glob(f".code-interpreter-{rh}.tmp-*"):
            _remove_build_dir(stale)
        work = cache / f".code-interpreter-{rh}.tmp-{os.getpid()}"
        work.mkdir(parents=True)
        debs = cache / "debs-ci"
        (debs / "partial").mkdir(parents=True, exist_ok=True)
        try:
            t0 = time.monotonic()
            with _overlay_chroot(base_rootfs, work, debs) as merged:
                if progress:
                    progress("apt", f"installing {', '.join(PACKAGES)}")
                _apt(merged, ["update"], progress)
                _apt(merged, ["install", "-y", "--no-install-recommends", *PACKAGES], progress)
                _cleanup(merged)
            seconds = time.monotonic() - t0
            for d in ("ovl-work", "merged"):
                _remove_build_dir(work / d)
            os.rename(work / "upper", work / "layer")
            if progress:
                progress("hash", "computing the layer digest")
            digest, size, files = tree_digest(work / "layer")
            meta = {
                "digest": digest,
                "size": size,
                "files": files,
                "base_digest": base_meta["digest"],
                "recipe": recipe(),
                "recipe_hash": rh,
                "created": datetime.now(UTC).isoformat(timespec="seconds"),
                "install_seconds": round(seconds, 1),
            }
            publish_build_dir(work, final, meta)
        except BaseException:
            _remove_build_dir(work)
            raise
    return final / "layer", meta
