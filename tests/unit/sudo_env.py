"""The sudo tests' environment: envd run as root from a copy of its sources (as the bundle's
``aenv_envd``) with the service socket and fake /etc/passwd and /etc/group in a world-readable
temp dir, the real ``/usr/bin/sudo`` wrapper script pointed at a fake bundle of symlinks to the
host's python3.11, and the uids that exist only in the fake passwd.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from aenv.envd import sudo, sudo_protocol
from aenv.runtime.bundle_build import SPAWN_LIB, SPAWN_SOURCE, build_spawn_lib
from tests.helpers import SRC, free_port, wait_healthy, wait_until

SYSTEM_PY = Path("/usr/bin/python3.11")
LOADER = Path("/lib64/ld-linux-x86-64.so.2")


ALICE, BOB, CAROL = 65533, 65532, 65531  # sudo member, not a member, primary group sudo
SUDO_GID = 27


class Env:
    def __init__(self, root: Path, sock: Path, shim: Path, proc: subprocess.Popen[bytes]):
        self.root = root
        self.sock = sock
        self.shim = shim
        self.proc = proc

    def argv(self, *args: str, uid: int | None = None, gid: int | None = None) -> list[str]:
        cmd = ["/bin/sh", str(self.shim), *args]
        if uid is None:
            return cmd
        g = uid if gid is None else gid
        return ["setpriv", f"--reuid={uid}", f"--regid={g}", "--clear-groups", *cmd]

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "TERM": "xterm",
            "HOME": "/root",
            sudo_protocol.SOCKET_ENV: str(self.sock),
        }
        env.update(extra)
        return env

    def run(
        self,
        *args: str,
        uid: int | None = None,
        gid: int | None = None,
        input: bytes | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            self.argv(*args, uid=uid, gid=gid),
            input=input,
            capture_output=True,
            env=env or self.env(),
            cwd=self.root,
            timeout=30,
        )
        return subprocess.CompletedProcess(
            r.args, r.returncode, r.stdout.decode(errors="replace"), r.stderr.decode()
        )


def _fake_bundle(b: Path) -> None:
    """What /opt/aenv provides to the wrapper, made of the host's python3.11."""
    (b / "bin").mkdir(parents=True)
    (b / "lib").mkdir()
    (b / "bin/python3").symlink_to(SYSTEM_PY.resolve())
    (b / "lib/ld-linux-x86-64.so.2").symlink_to(LOADER)
    (b / "lib/python3.11").symlink_to("/usr/lib/python3.11")
    shutil.copytree(SRC / "aenv/envd", b / "app/aenv_envd")
    # envd's spawn library, as the bundle has it: commands start through it, not subprocess.
    build_spawn_lib(SRC / "aenv/envd" / SPAWN_SOURCE, b / "lib" / SPAWN_LIB)


@contextlib.contextmanager
def sudo_env() -> Iterator[Env]:
    root = Path(tempfile.mkdtemp(prefix="aenv-sudo-"))
    try:
        root.chmod(0o755)
        _fake_bundle(root / "bundle")
        home = root / "home"
        for name, uid in (("alice", ALICE), ("bob", BOB)):
            (home / name).mkdir(parents=True)
            os.chown(home / name, uid, uid)
        (root / "passwd").write_text(
            "root:x:0:0:root:/root:/bin/sh\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
            f"alice:x:{ALICE}:{ALICE}::{home}/alice:/bin/bash\n"
            f"bob:x:{BOB}:{BOB}::{home}/bob:/bin/sh\n"
        )
        (root / "group").write_text(
            f"root:x:0:\nsudo:x:{SUDO_GID}:alice\nalice:x:{ALICE}:\nbob:x:{BOB}:\n"
            "nogroup:x:65534:\nstaff:x:50:bob\n"
        )
        shim = root / "sudo"
        shim.write_text(sudo.SHIM_SCRIPT.replace("b=/opt/aenv", f"b={root}/bundle"))
        shim.chmod(0o755)
        sock = root / "run/sudo.sock"
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "aenv_envd", "--host", "127.0.0.1", "--port", str(port)],
            env={
                "PATH": "/usr/bin:/bin",
                "PYTHONPATH": str(root / "bundle/app"),
                "AENV_ENVD_SUDO_SOCKET": str(sock),
                "AENV_ENVD_PASSWD_FILE": str(root / "passwd"),
                "AENV_ENVD_GROUP_FILE": str(root / "group"),
            },
            cwd="/",
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            # Generous: the host may be busy. The service starts right after the HTTP listener.
            wait_healthy(f"http://127.0.0.1:{port}", timeout=60, proc=proc)
            wait_until(sock.exists, 60, what="the sudo socket")
            yield Env(root, sock, shim, proc)
            proc.terminate()
            proc.wait(30)
            assert not sock.exists()  # removed on shutdown
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        shutil.rmtree(root, ignore_errors=True)
