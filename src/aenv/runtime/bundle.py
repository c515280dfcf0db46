"""The envd runtime bundle: a trimmed CPython plus envd, mounted read-only at /opt/aenv.

envd must run inside any image (Debian, Alpine, busybox, no libc at all), so it never uses
the image's loader, libc or Python. The bundle carries its own::

    <runtime_dir>/<hash>/
      bin/python3                  the server's (base) interpreter binary
      lib/ld-linux-x86-64.so.2     the loader, libc, libpython (if shared) and every other
      lib/lib*.so*                 `ldd` dependency of the binary and of lib-dynload/*.so
      lib/python3.X/               the stdlib without tests, idlelib, tkinter, ensurepip, ...,
                                   precompiled (unchecked-hash .pyc: the mount is read-only)
      app/aenv_envd/               a copy of src/aenv/envd/, precompiled too
      bundle.json                  what was built from what

and envd is started through the bundled loader, so nothing outside /opt/aenv is needed::

    /opt/aenv/lib/ld-linux-x86-64.so.2 --library-path /opt/aenv/lib \
        /opt/aenv/bin/python3 -s -m aenv_envd --port 49983

with `PYTHONHOME=/opt/aenv PYTHONPATH=/opt/aenv/app` (see `EnvdBundle.init_env`). envd must
drop the variables in `ENVD_ONLY_ENV` from the environment of the processes it spawns, or
the image's own Python would pick up our PYTHONHOME.

The directory name is a hash of the interpreter (path, version, binary size/mtime), the
bundle format and the app's file contents: computing it reads only envd's few files, so
`ensure_bundle` is fast when the bundle exists. A changed envd gives a new directory; old
ones stay for sandboxes (and checkpoints) that still use them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from ..config import Settings
from ..errors import AenvError
from .base import Mount

MOUNT = "/opt/aenv"
DEFAULT_PORT = 49983
APP_PACKAGE = "aenv_envd"
# Bump when the layout or the trimming rules change.
BUNDLE_FORMAT = 1
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Set for envd only; envd removes them from the environment of every process it starts.
ENVD_ONLY_ENV: tuple[str, ...] = (
    "PYTHONHOME",
    "PYTHONPATH",
    "PYTHONDONTWRITEBYTECODE",
    "PYTHONNOUSERSITE",
    "PYTHONUTF8",
    "PYTHONCOERCECLOCALE",
    "PYTHONUNBUFFERED",
)

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


class BundleError(AenvError):
    """The runtime bundle could not be built or failed its self-test."""


@dataclass(frozen=True)
class EnvdBundle:
    host_path: Path
    digest: str
    loader: str = "ld-linux-x86-64.so.2"
    python_version: str = ""
    meta: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    MOUNT: ClassVar[str] = MOUNT

    def python_args(self, *args: str, root: str = MOUNT) -> list[str]:
        """argv that runs the bundled python with `args`, the bundle being at `root`."""
        return [
            f"{root}/lib/{self.loader}",
            "--library-path",
            f"{root}/lib",
            f"{root}/bin/python3",
            "-s",
            *args,
        ]

    def python_env(self, root: str = MOUNT) -> dict[str, str]:
        return {
            "PYTHONHOME": root,
            "PYTHONPATH": f"{root}/app",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONNOUSERSITE": "1",
            # UTF-8 I/O without locale files, and no LC_CTYPE written into our environ.
            "PYTHONUTF8": "1",
            "PYTHONCOERCECLOCALE": "0",
            "PYTHONUNBUFFERED": "1",
            "PATH": PATH,
        }

    def init_args(self, port: int = DEFAULT_PORT) -> list[str]:
        """argv of the sandbox's first process (envd), inside the sandbox."""
        return self.python_args("-m", APP_PACKAGE, "--port", str(port))

    def init_env(self) -> dict[str, str]:
        """Environment of envd inside the sandbox."""
        return self.python_env(MOUNT)

    def mount(self) -> Mount:
        return Mount(source=self.host_path, destination=MOUNT, readonly=True)

    # Host-side equivalents (tests, preflight checks): the bundle run from where it lies.
    def host_args(self, *args: str) -> list[str]:
        return self.python_args(*args, root=str(self.host_path))

    def host_env(self) -> dict[str, str]:
        return self.python_env(str(self.host_path))

    @classmethod
    def load(cls, path: Path) -> EnvdBundle:
        meta = json.loads((path / "bundle.json").read_text())
        return cls(
            host_path=path,
            digest=meta["digest"],
            loader=meta["loader"],
            python_version=meta["python_version"],
            meta=meta,
        )


# --- the interpreter --------------------------------------------------------------------------


@dataclass(frozen=True)
class Interpreter:
    executable: Path  # resolved binary
    version: str  # sys.version
    version_info: tuple[int, int]
    stdlib: Path
    dynload: Path | None

    @property
    def libname(self) -> str:
        return f"python{self.version_info[0]}.{self.version_info[1]}"


_PROBE = """
import json, sys, sysconfig
dyn = next((p for p in sys.path if p.rstrip("/").endswith("lib-dynload")), None)
print(json.dumps({"version": sys.version, "vi": list(sys.version_info[:2]),
                  "stdlib": sysconfig.get_paths()["stdlib"], "dynload": dyn}))
"""


def current_interpreter() -> Interpreter:
    """The base interpreter running this process (the one a venv was created from)."""
    base_exe = getattr(sys, "_base_executable", None) or sys.executable
    exe = Path(os.path.realpath(base_exe))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    dyn = next((p for p in sys.path if p.rstrip("/").endswith("lib-dynload")), None)
    return Interpreter(
        executable=exe,
        version=sys.version,
        version_info=(sys.version_info[0], sys.version_info[1]),
        stdlib=stdlib,
        dynload=Path(dyn) if dyn else None,
    )


def probe_interpreter(python: Path) -> Interpreter:
    """Another interpreter's facts (runs it once)."""
    r = subprocess.run(
        [str(python), "-I", "-c", _PROBE], capture_output=True, text=True, check=False
    )
    if r.returncode != 0:
        raise BundleError(f"{python}: {r.stderr.strip()}")
    d = json.loads(r.stdout)
    return Interpreter(
        executable=Path(os.path.realpath(python)),
        version=d["version"],
        version_info=(int(d["vi"][0]), int(d["vi"][1])),
        stdlib=Path(d["stdlib"]),
        dynload=Path(d["dynload"]) if d["dynload"] else None,
    )


def envd_source_dir() -> Path:
    """src/aenv/envd, resolved from the installed package."""
    spec = importlib.util.find_spec("aenv.envd")
    if spec is not None:
        if spec.origin and spec.origin.endswith("__init__.py"):
            return Path(spec.origin).parent
        if spec.submodule_search_locations:
            return Path(list(spec.submodule_search_locations)[0])
    import aenv

    return Path(aenv.__file__).parent / "envd"


def _app_files(app_dir: Path) -> list[Path]:
    out: list[Path] = []
    if not app_dir.is_dir():
        return out
    for dirpath, dirnames, filenames in os.walk(app_dir):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith((".pyc", ".pyo")) or name.startswith("."):
                continue
            out.append(Path(dirpath, name).relative_to(app_dir))
    return out


def bundle_digest(interp: Interpreter, app_dir: Path) -> str:
    h = hashlib.sha256()
    st = interp.executable.stat()
    head = f"aenv-bundle-v{BUNDLE_FORMAT}\0{interp.executable}\0{st.st_size}\0{int(st.st_mtime)}\0"
    h.update(head.encode())
    h.update(interp.version.encode() + b"\0")
    for rel in _app_files(app_dir):
        data = (app_dir / rel).read_bytes()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:16]


# --- building -------------------------------------------------------------------------------


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


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
        "app_files": [str(p) for p in _app_files(app_dir)],
        "libs": sorted(p.name for p in lib.iterdir() if p.is_file()),
        "size": _du(dest),
        "build_seconds": round(time.monotonic() - t0, 2),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    (dest / "bundle.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


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
    with _flock(root / f".lock-{digest}"):
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
