"""The volume store (records under one root) and a volume's files as /volumecontent
serves them, on a temp directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aenv.domain import MountRequest, VolumeMount
from aenv.errors import BadRequest, Conflict, NotFound, Unauthorized
from aenv.volumes import VolumeFiles, VolumeStore


@pytest.fixture
def store(tmp_path: Path) -> VolumeStore:
    return VolumeStore(tmp_path / "vols")


def test_create_get_list_delete(store: VolumeStore) -> None:
    a = store.create("data-1")
    b = store.create("other_2")
    assert store.get(a.volume_id) == a
    assert [v.name for v in store.all()] == ["data-1", "other_2"]
    assert store.data_dir(a.volume_id).is_dir()
    # A second store on the same root (another node on a shared file system) sees them.
    assert VolumeStore(store.root).get(b.volume_id) == b
    store.delete(a.volume_id)
    with pytest.raises(NotFound):
        store.get(a.volume_id)
    assert [v.name for v in store.all()] == ["other_2"]
    # The name is free again, for a new volume with another id.
    assert store.create("data-1").volume_id != a.volume_id


def test_names_are_unique_and_checked(store: VolumeStore) -> None:
    store.create("x")
    with pytest.raises(Conflict):
        store.create("x")
    for bad in ("", "a b", "../x", "a/b", "é", "x" * 65):
        with pytest.raises(BadRequest):
            store.create(bad)


def test_metadata_is_private_and_whole(store: VolumeStore) -> None:
    v = store.create("secret")
    meta = store.root / v.volume_id / "volume.json"
    assert meta.stat().st_mode & 0o777 == 0o600
    assert v.token in meta.read_text()
    assert not [p for p in meta.parent.iterdir() if p.name.endswith(".tmp")]


def test_a_directory_no_name_points_to_is_not_a_volume(store: VolumeStore) -> None:
    v = store.create("half")
    os.unlink(store.root / "names" / "half")  # a delete cut short after dropping the name
    with pytest.raises(NotFound):
        store.get(v.volume_id)
    assert store.all() == []


def test_token(store: VolumeStore) -> None:
    v = store.create("t")
    assert store.authorize(v.volume_id, v.token) == v
    for bad in ("", "nope", v.token + "x"):
        with pytest.raises(Unauthorized):
            store.authorize(v.volume_id, bad)
    with pytest.raises(NotFound):
        store.authorize("v" + "0" * 19, v.token)


def test_resolve_mounts(store: VolumeStore) -> None:
    v = store.create("data")
    got = store.resolve([MountRequest("data", "/mnt/data/", read_only=True)], ("/opt/aenv",))
    assert got == [VolumeMount(v.volume_id, "data", "/mnt/data", True)]
    bad = [
        [MountRequest("missing", "/mnt")],
        [MountRequest("bad name", "/mnt")],
        [MountRequest("data", "relative")],
        [MountRequest("data", "/")],
        [MountRequest("data", "/mnt/../etc")],
        [MountRequest("data", "/opt")],  # would hide the envd bundle below it
        [MountRequest("data", "/opt/aenv/x")],
        [MountRequest("data", "/a"), MountRequest("data", "/a/b")],
    ]
    for wanted in bad:
        with pytest.raises(BadRequest):
            store.resolve(wanted, ("/opt/aenv",))


def test_check_present(store: VolumeStore) -> None:
    v = store.create("gone")
    mounts = [VolumeMount(v.volume_id, "gone", "/mnt")]
    store.check_present(mounts)
    store.delete(v.volume_id)
    with pytest.raises(BadRequest, match="was deleted"):
        store.check_present(mounts)


# ---------------------------------------------------------------------------- files


@pytest.fixture
def files(tmp_path: Path) -> VolumeFiles:
    top = tmp_path / "data"
    top.mkdir()
    return VolumeFiles(top)


def _write(files: VolumeFiles, path: str, data: bytes, **kw: object) -> object:
    with files.writer(path, **kw) as up:  # type: ignore[arg-type]
        up.write(data)
        return up.commit()


def test_write_read_stat(files: VolumeFiles) -> None:
    e = _write(files, "/a.txt", b"hello", uid=1000, gid=1000, mode=0o640)
    assert (e.type, e.path, e.name, e.size, e.mode, e.uid, e.gid) == (  # type: ignore[attr-defined]
        "file",
        "/a.txt",
        "a.txt",
        5,
        0o640,
        1000,
        1000,
    )
    f, size = files.open_file("a.txt")
    with f:
        assert (f.read(), size) == (b"hello", 5)
    assert files.stat("/").type == "directory"
    # No upload leftovers beside the file.
    assert [p.name for p in files.top.iterdir()] == ["a.txt"]


def test_overwrite_rules(files: VolumeFiles) -> None:
    _write(files, "/f", b"1")
    _write(files, "/f", b"22")  # replaced by default
    with pytest.raises(Conflict):
        _write(files, "/f", b"333", overwrite=False)
    assert (files.top / "f").read_bytes() == b"22"
    files.make_dir("/d")
    with pytest.raises(Conflict):
        _write(files, "/d", b"x")
    with pytest.raises(NotFound):
        _write(files, "/missing/f", b"x")


def test_make_dir(files: VolumeFiles) -> None:
    e = files.make_dir("/a/b/c", force=True, uid=5, gid=6, mode=0o750)
    assert (e.type, e.mode, e.uid) == ("directory", 0o750, 5)
    assert files.stat("/a").uid == 5
    with pytest.raises(Conflict):
        files.make_dir("/a/b/c")
    assert files.make_dir("/a/b/c", force=True).path == "/a/b/c"
    with pytest.raises(NotFound):
        files.make_dir("/x/y")
    with pytest.raises(BadRequest):
        files.make_dir("/m", mode=0o17777)


def test_list_and_depth(files: VolumeFiles) -> None:
    files.make_dir("/d/e", force=True)
    _write(files, "/d/f", b"x")
    _write(files, "/d/e/g", b"y")
    assert [e.path for e in files.list_dir("/d")] == ["/d/e", "/d/f"]
    assert [e.path for e in files.list_dir("d", depth=2)] == ["/d/e", "/d/e/g", "/d/f"]
    with pytest.raises(NotFound):
        files.list_dir("/nope")


def test_update_and_remove(files: VolumeFiles) -> None:
    _write(files, "/f", b"x")
    e = files.update("/f", uid=1001, mode=0o700)
    assert (e.uid, e.gid, e.mode) == (1001, 0, 0o700)
    files.make_dir("/t/u", force=True)
    _write(files, "/t/u/v", b"x")
    files.remove("/t")
    files.remove("f")
    assert list(files.top.iterdir()) == []
    with pytest.raises(NotFound):
        files.remove("/f")
    with pytest.raises(BadRequest):
        files.remove("/")


def test_paths_stay_inside(files: VolumeFiles, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("host file")
    _write(files, "/../../x", b"in")  # `..` stops at the volume's top
    assert (files.top / "x").read_bytes() == b"in"
    # Links a sandbox planted are never followed, to read, write, list, chmod or remove.
    os.symlink(outside, files.top / "dirlink")
    os.symlink(outside / "secret", files.top / "filelink")
    with pytest.raises(BadRequest):
        files.open_file("/filelink")
    with pytest.raises(BadRequest):
        _write(files, "/dirlink/secret", b"pwned")
    with pytest.raises(BadRequest):
        files.list_dir("/dirlink")
    with pytest.raises(BadRequest):
        files.update("/filelink", mode=0o777)
    link = files.stat("/filelink")
    assert (link.type, link.target) == ("symlink", str(outside / "secret"))
    files.remove("/dirlink")
    assert (outside / "secret").read_text() == "host file"
    assert outside.stat().st_mode & 0o777 != 0o777


def test_new_entries_inherit_their_directory_owner(store: VolumeStore) -> None:
    v = store.create("owned")
    top = store.data_dir(v.volume_id)
    assert (top.stat().st_uid, top.stat().st_mode & 0o777) == (1000, 0o777)
    files = VolumeFiles(top)
    assert _write(files, "/f", b"x").uid == 1000  # type: ignore[attr-defined]
    assert files.make_dir("/a/b", force=True).gid == 1000
    assert files.stat("/a").uid == 1000
    assert files.make_dir("/r", uid=0, gid=0).uid == 0
    assert _write(files, "/r/f", b"x").uid == 0  # type: ignore[attr-defined]


def test_volumes_root_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aenv.config import Settings

    monkeypatch.delenv("AENV_VOLUMES_ROOT", raising=False)
    assert Settings(home=tmp_path).volumes_dir == tmp_path / "volumes"
    (tmp_path / "config.toml").write_text('volumes_root = "/srv/shared-volumes"\n')
    monkeypatch.setenv("AENV_HOME", str(tmp_path))
    assert Settings().volumes_dir == Path("/srv/shared-volumes")
    monkeypatch.setenv("AENV_VOLUMES_ROOT", "/mnt/nfs/volumes")
    assert Settings().volumes_dir == Path("/mnt/nfs/volumes")


def test_a_download_sends_what_the_file_held_when_opened(tmp_path: Path) -> None:
    """A sandbox may append to a file while it downloads: the answer keeps the length it
    announced (Content-Length) instead of breaking off with more."""
    from aenv.api.routes.volumes import _chunks

    p = tmp_path / "log.txt"
    p.write_bytes(b"0123456789")
    f = p.open("rb")
    size = 10
    with p.open("ab") as appender:
        appender.write(b"more lines" * 100_000)
    assert b"".join(_chunks(f, size)) == b"0123456789"
