"""Finding or building an envd bundle (see `bundle.py` for its layout): the stdlib trimmed, the binary
and every shared library it needs copied, the app copied, everything precompiled with the
bundled interpreter itself, then a self-test of the modules envd needs."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..config import Settings
from ..fsutil import flock
from .bundle import (
    APP_PACKAGE,
    BUNDLE_FORMAT,
    MOUNT,
    BundleError,
    EnvdBundle,
    Interpreter,
    app_files,
    bundle_digest,
    current_interpreter,
    envd_source_dir,
    probe_interpreter,
)

log = logging.getLogger("aenv.runtime")

# envd's spawn library: its source among envd's files, the library beside the bundle's
# others (envd loads it from there, `envd/vspawn.py`).
SPAWN_SOURCE = "spawn.c"
SPAWN_LIB = "libaenv-spawn.so"

# Top-level stdlib entries left out.
_DROP_TOP = {
    "test",
    "idlelib",
    "tkinter",
    "turtledemo",
    "turtle.py",
    "ensurepip",
    "lib2to3",
    "pydoc_data",
    "site-packages",
    "dist-packages",
    "venv",
    "sitecustomize.py",  # Debian: a symlink into the image's /etc
    "usercustomize.py",
    "EXTERNALLY-MANAGED",
}
# Directory names left out at any depth (package test suites).
_DROP_ANY = {"__pycache__", "test", "tests", "idle_test"}
_DROP_DYNLOAD = re.compile(r"^(_test|_xxtest|xxlimited|xxsubtype|_tkinter|_ctypes_test)")
# Loaded with dlopen by glibc (pthread_exit/cancellation unwinding), invisible to ldd.
_DLOPENED = ("libgcc_s.so.1",)


_LDD_DEP = re.compile(r"^\s*(\S+)\s+=>\s+(\S+)(?:\s+\(0x[0-9a-f]+\))?\s*$")
_LDD_LOADER = re.compile(r"^\s*(/\S+)\s+\(0x[0-9a-f]+\)\s*$")


def ldd_deps(files: list[Path]) -> tuple[dict[str, Path], Path | None]:
    """{soname: resolved path} of all shared-library dependencies of `files`, and the
    dynamic loader. Raises on a dependency that cannot be found."""
    deps: dict[str, Path] = {}
    loader: Path | None = None
    missing: list[str] = []
    for i in range(0, len(files), 200):
        chunk = files[i : i + 200]
        r = subprocess.run(["ldd", *map(str, chunk)], capture_output=True, text=True, check=False)
        current = str(chunk[0]) if len(chunk) == 1 else ""
        for line in r.stdout.splitlines():
            if not line.startswith(("\t", " ")) and line.endswith(":"):
                current = line[:-1]
                continue
            if "not a dynamic executable" in line or "statically linked" in line:
                continue
            m = _LDD_DEP.match(line)
            if m:
                name, target = m.groups()
                if target == "not":
                    missing.append(f"{name} (needed by {current})")
                    continue
                deps[name] = Path(target)
                continue
            m = _LDD_LOADER.match(line)
            if m:
                loader = Path(m.group(1))
    if missing:
        raise BundleError("unresolved shared libraries: " + ", ".join(missing))
    return deps, loader


def _find_system_lib(name: str) -> Path | None:
    r = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False)
    for line in r.stdout.splitlines():
        parts = line.strip().split(" => ")
        if len(parts) == 2 and parts[0].split(" ")[0] == name and "x86-64" in parts[0]:
            return Path(parts[1])
    for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64"):
        p = Path(d, name)
        if p.exists():
            return p
    return None


def _ignore_stdlib(top: Path) -> Any:
    def ignore(directory: str, names: list[str]) -> set[str]:
        drop = {n for n in names if n in _DROP_ANY}
        if Path(directory) == top:
            drop |= {n for n in names if n in _DROP_TOP or n.startswith("config-")}
        if Path(directory).name == "lib-dynload":
            drop |= {n for n in names if _DROP_DYNLOAD.match(n)}
        return drop

    return ignore


def _ignore_app(directory: str, names: list[str]) -> set[str]:
    return {
        n for n in names if n == "__pycache__" or n.endswith((".pyc", ".pyo")) or n.startswith(".")
    }


def _strip(paths: list[Path]) -> None:
    strip = shutil.which("strip")
    if not strip or not paths:
        return
    subprocess.run([strip, "--strip-unneeded", *map(str, paths)], capture_output=True, check=False)


def _du(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def _run_bundle(root: Path, loader: str, args: list[str], timeout: float = 600) -> str:
    b = EnvdBundle(host_path=root, digest="", loader=loader)
    r = subprocess.run(
        b.host_args(*args),
        env=b.host_env(),
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    if r.returncode != 0:
        raise BundleError(
            f"bundled python failed ({' '.join(args[:3])}…): {(r.stderr or r.stdout)[-2000:]}"
        )
    return r.stdout


SELF_TEST = (
    "import sys, ssl, json, asyncio, ctypes, pty, termios, fcntl, sqlite3, zlib, hashlib, "
    "select, socket, signal, struct, threading, subprocess, base64, uuid, lzma, bz2; "
    "ctypes.CDLL(None); print(sys.version.split()[0], sys.prefix)"
)


def build_spawn_lib(source: Path, out: Path) -> None:
    """Compiles `spawn.c` (envd vforks every command through it). Without a C compiler envd
    still works: subprocess forks envd instead, 20-40 ms slower per command that changes
    user or takes a terminal."""
    prebuilt = source.with_name(SPAWN_LIB)
    if prebuilt.is_file():  # compiled where the package was installed (the node's image)
        shutil.copy2(prebuilt, out)
        return
    cc = shutil.which("cc") or shutil.which("gcc")
    if not source.is_file() or cc is None:
        log.warning("envd bundle without %s: no C compiler (commands start slower)", SPAWN_LIB)
        return
    r = subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-s", "-o", str(out), str(source)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        log.warning("envd bundle without %s: %s", SPAWN_LIB, r.stderr.strip()[-500:])
        out.unlink(missing_ok=True)


def build_bundle(dest: Path, interp: Interpreter, app_dir: Path, digest: str) -> dict[str, Any]:
    """Builds a bundle into the new directory `dest`; returns its bundle.json content."""
    t0 = time.monotonic()
    lib = dest / "lib"
    (dest / "bin").mkdir(parents=True)
    lib.mkdir()
    stdlib_dst = lib / interp.libname

    # 1. stdlib (trimmed), lib-dynload.
    shutil.copytree(
        interp.stdlib,
        stdlib_dst,
        symlinks=False,
        ignore=_ignore_stdlib(interp.stdlib),
        ignore_dangling_symlinks=True,
    )
    dyn_dst = stdlib_dst / "lib-dynload"
    if interp.dynload and not dyn_dst.exists():
        shutil.copytree(interp.dynload, dyn_dst, ignore=_ignore_stdlib(interp.stdlib))
    dyn_dst.mkdir(exist_ok=True)
    # Debian keeps `site-packages`-less stdlib but its site.py looks in /usr/lib/python3/...:
    # harmless, those paths do not exist under PYTHONHOME.

    # 2. the binary and every shared library it (or an extension module) needs.
    exe = dest / "bin" / "python3"
    shutil.copy2(interp.executable, exe)
    exts = sorted(dyn_dst.glob("*.so"))
    deps, loader = ldd_deps([interp.executable, *exts])
    if loader is None:
        raise BundleError(f"{interp.executable} is not dynamically linked: no loader to bundle")
    for name in _DLOPENED:
        if name not in deps and (p := _find_system_lib(name)):
            deps[name] = p
    own: list[Path] = [exe]
    prefix = str(interp.executable.parent.parent)
    for name, src in sorted(deps.items()):
        dst = lib / name
        shutil.copy2(src, dst)  # follows symlinks: lib/ holds real files only
        if str(src).startswith(prefix + "/") and not prefix.startswith("/usr"):
            own.append(dst)  # e.g. pyenv's libpython: carries debug info
    loader_name = loader.name
    if not (lib / loader_name).exists():
        shutil.copy2(loader, lib / loader_name)
    # Debug info of a self-built python (libpython alone: 23 MB -> 4 MB); system libs are
    # already stripped.
    _strip([*own, *exts])

    # 3. the app.
    app_dst = dest / "app" / APP_PACKAGE
    if app_dir.is_dir():
        shutil.copytree(app_dir, app_dst, ignore=_ignore_app)
    else:
        app_dst.mkdir(parents=True)

    # 3b. envd's spawn library, against the bundle's own libc (it is the host's).
    build_spawn_lib(app_dir / SPAWN_SOURCE, lib / SPAWN_LIB)

    # 4. precompile with the bundled interpreter itself (also its first self-test):
    # unchecked-hash pycs never stat their source; tracebacks show /opt/aenv paths.
    _run_bundle(
        dest,
        loader_name,
        [
            "-m",
            "compileall",
            "-q",
            "-j0",
            "--invalidation-mode",
            "unchecked-hash",
            "-s",
            str(dest),
            "-p",
            MOUNT,
            str(stdlib_dst),
            str(dest / "app"),
        ],
    )
    out = _run_bundle(dest, loader_name, ["-c", SELF_TEST], timeout=60)
    if str(dest) not in out:
        raise BundleError(f"bundled python reports an unexpected prefix: {out.strip()}")

    meta = {
        "digest": digest,
        "format": BUNDLE_FORMAT,
        "loader": loader_name,
        "python_version": interp.version.split()[0],
        "interpreter": str(interp.executable),
        "app_files": [str(p) for p in app_files(app_dir)],
        "libs": sorted(p.name for p in lib.iterdir() if p.is_file()),
        "size": _du(dest),
        "build_seconds": round(time.monotonic() - t0, 2),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    (dest / "bundle.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


# --- the bundle dir ------------------------------------------------------------------------


def ensure_bundle(
    settings: Settings, *, python: Path | None = None, app_dir: Path | None = None
) -> EnvdBundle:
    """The runtime bundle for the current interpreter (or `python`) and envd sources (or
    `app_dir`), built under `settings.runtime_dir` when missing. Idempotent; when the
    bundle exists this costs a stat and a hash of envd's sources (a few ms)."""
    interp = current_interpreter() if python is None else probe_interpreter(python)
    app = app_dir if app_dir is not None else envd_source_dir()
    digest = bundle_digest(interp, app)
    root = settings.runtime_dir
    final = root / digest
    if (final / "bundle.json").is_file():
        return EnvdBundle.load(final)
    root.mkdir(parents=True, exist_ok=True)
    with flock(root / f".lock-{digest}"):
        if (final / "bundle.json").is_file():
            return EnvdBundle.load(final)
        for stale in root.glob(f".tmp-{digest}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        work = root / f".tmp-{digest}-{uuid.uuid4().hex[:8]}"
        try:
            build_bundle(work, interp, app, digest)
            os.rename(work, final)
        finally:
            if work.exists():
                shutil.rmtree(work, ignore_errors=True)
    return EnvdBundle.load(final)
