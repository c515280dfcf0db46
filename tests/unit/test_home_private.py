"""$AENV_HOME is root's alone (issue 10, part 8): a home as an older aenv left it (0755
directories, a 0644 catalog with its WAL, key files, a layer holding a set-uid root binary a
sandbox planted, a snapshot repository) is tightened when the node starts, and an unprivileged
host user (uid 65534 through setpriv) then reads, lists and runs none of it. Root only."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.builds.store import BuildStore
from aenv.config import Settings
from aenv.fsutil import private_sqlite
from aenv.orchestrator.catalog import Catalog
from aenv.server import prepare_home
from aenv.snapshots.repos.local import LocalRepository

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv"
)

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]


def as_nobody(*cmd: str) -> subprocess.CompletedProcess[str]:
    """`cmd` run by uid 65534 through a shell: setpriv's own execve still holds root's
    capabilities, the shell's does not."""
    return subprocess.run(
        [*NOBODY, "/bin/sh", "-c", 'exec "$@"', "sh", *cmd],
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user may enter (as /var/lib is): tmp_path's parents are 0700, which
    would keep nobody out whatever aenv did."""
    d = Path(tempfile.mkdtemp(prefix="aenv-private-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _old_home(home: Path) -> dict[str, Path]:
    """The files of a home as aenv left them before: world-readable, in 0755 directories."""
    old_umask = os.umask(0o022)
    try:
        home.mkdir(mode=0o755)
        catalog = home / "catalog.db"
        db = sqlite3.connect(catalog)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE t (token TEXT)")
        db.execute("INSERT INTO t VALUES ('envd-token')")
        db.commit()  # WAL mode: the row sits in catalog.db-wal until a checkpoint
        db.close()
        # A closed WAL database loses its side files; an older server leaves them open.
        for side in ("-wal", "-shm"):
            (home / f"catalog.db{side}").write_bytes(b"envd-token")
        secrets = home / "secrets"
        secrets.mkdir(mode=0o755)
        (secrets / "api-key").write_text("e2b_secret\n")
        (home / "builds.db").write_bytes(b"")
        planted = home / "layers" / "sha256-x" / "rootfs" / "home" / "user" / "sb"
        planted.parent.mkdir(parents=True)
        shutil.copy("/bin/true", planted)
        planted.chmod(0o4755)  # root-owned set-uid, as `sudo chmod 4755 ~/sb` leaves it
        (home / "repo").mkdir()
    finally:
        os.umask(old_umask)
    return {
        "catalog": catalog,
        "wal": home / "catalog.db-wal",
        "shm": home / "catalog.db-shm",
        "api-key": secrets / "api-key",
        "builds": home / "builds.db",
        "planted": planted,
    }


def test_an_old_home_is_tightened_and_unreadable_for_other_users(open_dir: Path) -> None:
    home = open_dir / "home"
    files = _old_home(home)
    # The test can fail: before, an unprivileged user reads the token and runs the binary.
    assert as_nobody("cat", str(files["wal"])).stdout == "envd-token"
    assert as_nobody(str(files["planted"])).returncode == 0

    settings = Settings(home=home)
    prepare_home(settings)  # what `aenv server` does first
    assert home.stat().st_mode & 0o777 == 0o700
    for d in (home / "secrets", home / "layers", home / "repo"):
        assert d.stat().st_mode & 0o777 == 0o700, d
    for name in ("catalog", "wal", "shm", "api-key", "builds"):
        assert files[name].stat().st_mode & 0o777 == 0o600, name
    Catalog(settings.catalog_path).close()
    BuildStore(home / "builds.db")
    # The sandbox's files keep their modes: they are what it sees.
    assert files["planted"].stat().st_mode & 0o7777 == 0o4755

    for path in [home, *home.rglob("*")]:
        r = as_nobody("cat" if path.is_file() else "ls", str(path))
        assert r.returncode != 0 and "Permission denied" in r.stderr, (path, r)
    r = as_nobody(str(files["planted"]))
    assert r.returncode != 0 and "Permission denied" in r.stderr


def test_databases_are_tightened_on_open(open_dir: Path) -> None:
    """Also where the node's start did not run first (`aenv keys`, a build store)."""
    home = open_dir / "home"
    files = _old_home(home)
    for name in ("catalog", "wal", "shm"):
        files[name].chmod(0o644)
    db = Catalog(home / "catalog.db")
    try:
        for name in ("catalog", "wal", "shm"):
            assert files[name].stat().st_mode & 0o777 == 0o600, name
    finally:
        db.close()


def test_new_state_files_are_private(open_dir: Path) -> None:
    home = open_dir / "fresh"
    settings = Settings(home=home)
    prepare_home(settings)
    catalog = Catalog(settings.catalog_path)
    try:
        for p in home.iterdir():
            if p.name.startswith("catalog.db"):
                assert p.stat().st_mode & 0o777 == 0o600, p
    finally:
        catalog.close()
    db = private_sqlite(home / "cache" / "refs.db")
    assert db.stat().st_mode & 0o777 == 0o600
    assert db.parent.stat().st_mode & 0o777 == 0o700


async def test_a_local_snapshot_repository_is_private(open_dir: Path) -> None:
    root = open_dir / "repo"
    root.mkdir(mode=0o755)
    repo = LocalRepository(root)
    await repo.put_bytes("snapshots/s1/manifest.json", b"{}")
    assert root.stat().st_mode & 0o777 == 0o700
    r = as_nobody("cat", str(root / "snapshots" / "s1" / "manifest.json"))
    assert r.returncode != 0 and "Permission denied" in r.stderr
