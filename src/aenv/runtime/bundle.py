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
ones stay for sandboxes (and checkpoints) that still use them. `bundle_build.py` finds or
builds one (`ensure_bundle`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ..domain import ENVD_PORT
from ..errors import AenvError
from .base import Mount

MOUNT = "/opt/aenv"
DEFAULT_PORT = ENVD_PORT
# envd's start-up access token (envd/state.py: ENV_PREFIX + "ACCESS_TOKEN"); envd keeps it
# from the processes it starts.
ACCESS_TOKEN_ENV = "AENV_ENVD_ACCESS_TOKEN"
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

    def init_env(self, access_token: str = "") -> dict[str, str]:
        """Environment of envd inside the sandbox; `access_token` is in force from envd's
        first request (nothing reaches a fresh sandbox's envd before the node's /init)."""
        env = self.python_env(MOUNT)
        if access_token:
            env[ACCESS_TOKEN_ENV] = access_token
        return env

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
    return Path(__file__).resolve().parent.parent / "envd"


def app_files(app_dir: Path) -> list[Path]:
    """envd's source files (relative to `app_dir`): what a bundle copies and its digest hashes."""
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
    for rel in app_files(app_dir):
        data = (app_dir / rel).read_bytes()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:16]
