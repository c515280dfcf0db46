"""envd's spawn helper (envd/spawn_as.c), compiled as the bundle compiles it and run as root:
the program runs with exactly the credentials asked for, and a failure comes back through the
error pipe the way envd reads it."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from aenv.runtime.bundle_build import SPAWN_AS_SOURCE, _build_spawn_as

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("cc") is None, reason="needs root and a C compiler"
)

SOURCE = Path(__file__).resolve().parents[2] / "src" / "aenv" / "envd" / SPAWN_AS_SOURCE


@pytest.fixture(scope="module")
def helper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("spawn") / "aenv-spawn-as"
    _build_spawn_as(SOURCE, out)
    assert out.is_file()
    return out


def spawn(helper: Path, *args: str) -> tuple[bytes, subprocess.CompletedProcess[str]]:
    r, w = os.pipe2(os.O_CLOEXEC)
    p = subprocess.Popen(
        [str(helper), *args[:3], str(w), *args[3:]],
        pass_fds=(w,),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    os.close(w)
    report = b""
    while chunk := os.read(r, 64):
        report += chunk
    os.close(r)
    out, err = p.communicate(timeout=30)
    return report, subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_the_program_runs_as_the_user_with_its_groups(helper: Path) -> None:
    report, r = spawn(helper, "65534", "65534", "65534,100", "sh", "-c", "id -u; id -g; id -G")
    assert report == b""  # exec'd: the pipe closed without a word
    assert r.stdout.split() == ["65534", "65534", "65534", "100"]
    # The error pipe is not left open in the program.
    report, r = spawn(helper, "0", "0", "-", "sh", "-c", "ls /proc/self/fd | wc -l")
    assert report == b"" and int(r.stdout) == 4  # 0, 1, 2 and ls's own directory


def test_a_missing_program_is_reported_with_its_errno(helper: Path) -> None:
    report, r = spawn(helper, "65534", "65534", "-", "no-such-program-here")
    assert report == f"exec:{errno.ENOENT}".encode()
    assert r.returncode == 127


def test_bad_ids_are_refused_before_anything_runs(helper: Path) -> None:
    report, r = spawn(helper, "nobody", "65534", "-", "true")
    assert report == f"usage:{errno.EINVAL}".encode() and r.returncode == 127
