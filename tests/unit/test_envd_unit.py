"""envd building blocks tested in-process (no server)."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from aenv.envd import files, httpserver, rpc, state
from aenv.envd.__main__ import parse_args
from aenv.envd.filesystem import entry_size, go_perm_string
from aenv.envd.inotify import IN_ATTRIB, IN_CREATE, IN_DELETE, IN_MODIFY, IN_MOVED_FROM, event_type
from aenv.envd.server import _parse_ts


def test_users_parse(tmp_path: Path) -> None:
    pw = tmp_path / "passwd"
    gr = tmp_path / "group"
    pw.write_text(
        "root:x:0:0:root:/root:/bin/bash\n"
        "# comment\n"
        "user:x:1000:1000::/home/user:/bin/sh\n"
        "broken:line\n"
    )
    gr.write_text("root:x:0:\nuser:x:1000:\nsudo:x:27:user,other\ndocker:x:999:user\n")
    users = state.Users(str(pw), str(gr))
    u = users.get("user")
    assert u is not None
    assert (u.uid, u.gid, u.home, u.shell) == (1000, 1000, "/home/user", "/bin/sh")
    assert u.groups == (1000, 27, 999)
    assert users.get("broken") is None and users.get("nobody") is None
    assert users.uid_name(1000) == "user" and users.uid_name(4242) == "4242"
    assert users.gid_name(27) == "sudo"
    # reloads when the file changes
    pw.write_text(pw.read_text() + "late:x:1001:1001::/home/late:/bin/sh\n")
    assert users.get("late") is not None


def test_users_without_etc(tmp_path: Path) -> None:
    users = state.Users(str(tmp_path / "none"), str(tmp_path / "none2"))
    root = users.get("root")
    assert root is not None and root.uid == 0 and root.home == "/root"


def test_resolve_path() -> None:
    u = state.User("u", 1, 1, "/home/u", "/bin/sh")
    assert state.resolve_path("a/b.txt", u) == "/home/u/a/b.txt"
    assert state.resolve_path("~/x", u) == "/home/u/x"
    assert state.resolve_path("~", u) == "/home/u"
    assert state.resolve_path("/tmp/../etc//x/", u) == "/etc/x"
    assert state.resolve_path("//x", u) == "/x"


def test_state_env_and_launcher_vars() -> None:
    st = state.State.from_environ(
        {
            "PATH": "/opt/bin:/usr/bin",
            "LANG": "C.UTF-8",
            "AENV_ENVD_ACCESS_TOKEN": "secret",
            "AENV_ENVD_DEFAULT_USER": "root",
            "PYTHONHOME": "/opt/aenv",
            "PYTHONPATH": "/opt/aenv/app",
            "PYTHONUNBUFFERED": "1",
            "LD_LIBRARY_PATH": "/usr/lib/cuda",
            "HOME": "/root",
        }
    )
    assert st.access_token == "secret" and st.default_user == "root"
    assert set(st.base_env) == {"PATH", "LANG", "LD_LIBRARY_PATH", "HOME"}
    st.env_vars = {"A": "1", "LANG": "en"}
    u = state.User("u", 5, 5, "/home/u", "")
    env = st.process_env(u, {"A": "2"})
    assert env["A"] == "2" and env["LANG"] == "en" and env["PATH"] == "/opt/bin:/usr/bin"
    assert (env["HOME"], env["USER"], env["LOGNAME"], env["SHELL"]) == (
        "/home/u",
        "u",
        "u",
        "/bin/sh",
    )
    assert state.State().process_env(u, {})["PATH"] == state.DEFAULT_PATH


def test_launcher_env_matches_bundle() -> None:
    bundle = pytest.importorskip("aenv.runtime.bundle")
    assert set(state.LAUNCHER_ENV) == set(bundle.ENVD_ONLY_ENV)


def test_perm_string() -> None:
    assert go_perm_string(stat.S_IFREG | 0o644) == "-rw-r--r--"
    assert go_perm_string(stat.S_IFDIR | 0o755) == "drwxr-xr-x"
    assert go_perm_string(stat.S_IFLNK | 0o777) == "Lrwxrwxrwx"
    assert go_perm_string(stat.S_IFDIR | stat.S_ISVTX | 0o777) == "dtrwxrwxrwx"


def _stat(mode: int, size: int, blksize: int) -> os.stat_result:
    # st_blksize is an attribute past the ten indexable fields: build it the long way.
    return os.stat_result((mode, 1, 1, 1, 0, 0, size, 0, 0, 0), {"st_blksize": blksize})


def test_entry_size_of_directories() -> None:
    """A directory reports whole blocks, at least one, whatever its filesystem says (btrfs:
    0 when empty; ext4: 4096), as E2B's `test_get_info_of_directory` expects; files as they
    are."""
    assert entry_size(_stat(stat.S_IFDIR | 0o755, 0, 4096)) == 4096  # btrfs, empty
    assert entry_size(_stat(stat.S_IFDIR | 0o755, 38, 4096)) == 4096  # btrfs, a few names
    assert entry_size(_stat(stat.S_IFDIR | 0o755, 4096, 4096)) == 4096  # ext4
    assert entry_size(_stat(stat.S_IFDIR | 0o755, 12288, 4096)) == 12288
    assert entry_size(_stat(stat.S_IFDIR | 0o755, 0, 0)) == 4096  # no block size given
    assert entry_size(_stat(stat.S_IFREG | 0o644, 0, 4096)) == 0
    assert entry_size(_stat(stat.S_IFREG | 0o644, 5, 4096)) == 5


def test_timestamp_and_parse() -> None:
    assert rpc.timestamp(0) == "1970-01-01T00:00:00Z"
    assert rpc.timestamp(1700000000, 5_000_000) == "2023-11-14T22:13:20.005Z"
    assert rpc.timestamp(1.5) == "1970-01-01T00:00:01.500Z"
    assert rpc.timestamp(1, 123400) == "1970-01-01T00:00:01.000123400Z"
    assert rpc.timestamp(1, 120000) == "1970-01-01T00:00:01.000120Z"
    assert _parse_ts("2023-11-14T22:13:20.005123456Z") == pytest.approx(1700000000.005123)
    assert _parse_ts("garbage") is None and _parse_ts(None) is None and _parse_ts(12) == 12.0


def test_b64_and_fields() -> None:
    assert rpc.b64d(rpc.b64e(b"\xff\x00x")) == b"\xff\x00x"
    assert rpc.b64d("_w") == b"\xff"  # url-safe, unpadded input accepted
    assert rpc.field({"watcher_id": "a"}, "watcherId", "watcher_id") == "a"
    assert rpc.as_int("12", "pid") == 12
    with pytest.raises(rpc.RPCError):
        rpc.as_int("x", "pid")


def test_inotify_mapping() -> None:
    assert event_type(IN_CREATE) == "EVENT_TYPE_CREATE"
    assert event_type(IN_MODIFY) == "EVENT_TYPE_WRITE"
    assert event_type(IN_DELETE) == "EVENT_TYPE_REMOVE"
    assert event_type(IN_MOVED_FROM) == "EVENT_TYPE_RENAME"
    assert event_type(IN_ATTRIB) == "EVENT_TYPE_CHMOD"


def test_signature_matches_sdk() -> None:
    sdk_sig = pytest.importorskip("e2b.sandbox.signature")
    for user in (None, "root"):
        for exp in (None, 60):
            got = sdk_sig.get_signature("/a b/ü.txt", "read", user, "tok", exp)
            ours = files.file_signature(
                "/a b/ü.txt",
                "read",
                user or "",
                "tok",
                str(got["expiration"]) if got["expiration"] else None,
            )
            assert ours == got["signature"]


def test_query_parsing() -> None:
    assert httpserver.parse_query("path=%2Ftmp%2Fa+b.txt&x=1&x=2&flag") == {
        "path": "/tmp/a b.txt",
        "x": "1",
        "flag": "",
    }
    assert httpserver.unquote("%E2%9C%93%zz%4") == "✓%zz%4"


def test_form_filename_unescape() -> None:
    _, fn = files._part_filename(
        {"content-disposition": 'form-data; name="file"; filename="/tmp/q%22x\\\\y%0A.txt"'}
    )
    assert fn == '/tmp/q"x\\y\n.txt'
    name, fn = files._part_filename({"content-disposition": "form-data; name=file"})
    assert name == "file" and fn is None


class _FakeSource:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)

    async def read(self) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_multipart_parser_split_reads(step: int) -> None:
    body = (
        b"preamble\r\n--XyZ\r\n"
        b'Content-Disposition: form-data; name="file"; filename="a.txt"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\n"
        b"line1\r\n--XyZ-not-a-boundary\r\nend"
        b"\r\n--XyZ\r\n"
        b'Content-Disposition: form-data; name="other"\r\n\r\n'
        b"ignored"
        b"\r\n--XyZ\r\n"
        b'Content-Disposition: form-data; name="file"; filename="b.txt"\r\n\r\n'
        b"\r\n--XyZ--\r\n"
    )
    chunks = [body[i : i + step] for i in range(0, len(body), step)]
    parts: list[tuple[dict[str, str], bytearray]] = []

    async def on_part(headers: dict[str, str]) -> None:
        parts.append((headers, bytearray()))

    def on_data(data: bytes) -> None:
        parts[-1][1].extend(data)

    def on_end() -> None:
        pass

    src: Any = _FakeSource(chunks)
    asyncio.run(files._multipart(src, "XyZ", on_part, on_data, on_end))
    assert [bytes(p[1]) for p in parts] == [
        b"line1\r\n--XyZ-not-a-boundary\r\nend",
        b"ignored",
        b"",
    ]
    assert files._part_filename(parts[2][0]) == ("file", "b.txt")


def test_multipart_truncated() -> None:
    async def on_part(headers: dict[str, str]) -> None:
        pass

    src: Any = _FakeSource([b"--b\r\nContent-Disposition: form-data\r\n\r\nabc"])
    with pytest.raises(httpserver.HTTPError):
        asyncio.run(files._multipart(src, "b", on_part, lambda d: None, lambda: None))


def test_chunked_body_reader() -> None:
    async def go() -> bytes:
        reader = asyncio.StreamReader()
        reader.feed_data(b"5;ext=1\r\nhello\r\n0A\r\n0123456789\r\n0\r\nTrailer: x\r\n\r\nNEXT")
        reader.feed_eof()
        no_writer: Any = None  # the body reader never writes
        conn = httpserver.Conn(reader, no_writer)
        body = httpserver.Body(conn, None, True)
        data = await body.read_all(1000)
        assert body.done and bytes(conn.buf) == b"NEXT"
        return data

    assert asyncio.run(go()) == b"hello0123456789"


def test_parse_args(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AENV_ENVD_PORT", raising=False)
    monkeypatch.delenv("AENV_ENVD_HOST", raising=False)
    assert parse_args([]) == ("0.0.0.0", 49983)
    assert parse_args(["--port", "1234", "--host=127.0.0.1"]) == ("127.0.0.1", 1234)
    monkeypatch.setenv("AENV_ENVD_PORT", "7")
    assert parse_args([]) == ("0.0.0.0", 7)
    with pytest.raises(SystemExit):
        parse_args(["--bogus"])
