"""One-pass layer unpacking: compression, whiteouts, metadata, safety, verification."""

from __future__ import annotations

import asyncio
import functools
import gzip
import hashlib
import io
import os
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zstandard

from aenv.errors import BadGateway
from aenv.images.manifests import DigestMismatch
from aenv.images.pipe import BlobPipe, run_in_thread
from aenv.images.streams import InvalidLayer, detect_compression
from aenv.images.unpack import OPAQUE_XATTR, UnpackResult, unpack_layer

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="unpacking needs root")

MTIME = 1_700_000_000


@dataclass
class E:
    """One tar entry."""

    name: str
    type: bytes = tarfile.REGTYPE
    data: bytes = b""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    linkname: str = ""
    devmajor: int = 0
    devminor: int = 0
    pax: dict[str, str] = field(default_factory=dict)


def make_tar(entries: list[E]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.type = e.type
            info.mode = e.mode
            info.uid, info.gid = e.uid, e.gid
            info.mtime = MTIME
            info.linkname = e.linkname
            info.devmajor, info.devminor = e.devmajor, e.devminor
            info.pax_headers = dict(e.pax)
            if e.type == tarfile.REGTYPE:
                info.size = len(e.data)
                tf.addfile(info, io.BytesIO(e.data))
            else:
                tf.addfile(info)
    return buf.getvalue()


def compress(data: bytes, kind: str) -> bytes:
    if kind == "gzip":
        return gzip.compress(data)
    if kind == "zstd":
        return zstandard.ZstdCompressor().compress(data)
    return data


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def unpack(blob: bytes, dest: Path, **kw: Any) -> UnpackResult:
    return unpack_layer(io.BytesIO(blob), dest, **kw)


BASIC = [
    E("./", tarfile.DIRTYPE, mode=0o755),
    E("bin/", tarfile.DIRTYPE, mode=0o755),
    E("bin/tool", data=b"\x7fELF" + b"x" * 5000, mode=0o4755, uid=0, gid=0),
    E("bin/link", tarfile.SYMTYPE, linkname="tool"),
    E("bin/hard", tarfile.LNKTYPE, linkname="bin/tool"),
    E("home/", tarfile.DIRTYPE, mode=0o750, uid=1000, gid=1000),
    E("home/user/", tarfile.DIRTYPE, mode=0o700, uid=1000, gid=1001),
    E("home/user/notes", data=b"hi\n", mode=0o600, uid=1000, gid=1001),
    E("tmp/", tarfile.DIRTYPE, mode=0o1777),
    E("run/fifo", tarfile.FIFOTYPE, mode=0o600),
    E("etc/abs", tarfile.SYMTYPE, linkname="/etc/passwd"),
]


@pytest.mark.parametrize("kind", ["gzip", "zstd", "none"])
def test_unpack_preserves_files_and_metadata(tmp_path: Path, kind: str) -> None:
    tar = make_tar(BASIC)
    blob = compress(tar, kind)
    dest = tmp_path / "rootfs"
    res = unpack(blob, dest, digest=sha(blob), size=len(blob), diff_id=sha(tar))
    assert res.compression == kind
    assert res.digest == sha(blob) and res.diff_id == sha(tar)
    assert res.compressed_size == len(blob) and res.tar_size == len(tar)

    tool = dest / "bin/tool"
    st = tool.lstat()
    assert stat.S_IMODE(st.st_mode) == 0o4755  # setuid survives chown
    assert tool.read_bytes().startswith(b"\x7fELF")
    assert int(st.st_mtime) == MTIME
    assert os.readlink(dest / "bin/link") == "tool"
    assert (dest / "bin/hard").lstat().st_ino == st.st_ino
    home = (dest / "home/user").lstat()
    assert (home.st_uid, home.st_gid, stat.S_IMODE(home.st_mode)) == (1000, 1001, 0o700)
    assert int(home.st_mtime) == MTIME  # directory mtimes are set after their content
    notes = (dest / "home/user/notes").lstat()
    assert (notes.st_uid, notes.st_gid, stat.S_IMODE(notes.st_mode)) == (1000, 1001, 0o600)
    assert stat.S_IMODE((dest / "tmp").lstat().st_mode) == 0o1777
    assert stat.S_ISFIFO((dest / "run/fifo").lstat().st_mode)
    assert os.readlink(dest / "etc/abs") == "/etc/passwd"
    assert res.stats.hardlinks == 1 and res.stats.symlinks == 2


def test_whiteouts_become_overlay_whiteouts(tmp_path: Path) -> None:
    tar = make_tar(
        [
            E("etc/", tarfile.DIRTYPE, mode=0o755),
            E("etc/.wh.removed"),
            E("opaque/", tarfile.DIRTYPE, mode=0o755),
            E("opaque/.wh..wh..opq"),
            E("opaque/new", data=b"new"),
            # A file of the same layer wins over its whiteout, in either order.
            E("kept1", data=b"1"),
            E(".wh.kept1"),
            E(".wh.kept2"),
            E("kept2", data=b"2"),
            E(".wh..wh.plnk/", tarfile.DIRTYPE),
            # Whiteout in a directory that has no entry of its own.
            E("var/lib/.wh.gone"),
        ]
    )
    dest = tmp_path / "l"
    res = unpack(tar, dest)
    wh = (dest / "etc/removed").lstat()
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0
    assert os.getxattr(dest / "opaque", OPAQUE_XATTR) == b"y"
    assert (dest / "opaque/new").read_bytes() == b"new"
    assert (dest / "kept1").read_bytes() == b"1"
    assert (dest / "kept2").read_bytes() == b"2"
    assert stat.S_ISCHR((dest / "var/lib/gone").lstat().st_mode)
    assert not (dest / ".wh..wh.plnk").exists()
    assert res.stats.whiteouts == 3 and res.stats.opaque_dirs == 1


def test_device_nodes_are_skipped(tmp_path: Path) -> None:
    tar = make_tar(
        [
            E("dev/", tarfile.DIRTYPE),
            E("dev/null", tarfile.CHRTYPE, devmajor=1, devminor=3, mode=0o666),
            E("dev/sda", tarfile.BLKTYPE, devmajor=8, devminor=0),
            E("dev/zero-looking", tarfile.CHRTYPE, devmajor=0, devminor=0),
            E("ok", data=b"ok"),
        ]
    )
    dest = tmp_path / "l"
    res = unpack(tar, dest)
    assert sorted(os.listdir(dest / "dev")) == []
    assert (dest / "ok").read_bytes() == b"ok"
    assert sorted(res.stats.skipped) == ["dev/null", "dev/sda", "dev/zero-looking"]


@pytest.mark.parametrize(
    "entries",
    [
        [E("/etc/passwd", data=b"x")],
        [E("../escape", data=b"x")],
        [E("a/../../escape", data=b"x")],
        [E("x", tarfile.LNKTYPE, linkname="../../etc/passwd")],
        [E("x", tarfile.LNKTYPE, linkname="/etc/passwd")],
        [E("x", tarfile.LNKTYPE, linkname="missing")],
        [E("d/", tarfile.DIRTYPE), E("x", tarfile.LNKTYPE, linkname="d")],
    ],
    ids=[
        "absolute",
        "dotdot",
        "nested-dotdot",
        "hardlink-dotdot",
        "hardlink-abs",
        "hardlink-missing",
        "hardlink-dir",
    ],
)
def test_unsafe_entries_refuse_the_layer(tmp_path: Path, entries: list[E]) -> None:
    dest = tmp_path / "inside" / "l"
    with pytest.raises(InvalidLayer):
        unpack(make_tar(entries), dest)
    assert not (tmp_path / "escape").exists()
    assert not (tmp_path / "inside" / "escape").exists()


def test_symlinked_parents_resolve_inside_the_layer(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    tar = make_tar(
        [
            E("up", tarfile.SYMTYPE, linkname="../../../.."),
            E("up/pwned", data=b"x"),
            E("abs", tarfile.SYMTYPE, linkname=str(outside)),
            E("abs/pwned", data=b"y"),
            E("usr/lib/", tarfile.DIRTYPE),
            E("lib", tarfile.SYMTYPE, linkname="usr/lib"),
            E("lib/libc.so", data=b"libc"),
            # The last component is never followed: the symlink is replaced.
            E("victim", tarfile.SYMTYPE, linkname=str(outside / "target")),
            E("victim", data=b"z"),
        ]
    )
    dest = tmp_path / "a" / "b" / "l"
    unpack(tar, dest)
    assert os.listdir(outside) == []
    assert (dest / "pwned").read_bytes() == b"x"  # `..` stops at the layer root
    assert (dest / outside.relative_to("/") / "pwned").read_bytes() == b"y"
    assert (dest / "usr/lib/libc.so").read_bytes() == b"libc"
    assert (dest / "victim").is_file() and not (dest / "victim").is_symlink()
    assert not (outside / "target").exists()


def test_xattrs_kept_except_trusted(tmp_path: Path) -> None:
    tar = make_tar(
        [
            E(
                "f",
                data=b"x",
                pax={
                    "SCHILY.xattr.user.note": "hello",
                    "SCHILY.xattr.trusted.overlay.opaque": "y",
                    "SCHILY.xattr.trusted.overlay.redirect": "/etc",
                },
            ),
            E("d/", tarfile.DIRTYPE, pax={"SCHILY.xattr.trusted.overlay.opaque": "y"}),
        ]
    )
    dest = tmp_path / "l"
    unpack(tar, dest)
    assert os.getxattr(dest / "f", "user.note") == b"hello"
    assert not any(n.startswith("trusted.") for n in os.listxattr(dest / "f"))
    assert not any(n.startswith("trusted.") for n in os.listxattr(dest / "d"))


def test_replacing_entries_within_a_layer(tmp_path: Path) -> None:
    tar = make_tar(
        [
            E("a/", tarfile.DIRTYPE),
            E("a/child", data=b"c"),
            E("a", data=b"now a file"),
            E("b", data=b"file"),
            E("b/", tarfile.DIRTYPE, mode=0o711),
        ]
    )
    dest = tmp_path / "l"
    unpack(tar, dest)
    assert (dest / "a").read_bytes() == b"now a file"
    assert (dest / "b").is_dir() and stat.S_IMODE((dest / "b").stat().st_mode) == 0o711


def test_multi_member_gzip_and_multi_frame_zstd(tmp_path: Path) -> None:
    tar = make_tar([E("x", data=os.urandom(200_000)), E("y", data=b"y" * 100_000)])
    half = len(tar) // 2
    gz = gzip.compress(tar[:half]) + gzip.compress(tar[half:])
    res = unpack(gz, tmp_path / "g", digest=sha(gz), diff_id=sha(tar))
    assert res.compression == "gzip" and (tmp_path / "g/y").stat().st_size == 100_000
    c = zstandard.ZstdCompressor()
    zs = c.compress(tar[:half]) + c.compress(tar[half:])
    res = unpack(zs, tmp_path / "z", digest=sha(zs), diff_id=sha(tar))
    assert res.compression == "zstd" and (tmp_path / "z/x").stat().st_size == 200_000


def test_digest_size_and_diff_id_are_verified(tmp_path: Path) -> None:
    tar = make_tar(BASIC)
    blob = gzip.compress(tar)
    with pytest.raises(DigestMismatch, match="hashes to"):
        unpack(blob, tmp_path / "a", digest=sha(b"other"), size=len(blob))
    with pytest.raises(DigestMismatch, match="diff_id"):
        unpack(blob, tmp_path / "b", digest=sha(blob), diff_id=sha(b"other"))
    with pytest.raises(DigestMismatch, match="larger"):
        unpack(blob, tmp_path / "c", digest=sha(blob), size=len(blob) - 1)
    # Tampered bytes usually break the gzip/tar first; the error still names the digest.
    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 0xFF
    with pytest.raises(DigestMismatch) as info:
        unpack(bytes(bad), tmp_path / "d", digest=sha(blob), size=len(blob))
    assert isinstance(info.value, BadGateway)
    # Without a digest to compare with, corruption is an invalid layer.
    with pytest.raises(InvalidLayer):
        unpack(bytes(bad), tmp_path / "e")


def test_truncated_stream_is_an_error(tmp_path: Path) -> None:
    blob = gzip.compress(make_tar(BASIC))
    with pytest.raises(InvalidLayer):
        unpack(blob[: len(blob) // 2], tmp_path / "a")


def test_replay_and_tee(tmp_path: Path) -> None:
    tar = make_tar([E("f", data=os.urandom(300_000))])
    blob = gzip.compress(tar)
    cut = len(blob) // 3
    tee = io.BytesIO()
    res = unpack_layer(
        io.BytesIO(blob[cut:]),
        tmp_path / "l",
        digest=sha(blob),
        size=len(blob),
        diff_id=sha(tar),
        replay=io.BytesIO(blob[:cut]),
        tee=tee,
    )
    assert res.digest == sha(blob)
    assert tee.getvalue() == blob[cut:]


def test_detect_compression() -> None:
    assert detect_compression(b"\x1f\x8b\x08\x00", None) == "gzip"
    assert detect_compression(b"\x28\xb5\x2f\xfd", None) == "zstd"
    assert detect_compression(b"etc/", "application/vnd.oci.image.layer.v1.tar") == "none"
    # Magic bytes win over a wrong media type.
    assert detect_compression(b"etc/", "application/vnd.oci.image.layer.v1.tar+gzip") == "none"
    assert detect_compression(b"", "application/vnd.oci.image.layer.v1.tar+zstd") == "zstd"


async def test_blob_pipe_streams_from_the_event_loop(tmp_path: Path) -> None:
    tar = make_tar([E("big", data=os.urandom(3_000_000))])
    blob = gzip.compress(tar)
    pipe = BlobPipe(max_chunks=2)
    consumer = asyncio.ensure_future(
        asyncio.to_thread(unpack_layer, pipe, tmp_path / "l", digest=sha(blob), diff_id=sha(tar))
    )
    for i in range(0, len(blob), 10_000):
        assert await pipe.put(blob[i : i + 10_000])
    pipe.close()
    res = await consumer
    assert res.tar_size == len(tar)
    assert (tmp_path / "l/big").stat().st_size == 3_000_000


async def test_blob_pipe_propagates_producer_errors(tmp_path: Path) -> None:
    blob = gzip.compress(make_tar([E("big", data=os.urandom(100_000))]))
    pipe = BlobPipe()
    consumer = asyncio.ensure_future(asyncio.to_thread(unpack_layer, pipe, tmp_path / "l"))
    await pipe.put(blob[:1000])
    pipe.close(ConnectionError("network gone"))
    with pytest.raises(ConnectionError):
        await consumer


async def test_blob_pipe_put_fails_after_consumer_abort() -> None:
    pipe = BlobPipe(max_chunks=1)
    assert await pipe.put(b"a")
    pipe.abort()
    assert not await pipe.put(b"b")


async def test_many_pipes_at_once_do_not_starve(tmp_path: Path) -> None:
    """More concurrent layer streams than the default executor has workers."""
    tars = [make_tar([E(f"f{i}", data=os.urandom(400_000))]) for i in range(12)]
    blobs = [gzip.compress(t) for t in tars]
    pipes = [BlobPipe(max_chunks=2) for _ in blobs]
    futures = [
        run_in_thread(functools.partial(unpack_layer, p, tmp_path / f"l{i}", diff_id=sha(tars[i])))
        for i, p in enumerate(pipes)
    ]

    async def produce(pipe: BlobPipe, blob: bytes) -> None:
        for j in range(0, len(blob), 8192):
            assert await pipe.put(blob[j : j + 8192])
        pipe.close()

    await asyncio.wait_for(
        asyncio.gather(*(produce(p, b) for p, b in zip(pipes, blobs, strict=True))), 60
    )
    results = await asyncio.wait_for(asyncio.gather(*futures), 60)
    assert [r.diff_id for r in results] == [sha(t) for t in tars]
