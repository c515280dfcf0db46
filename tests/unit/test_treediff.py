"""What changed between two layer stacks: the paths a sandbox added, changed and deleted over
its base, as a list, a unified diff that `git apply` takes, and a tar of the new files."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from aenv.images.overlay import OPAQUE
from aenv.images.treediff import (
    DEFAULT_EXCLUDE,
    changed_among,
    diff_stacks,
    unified,
    write_tar,
)


def put(layer: Path, rel: str, text: str = "", mode: int = 0o644) -> None:
    p = layer / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    p.chmod(mode)


def whiteout(layer: Path, rel: str) -> None:
    p = layer / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(p, 0o600 | 0o020000, os.makedev(0, 0))


def stacks(tmp: Path) -> tuple[list[Path], list[Path]]:
    """A fork point (two layers) and a child on it (its upper on top)."""
    base, point, upper = tmp / "base", tmp / "point", tmp / "upper"
    put(base, "etc/os-release", "debian\n")
    put(base, "usr/lib/big/a.py", "a\n")
    put(base, "usr/lib/big/b.py", "b\n")
    put(point, "work/main.py", "print('hi')\nx = 1\n")
    put(point, "work/notes.txt", "keep\n")
    put(point, "work/old.txt", "old\n")
    upper.mkdir()
    put(upper, "work/main.py", "print('hi')\nx = 2\n")
    put(upper, "work/new.txt", "new\n")
    whiteout(upper, "work/old.txt")
    whiteout(upper, "usr/lib/big")
    put(upper, "work/__pycache__/main.cpython-311.pyc", "\0bytecode")
    put(upper, "etc/machine-id", "0123\n")
    put(upper, "work/notes.txt", "keep\n", mode=0o600)  # only its mode
    return [upper, point, base], [point, base]


def test_the_changes_of_a_child_over_its_fork_point(tmp_path: Path) -> None:
    child, point = stacks(tmp_path)
    got = {(c.path, c.change, c.type) for c in diff_stacks(child, point, DEFAULT_EXCLUDE)}
    assert got == {
        ("/work/main.py", "changed", "file"),
        ("/work/new.txt", "added", "file"),
        ("/work/old.txt", "deleted", "file"),
        ("/work/notes.txt", "changed", "file"),
        ("/usr/lib/big", "deleted", "dir"),
        ("/usr/lib/big/a.py", "deleted", "file"),
        ("/usr/lib/big/b.py", "deleted", "file"),
    }
    # Nothing excluded: the cache and aenv's own identity file show up too.
    everything = {c.path for c in diff_stacks(child, point)}
    assert {"/work/__pycache__", "/etc/machine-id"} <= everything
    # And the other way round: what the child added is what the point lacks.
    back = {(c.path, c.change) for c in diff_stacks(point, child, DEFAULT_EXCLUDE)}
    assert ("/work/new.txt", "deleted") in back and ("/work/old.txt", "added") in back


def test_an_opaque_directory_deletes_what_was_below(tmp_path: Path) -> None:
    base, upper = tmp_path / "base", tmp_path / "upper"
    put(base, "d/gone.txt", "x\n")
    put(upper, "d/fresh.txt", "y\n")
    os.setxattr(upper / "d", OPAQUE, b"y")
    got = {(c.path, c.change) for c in diff_stacks([upper, base], [base])}
    assert got == {("/d/gone.txt", "deleted"), ("/d/fresh.txt", "added")}


def test_the_patch_applies_with_git(tmp_path: Path) -> None:
    child, point = stacks(tmp_path)
    patch = "".join(unified(diff_stacks(child, point, DEFAULT_EXCLUDE)))
    assert "-x = 1\n+x = 2\n" in patch
    repo = tmp_path / "repo"
    for rel in ("work/main.py", "work/notes.txt", "work/old.txt"):
        put(repo, rel, (tmp_path / "point" / rel).read_text())
    for rel in ("usr/lib/big/a.py", "usr/lib/big/b.py"):
        put(repo, rel, (tmp_path / "base" / rel).read_text())
    (repo / "p.diff").write_text(patch)
    subprocess.run(["git", "apply", "p.diff"], cwd=repo, check=True)
    assert (repo / "work/main.py").read_text() == "print('hi')\nx = 2\n"
    assert (repo / "work/new.txt").read_text() == "new\n"
    assert not (repo / "work/old.txt").exists()
    assert not (repo / "usr/lib/big/a.py").exists()


def test_the_tar_holds_the_new_files(tmp_path: Path) -> None:
    child, point = stacks(tmp_path)
    buf = io.BytesIO()
    n = write_tar(diff_stacks(child, point, DEFAULT_EXCLUDE), buf)
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tar:
        names = sorted(tar.getnames())
        assert names == ["work/main.py", "work/new.txt", "work/notes.txt"] and n == 3
        f = tar.extractfile("work/main.py")
        assert f is not None and f.read() == b"print('hi')\nx = 2\n"
        assert tar.getmember("work/notes.txt").mode == 0o600


def test_same_size_and_time_is_the_same_file_without_reading_it(tmp_path: Path) -> None:
    """A copy that kept size and mtime (a snapshot's copy of an upper) is not read; the same
    size with another time is compared by content."""
    base, upper = tmp_path / "base", tmp_path / "upper"
    put(base, "a.bin", "x" * 100)
    put(upper, "a.bin", "y" * 100)
    st = (base / "a.bin").stat()
    os.utime(upper / "a.bin", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert diff_stacks([upper, base], [base]) == []
    os.utime(upper / "a.bin", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert [c.path for c in diff_stacks([upper, base], [base])] == ["/a.bin"]
    (upper / "a.bin").write_text("x" * 100)  # another time, same bytes: unchanged
    assert diff_stacks([upper, base], [base]) == []


def test_paths_checked_one_by_one_agree_with_the_whole_diff(tmp_path: Path) -> None:
    """An apply's conflict check looks up only the source's paths in the target: for each
    of them it says what the whole diff says, unchanged paths and unknown ones included."""
    child, point = stacks(tmp_path)
    whole = {c.path for c in diff_stacks(child, point)}
    asked = [*whole, "/etc/os-release", "/work/nowhere.txt", "/usr/lib"]
    assert changed_among(child, point, asked) == whole
    assert changed_among(child, point, ["/etc/os-release", "/work/nowhere.txt"]) == set()


def test_envd_unpacks_the_tar_with_its_deletions(tmp_path: Path) -> None:
    """The apply's tar as envd's `/tree` takes it: the deleted paths removed first (a
    directory with all it held), then the files with their modes."""
    from aenv.envd.unpack import DELETE_MEMBER, unpack_file

    child, point = stacks(tmp_path)
    target = tmp_path / "target"
    put(target, "work/main.py", "print('hi')\nx = 1\n")
    put(target, "work/old.txt", "old\n")
    put(target, "usr/lib/big/a.py", "a\n")
    buf = io.BytesIO()
    write_tar(diff_stacks(child, point, DEFAULT_EXCLUDE), buf, DELETE_MEMBER)
    buf.seek(0)
    assert unpack_file(buf, str(target)) == {"deleted": 4, "extracted": 3}
    assert (target / "work/main.py").read_text() == "print('hi')\nx = 2\n"
    assert (target / "work/new.txt").read_text() == "new\n"
    assert not (target / "work/old.txt").exists() and not (target / "usr/lib/big").exists()
    assert not (target / ".aenv-apply").exists()
    assert (target / "work/notes.txt").stat().st_mode & 0o777 == 0o600


class _Body:
    """A request body as envd's server hands it over: `await read(n)`, here in odd pieces."""

    def __init__(self, data: bytes, piece: int) -> None:
        self.data, self.piece = data, piece

    async def read(self, n: int) -> bytes:
        out, self.data = self.data[: min(n, self.piece)], self.data[min(n, self.piece) :]
        return out


def test_envd_unpacks_a_body_as_it_arrives_and_a_broken_one_fails(tmp_path: Path) -> None:
    """`/tree`'s body unpacked while it streams in (pieces smaller than a tar block, many
    of them): every file arrives whole; a body that is not a tar fails, without hanging."""
    from aenv.envd.unpack import unpack

    files = {f"d/f{i}": os.urandom(100_000 + i) for i in range(40)}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    target = tmp_path / "target"
    target.mkdir()
    got = asyncio.run(asyncio.wait_for(unpack(_Body(buf.getvalue(), 1000), str(target)), 60))
    assert got == {"deleted": 0, "extracted": 40}
    assert all((target / n).read_bytes() == d for n, d in files.items())
    bad = _Body(b"not a tar at all" * 100_000, 4096)
    with pytest.raises(tarfile.TarError):
        asyncio.run(asyncio.wait_for(unpack(bad, str(target)), 60))
    assert bad.data == b""  # read to its end all the same
