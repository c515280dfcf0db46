"""envd's files over raw HTTP (httpx): filesystem.Filesystem (operations, relative paths and
ownership, watching a directory, streamed and polled), /files (upload, download, a full disk,
owners, paths relative to home, an upload answered early), and paths no system call takes as
client errors.
"""

from __future__ import annotations

import gzip
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import wait_until
from tests.unit.envd_http_wire import STREAM, Stream, bash, basic, envelope, rpc, run

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="envd tests run as root")


@pytest.fixture(scope="module")
def url(envd_launcher: Callable[..., str]) -> str:
    return envd_launcher()


@pytest.fixture()
def client(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=20) as c:
        yield c


# ---- filesystem.Filesystem ------------------------------------------------------


def test_fs_ops(client: httpx.Client, tmp_path: Path) -> None:
    d = tmp_path / "a" / "b"
    r = rpc(client, "filesystem.Filesystem/MakeDir", {"path": str(d)})
    assert r.status_code == 200
    entry = r.json()["entry"]
    assert entry["type"] == "FILE_TYPE_DIRECTORY" and entry["path"] == str(d)
    assert entry["permissions"] == "drwxr-xr-x" and entry["mode"] == 0o755
    assert entry["owner"] == "root" and entry["group"] == "root"
    r = rpc(client, "filesystem.Filesystem/MakeDir", {"path": str(d)})
    assert r.status_code == 409 and r.json()["code"] == "already_exists"

    f = d / "f.txt"
    f.write_text("hello")
    os.chmod(f, 0o640)
    e = rpc(client, "filesystem.Filesystem/Stat", {"path": str(f)}).json()["entry"]
    assert e["name"] == "f.txt" and e["size"] == "5" and e["type"] == "FILE_TYPE_FILE"
    assert e["permissions"] == "-rw-r-----" and e["mode"] == 0o640
    assert e["modifiedTime"].endswith("Z") and e["modifiedTime"].startswith("20")
    (tmp_path / "link").symlink_to(f)
    e = rpc(client, "filesystem.Filesystem/Stat", {"path": str(tmp_path / "link")}).json()["entry"]
    assert e["isSymlink"] is True and e["symlinkTarget"] == str(f)
    assert e["type"] == "FILE_TYPE_FILE"

    r = rpc(client, "filesystem.Filesystem/Stat", {"path": str(tmp_path / "missing")})
    assert r.status_code == 404 and r.json()["code"] == "not_found"

    entries = rpc(
        client, "filesystem.Filesystem/ListDir", {"path": str(tmp_path), "depth": 3}
    ).json()["entries"]
    paths = {e["path"] for e in entries}
    assert paths == {str(tmp_path / "a"), str(d), str(f), str(tmp_path / "link")}
    entries = rpc(client, "filesystem.Filesystem/ListDir", {"path": str(tmp_path)}).json()[
        "entries"
    ]
    assert {e["name"] for e in entries} == {"a", "link"}
    r = rpc(client, "filesystem.Filesystem/ListDir", {"path": str(f)})
    assert r.status_code == 400

    dst = tmp_path / "new" / "g.txt"
    r = rpc(client, "filesystem.Filesystem/Move", {"source": str(f), "destination": str(dst)})
    assert r.status_code == 200 and r.json()["entry"]["path"] == str(dst)
    assert dst.read_text() == "hello" and not f.exists()
    r = rpc(client, "filesystem.Filesystem/Move", {"source": str(f), "destination": str(dst)})
    assert r.status_code == 404

    r = rpc(client, "filesystem.Filesystem/Remove", {"path": str(tmp_path / "a")})
    assert r.status_code == 200 and not (tmp_path / "a").exists()
    r = rpc(client, "filesystem.Filesystem/Remove", {"path": str(tmp_path / "a")})
    assert r.status_code == 200  # missing path: success, like envd's os.RemoveAll


def test_fs_relative_paths_and_ownership(client: httpx.Client) -> None:
    name = f"envd-test-{os.getpid()}-{time.time_ns()}"
    try:
        r = rpc(client, "filesystem.Filesystem/MakeDir", {"path": name})
        assert r.json()["entry"]["path"] == f"/root/{name}"
    finally:
        rpc(client, "filesystem.Filesystem/Remove", {"path": f"/root/{name}"})
    r = rpc(
        client, "filesystem.Filesystem/MakeDir", {"path": "/tmp/" + name + "/x"}, **basic("nobody")
    )
    try:
        e = r.json()["entry"]
        assert e["owner"] == "nobody"
        assert os.stat("/tmp/" + name).st_uid == 65534
    finally:
        rpc(client, "filesystem.Filesystem/Remove", {"path": "/tmp/" + name})


def test_watch_dir_stream(client: httpx.Client, tmp_path: Path) -> None:
    msg = {"path": str(tmp_path), "recursive": True, "includeEntry": True}
    with client.stream(
        "POST",
        "/filesystem.Filesystem/WatchDir",
        content=envelope(msg),
        headers={**STREAM, "keepalive-ping-interval": "1"},
    ) as resp:
        ev = Stream(resp).events()
        assert next(ev) == {"start": {}}
        (tmp_path / "f.txt").write_text("x")
        seen = []
        for m in ev:
            if "filesystem" in m:
                seen.append(m["filesystem"])
            if any(e["type"] == "EVENT_TYPE_WRITE" for e in seen):
                break
        assert seen[0]["name"] == "f.txt" and seen[0]["type"] == "EVENT_TYPE_CREATE"
        assert seen[0]["entry"]["path"] == str(tmp_path / "f.txt")
        names: list[tuple[str, str]] = []

        def until(event: tuple[str, str]) -> None:
            for m in ev:
                if "filesystem" in m:
                    names.append((m["filesystem"]["name"], m["filesystem"]["type"]))
                if event in names:
                    return

        (tmp_path / "sub").mkdir()
        # Its create is reported once the watcher watches the new directory too.
        until(("sub", "EVENT_TYPE_CREATE"))
        assert ("sub", "EVENT_TYPE_CREATE") in names
        (tmp_path / "sub" / "inner.txt").write_text("y")
        until(("sub/inner.txt", "EVENT_TYPE_CREATE"))
        assert ("sub/inner.txt", "EVENT_TYPE_CREATE") in names


def test_watcher_polling(client: httpx.Client, tmp_path: Path) -> None:
    r = rpc(client, "filesystem.Filesystem/CreateWatcher", {"path": str(tmp_path)})
    wid = r.json()["watcherId"]
    (tmp_path / "a").write_text("1")
    (tmp_path / "a").rename(tmp_path / "b")
    os.chmod(tmp_path / "b", 0o600)
    (tmp_path / "b").unlink()
    kinds: list[tuple[str, str]] = []

    def removed() -> bool:
        r = rpc(client, "filesystem.Filesystem/GetWatcherEvents", {"watcherId": wid})
        kinds.extend((e["name"], e["type"]) for e in r.json().get("events", []))
        return ("b", "EVENT_TYPE_REMOVE") in kinds  # the last change: the others came first

    wait_until(removed, 10, 0.02, "the watcher to report the remove")
    for expected in [
        ("a", "EVENT_TYPE_CREATE"),
        ("a", "EVENT_TYPE_WRITE"),
        ("a", "EVENT_TYPE_RENAME"),
        ("b", "EVENT_TYPE_CREATE"),
        ("b", "EVENT_TYPE_CHMOD"),
        ("b", "EVENT_TYPE_REMOVE"),
    ]:
        assert expected in kinds
    again = rpc(client, "filesystem.Filesystem/GetWatcherEvents", {"watcher_id": wid}).json()
    assert again.get("events", []) == []
    assert rpc(client, "filesystem.Filesystem/RemoveWatcher", {"watcherId": wid}).status_code == 200
    r = rpc(client, "filesystem.Filesystem/GetWatcherEvents", {"watcherId": wid})
    assert r.status_code == 404
    r = rpc(client, "filesystem.Filesystem/CreateWatcher", {"path": str(tmp_path / "none")})
    assert r.status_code == 404


# ---- /files ---------------------------------------------------------------------


def test_files_upload_download(client: httpx.Client, tmp_path: Path) -> None:
    p = tmp_path / "d" / "one.txt"
    r = client.post("/files", params={"path": str(p)}, files=[("file", (str(p), b"hello"))])
    assert r.status_code == 200
    assert r.json() == [{"path": str(p), "name": "one.txt", "type": "file"}]
    r = client.get("/files", params={"path": str(p)})
    assert r.status_code == 200 and r.content == b"hello"
    assert r.headers["content-type"] == "application/octet-stream"

    # several parts, destination in each filename (no path query)
    a, b = tmp_path / "m" / 'q"uote.txt', tmp_path / "m" / "b.bin"
    r = client.post(
        "/files", files=[("file", (str(a), b"A" * 10)), ("file", (str(b), bytes(range(256))))]
    )
    assert [x["path"] for x in r.json()] == [str(a), str(b)]
    assert a.read_bytes() == b"A" * 10 and b.read_bytes() == bytes(range(256))

    # raw octet-stream, chunked, gzip-encoded, with metadata
    blob = os.urandom(3 * 1024 * 1024 + 7)
    gz = gzip.compress(blob)

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(gz), 100_000):
            yield gz[i : i + 100_000]

    raw = tmp_path / "raw.bin"
    r = client.post(
        "/files",
        params={"path": str(raw)},
        content=chunks(),
        headers={
            "content-type": "application/octet-stream",
            "content-encoding": "gzip",
            "x-metadata-Owner": "alice",
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()[0]["metadata"] == {"owner": "alice"}
    assert raw.read_bytes() == blob
    e = rpc(client, "filesystem.Filesystem/Stat", {"path": str(raw)}).json()["entry"]
    assert e["metadata"] == {"owner": "alice"}
    r = client.get("/files", params={"path": str(raw)}, headers={"accept-encoding": "gzip"})
    assert r.headers["content-encoding"] == "gzip" and r.content == blob
    # a write's metadata is the file's whole metadata: a later write without any clears it
    for headers, expected in (({"x-metadata-team": "x"}, {"team": "x"}), ({}, None)):
        r = client.post(
            "/files",
            params={"path": str(raw)},
            content=b"again",
            headers={"content-type": "application/octet-stream", **headers},
        )
        assert r.status_code == 200, r.text
        e = rpc(client, "filesystem.Filesystem/Stat", {"path": str(raw)}).json()["entry"]
        assert e.get("metadata") == expected

    r = client.get("/files", params={"path": "/proc/self/status"})
    assert r.status_code == 200 and b"Pid:" in r.content  # st_size 0, real content
    r = client.get("/files", params={"path": str(tmp_path / "nope")})
    assert r.status_code == 404 and r.json()["code"] == 404
    r = client.get("/files", params={"path": str(tmp_path)})
    assert r.status_code == 400
    r = client.post("/files", params={"path": str(tmp_path)}, files=[("file", ("x", b"x"))])
    assert r.status_code == 400
    r = client.get("/files", params={"path": str(p), "username": "ghost"})
    assert r.status_code == 401


def test_files_no_space_is_507(client: httpx.Client, tmp_path: Path) -> None:
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs")
    try:
        r = client.post(
            "/files",
            params={"path": str(mnt / "big.bin")},
            content=b"x" * (1024 * 1024),
            headers={"content-type": "application/octet-stream"},
        )
        assert r.status_code == 507 and r.json()["code"] == 507
    finally:
        subprocess.run(["umount", str(mnt)])


def test_files_owned_by_user(client: httpx.Client, tmp_path: Path) -> None:
    p = tmp_path / "nob" / "f.txt"
    r = client.post(
        "/files",
        params={"path": str(p), "username": "nobody"},
        content=b"x",
        headers={"content-type": "application/octet-stream"},
    )
    assert r.status_code == 200
    assert p.stat().st_uid == 65534 and (tmp_path / "nob").stat().st_uid == 65534


def test_files_relative_to_home(client: httpx.Client) -> None:
    name = f"envd-rel-{os.getpid()}-{time.time_ns()}.txt"
    r = client.post(
        "/files",
        params={"path": name},
        content=b"r",
        headers={"content-type": "application/octet-stream"},
    )
    try:
        assert r.json()[0]["path"] == f"/root/{name}"
    finally:
        os.unlink(f"/root/{name}")


def test_paths_no_system_call_takes_are_client_errors(client: httpx.Client, tmp_path: Path) -> None:
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "file").write_text("f")
    bad = ["/tmp/a\0b", "/tmp/" + "x" * 300, str(tmp_path / "loop"), str(tmp_path / "file/x")]
    for path in bad:
        r = client.get("/files", params={"path": path})
        assert r.status_code == 400 and r.json()["code"] == 400, (path, r.text)
        r = client.post(
            "/files",
            params={"path": path},
            content=b"x",
            headers={"content-type": "application/octet-stream"},
        )
        assert r.status_code == 400 and r.json()["code"] == 400, (path, r.text)
    for path in bad[:2]:
        for method in ("Stat", "ListDir", "MakeDir", "Remove"):
            r = rpc(client, f"filesystem.Filesystem/{method}", {"path": path})
            assert r.json()["code"] == "invalid_argument", (method, path, r.text)
    r = rpc(client, "filesystem.Filesystem/ListDir", {"path": bad[2]})
    assert r.json()["code"] == "invalid_argument"
    _, eos = run(client, bash("pwd", cwd="/tmp/a\0b"))
    assert eos["error"]["code"] == "invalid_argument"
    # A file that fails on its first read is a clean 400, not a stream cut after a 200.
    r = client.get("/files", params={"path": "/proc/self/mem"})
    assert r.status_code == 400 and r.json()["code"] == 400


async def test_an_upload_answered_early_still_gets_its_answer() -> None:
    """envd refuses an upload mid-body (507 on a full disk): it reads the rest before closing,
    so the client, still sending, gets the answer instead of a reset."""
    import asyncio

    from aenv.envd import httpserver

    async def handler(req: httpserver.Request, resp: httpserver.Response) -> None:
        await req.body.read(64 * 1024)
        raise httpserver.HTTPError(507, "not enough disk space available")

    server = await asyncio.start_server(
        lambda r, w: httpserver.serve_connection(r, w, handler), "127.0.0.1", 0
    )
    port = server.sockets[0].getsockname()[1]
    body = b"y" * (32 << 20)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /files?path=/x HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream"
            b"\r\ncontent-length: %d\r\n\r\n" % len(body)
        )
        sent = 0
        while sent < len(body):
            writer.write(body[sent : sent + (1 << 20)])
            await writer.drain()
            sent += 1 << 20
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        assert head.startswith(b"HTTP/1.1 507"), head
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
