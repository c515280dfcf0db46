"""envd over raw HTTP (httpx): Connect-RPC wire format, /files, /init, auth."""

from __future__ import annotations

import base64
import gzip
import json
import os
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="envd tests run as root")

STREAM = {"content-type": "application/connect+json", "connect-protocol-version": "1"}
UNARY = {"content-type": "application/json", "connect-protocol-version": "1"}


def envelope(msg: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(msg).encode()
    return struct.pack(">BI", flags, len(data)) + data


def parse_envelopes(data: bytes) -> list[tuple[int, dict[str, Any]]]:
    out = []
    while data:
        flags, n = struct.unpack(">BI", data[:5])
        out.append((flags, json.loads(data[5 : 5 + n])))
        data = data[5 + n :]
    return out


def basic(user: str) -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}


class Stream:
    """Incremental reader of a Connect server stream."""

    def __init__(self, resp: httpx.Response) -> None:
        self.resp = resp
        self.it = resp.iter_raw()
        self.buf = b""

    def next(self) -> tuple[int, dict[str, Any]]:
        while True:
            if len(self.buf) >= 5:
                flags, n = struct.unpack(">BI", self.buf[:5])
                if len(self.buf) >= 5 + n:
                    msg = json.loads(self.buf[5 : 5 + n])
                    self.buf = self.buf[5 + n :]
                    return flags, msg
            self.buf += next(self.it)

    def events(self) -> Iterator[dict[str, Any]]:
        while True:
            flags, msg = self.next()
            if flags & 2:
                if msg:
                    yield {"_eos": msg}
                return
            yield msg


@pytest.fixture(scope="module")
def url(envd_launcher: Callable[..., str]) -> str:
    return envd_launcher()


@pytest.fixture()
def client(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=20) as c:
        yield c


def rpc(client: httpx.Client, method: str, msg: dict[str, Any], **headers: str) -> httpx.Response:
    return client.post("/" + method, json=msg, headers={**UNARY, **headers})


def run(
    client: httpx.Client, msg: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Start a process, collect the whole stream: (events, end-of-stream message)."""
    r = client.post(
        "/process.Process/Start", content=envelope(msg), headers={**STREAM, **(headers or {})}
    )
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/connect+json"
    msgs = parse_envelopes(r.content)
    assert msgs[-1][0] == 2
    return [m["event"] for _, m in msgs[:-1]], msgs[-1][1]


def output(events: list[dict[str, Any]], kind: str) -> bytes:
    return b"".join(
        base64.b64decode(e["data"][kind]) for e in events if "data" in e and kind in e["data"]
    )


def bash(cmd: str, tag: str | None = None, **extra: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {
        "process": {"cmd": "/bin/bash", "args": ["-c", cmd], **extra},
        "stdin": False,
    }
    if tag is not None:
        msg["tag"] = tag
    return msg


# ---- basic endpoints ----------------------------------------------------------


def test_health_and_unknown_route(client: httpx.Client) -> None:
    r = client.get("/health")
    assert r.status_code == 204 and r.content == b""
    r = client.get("/nope")
    assert r.status_code == 404
    assert r.json()["code"] == 404


def test_metrics(client: httpx.Client) -> None:
    m = client.get("/metrics").json()
    for key in (
        "ts",
        "cpu_count",
        "cpu_used_pct",
        "mem_total",
        "mem_used",
        "mem_cache",
        "mem_total_mib",
        "mem_used_mib",
        "disk_used",
        "disk_total",
    ):
        assert key in m
    assert m["cpu_count"] >= 1 and m["mem_total"] > m["mem_used"] > 0
    assert m["disk_total"] >= m["disk_used"] >= 0
    assert abs(m["ts"] - time.time()) < 5


def test_logs_journal_processes_and_their_exit(client: httpx.Client) -> None:
    before = client.get("/logs").json()["seq"]
    events, _ = run(client, bash("exit 4", tag="journal-test"))
    pid = events[0]["start"]["pid"]
    body = client.get("/logs", params={"after": before}).json()
    mine = [e for e in body["entries"] if e["fields"].get("pid") == str(pid)]
    assert [e["message"] for e in mine] == ["process started", "process ended"]
    started, ended = mine
    assert started["fields"]["cmd"] == "/bin/bash" and started["fields"]["tag"] == "journal-test"
    assert ended["fields"]["exitCode"] == "4" and ended["level"] == "warn"
    assert body["seq"] >= ended["seq"] > started["seq"] > before
    assert client.get("/logs", params={"after": body["seq"]}).json()["entries"] == []
    assert client.get("/logs", params={"after": "x"}).status_code == 400


# ---- process.Process -----------------------------------------------------------


def test_start_stdout_stderr_exit(client: httpx.Client) -> None:
    events, eos = run(client, bash("echo out; echo err >&2; exit 3"))
    assert eos == {}
    assert "pid" in events[0]["start"] and events[0]["start"]["pid"] > 0
    assert output(events, "stdout") == b"out\n"
    assert output(events, "stderr") == b"err\n"
    assert events[-1]["end"] == {
        "exitCode": 3,
        "exited": True,
        "status": "exit status 3",
        "error": "exit status 3",
    }


def test_start_success_and_ordering(client: httpx.Client) -> None:
    events, _ = run(client, bash("for i in $(seq 1 3000); do echo line$i; done"))
    text = output(events, "stdout").decode()
    assert text == "".join(f"line{i}\n" for i in range(1, 3001))
    assert events[-1]["end"]["exitCode"] == 0
    assert "error" not in events[-1]["end"]


def test_large_output_with_slow_reader(client: httpx.Client) -> None:
    # ~24 MiB of output: more than the per-subscriber high-water mark, so reading
    # pauses while the client is not consuming, and resumes without loss.
    cmd = "head -c 18000000 /dev/zero | tr '\\0' 'a'; echo; echo tail"
    with client.stream(
        "POST", "/process.Process/Start", content=envelope(bash(cmd)), headers=STREAM
    ) as resp:
        ev = Stream(resp).events()
        next(ev)
        # The stall is the case: a client that reads nothing for a while (the process writes
        # meanwhile, past the high-water mark; no event marks "not read for a while").
        time.sleep(1.0)
        total = 0
        tail = b""
        end = None
        for m in ev:
            e = m["event"]
            if "data" in e:
                chunk = base64.b64decode(e["data"]["stdout"])
                total += len(chunk)
                tail = (tail + chunk)[-16:]
            elif "end" in e:
                end = e["end"]
    assert total == 18000000 + len("\ntail\n")
    assert tail.endswith(b"a\ntail\n") and end is not None and end["exitCode"] == 0


def test_env_cwd_and_defaults(client: httpx.Client, tmp_path: Path) -> None:
    events, _ = run(
        client,
        bash('echo "$FOO|$PWD|$HOME|$USER|$LOGNAME"', envs={"FOO": "bar"}, cwd=str(tmp_path)),
    )
    assert output(events, "stdout").decode().strip() == f"bar|{tmp_path}|/root|root|root"
    # stdin false -> /dev/null
    events, _ = run(client, bash("cat; echo done"))
    assert output(events, "stdout") == b"done\n"


def test_start_errors(client: httpx.Client) -> None:
    events, eos = run(client, bash("true", cwd="/does/not/exist"))
    assert events == [] and eos["error"]["code"] == "invalid_argument"
    events, eos = run(client, {"process": {"cmd": "/no/such/binary"}})
    assert eos["error"]["code"] == "invalid_argument"
    events, eos = run(client, bash("true"), basic("no-such-user"))
    assert eos["error"]["code"] == "unauthenticated"


@pytest.mark.parametrize(
    "envs, needle",
    [
        ({"A=B": "x"}, "'='"),
        ({"": "x"}, "empty"),
        ({"A\0B": "x"}, "NUL"),
        ({"A": "x\0y"}, "NUL"),
        ({"BIG": "x" * (64 << 10)}, "bytes"),
    ],
)
def test_start_refuses_envs_no_process_could_have(
    client: httpx.Client, envs: dict[str, str], needle: str
) -> None:
    events, eos = run(client, bash("echo ran", envs=envs))
    assert events == []
    assert eos["error"]["code"] == "invalid_argument" and needle in eos["error"]["message"]
    # The next command is unaffected.
    events, _ = run(client, bash("echo fine"))
    assert output(events, "stdout") == b"fine\n"


def test_start_nul_in_args_and_huge_args_are_invalid_argument(client: httpx.Client) -> None:
    _, eos = run(client, bash("echo a\0b"))
    assert eos["error"]["code"] == "invalid_argument"
    # Past the kernel's per-string bound (128 KiB): E2BIG from execve.
    _, eos = run(client, bash("true", args=["-c", "true", "x" * (200 << 10)]))
    assert eos["error"]["code"] == "invalid_argument"


def test_run_as_other_user(client: httpx.Client) -> None:
    events, _ = run(client, bash("id -u; echo $HOME; pwd"), basic("nobody"))
    uid, home, cwd = output(events, "stdout").decode().split("\n")[:3]
    assert uid == "65534"
    assert home == "/nonexistent" and cwd == "/"  # home does not exist -> /


def test_signal_kill_and_connect(client: httpx.Client) -> None:
    with client.stream(
        "POST",
        "/process.Process/Start",
        content=envelope(bash("echo ready; sleep 30", tag="sleeper")),
        headers=STREAM,
    ) as resp:
        s = Stream(resp)
        ev = s.events()
        pid = next(ev)["event"]["start"]["pid"]
        assert base64.b64decode(next(ev)["event"]["data"]["stdout"]) == b"ready\n"

        procs = rpc(client, "process.Process/List", {}).json()["processes"]
        mine = [p for p in procs if p["pid"] == pid]
        assert mine and mine[0]["tag"] == "sleeper"
        assert mine[0]["config"]["cmd"] == "/bin/bash"

        # a second consumer attaches by tag
        with client.stream(
            "POST",
            "/process.Process/Connect",
            content=envelope({"process": {"tag": "sleeper"}}),
            headers=STREAM,
        ) as resp2:
            s2 = Stream(resp2)
            ev2 = s2.events()
            assert next(ev2)["event"]["start"]["pid"] == pid
            r = rpc(
                client,
                "process.Process/SendSignal",
                {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"},
            )
            assert r.status_code == 200 and r.json() == {}
            end2 = [e for e in ev2 if "event" in e and "end" in e["event"]]
        end = [e for e in ev if "event" in e and "end" in e["event"]]
    for e in (end, end2):
        assert e[0]["event"]["end"] == {
            "exitCode": -1,
            "exited": False,
            "status": "signal: killed",
            "error": "signal: killed",
        }
    r = rpc(client, "process.Process/SendSignal", {"process": {"pid": pid}, "signal": 9})
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = client.post(
        "/process.Process/Connect", content=envelope({"process": {"pid": pid}}), headers=STREAM
    )
    assert parse_envelopes(r.content) == [
        (2, {"error": {"code": "not_found", "message": f"process with pid {pid} not found"}})
    ]


def test_stdin_send_and_close(client: httpx.Client) -> None:
    msg = {"process": {"cmd": "/bin/cat"}, "stdin": True}
    with client.stream(
        "POST", "/process.Process/Start", content=envelope(msg), headers=STREAM
    ) as resp:
        ev = Stream(resp).events()
        pid = next(ev)["event"]["start"]["pid"]
        for chunk in (b"hello ", b"world\n"):
            r = rpc(
                client,
                "process.Process/SendInput",
                {"process": {"pid": pid}, "input": {"stdin": base64.b64encode(chunk).decode()}},
            )
            assert r.status_code == 200
        r = rpc(client, "process.Process/CloseStdin", {"process": {"pid": pid}})
        assert r.status_code == 200
        events = [e["event"] for e in ev]
    assert output(events, "stdout") == b"hello world\n"
    assert events[-1]["end"]["exitCode"] == 0


def test_stdin_absent_means_pipe_and_stream_input(client: httpx.Client) -> None:
    # StartRequest without "stdin" keeps a stdin pipe (envd compatibility)
    with client.stream(
        "POST",
        "/process.Process/Start",
        content=envelope({"process": {"cmd": "/bin/cat"}}),
        headers=STREAM,
    ) as resp:
        ev = Stream(resp).events()
        pid = next(ev)["event"]["start"]["pid"]

        def body() -> Iterator[bytes]:
            yield envelope({"start": {"process": {"pid": pid}}})
            yield envelope({"keepalive": {}})
            for part in (b"a", b"b", b"c\n"):
                yield envelope({"data": {"input": {"stdin": base64.b64encode(part).decode()}}})

        r = client.post("/process.Process/StreamInput", content=body(), headers=STREAM)
        assert parse_envelopes(r.content) == [(0, {}), (2, {})]
        rpc(client, "process.Process/CloseStdin", {"process": {"pid": pid}})
        events = [e["event"] for e in ev]
    assert output(events, "stdout") == b"abc\n"


def test_deadline_kills_process(client: httpx.Client) -> None:
    events, eos = run(
        client, bash("echo x; sleep 20", tag="deadline"), {"connect-timeout-ms": "500"}
    )
    assert eos["error"]["code"] == "deadline_exceeded"

    def tagged() -> list[dict[str, Any]]:
        procs = rpc(client, "process.Process/List", {}).json()["processes"]
        return [p for p in procs if p.get("tag") == "deadline"]

    wait_until(lambda: not tagged(), 10, 0.05, "the process past its deadline to be gone")
    # unary deadline
    r = client.post(
        "/process.Process/List", json={}, headers={**UNARY, "connect-timeout-ms": "5000"}
    )
    assert r.status_code == 200


def test_keepalive(client: httpx.Client) -> None:
    events, _ = run(client, bash("sleep 1.3; echo done"), {"keepalive-ping-interval": "0.4"})
    assert sum(1 for e in events if "keepalive" in e) >= 2
    assert output(events, "stdout") == b"done\n"


def test_pty_session(client: httpx.Client) -> None:
    msg = {
        "process": {"cmd": "/bin/bash", "args": ["-i"], "envs": {"TERM": "xterm-256color"}},
        "pty": {"size": {"cols": 100, "rows": 30}},
    }
    with client.stream(
        "POST", "/process.Process/Start", content=envelope(msg), headers=STREAM
    ) as resp:
        ev = Stream(resp).events()
        pid = next(ev)["event"]["start"]["pid"]
        r = rpc(
            client,
            "process.Process/Update",
            {"process": {"pid": pid}, "pty": {"size": {"cols": 120, "rows": 40}}},
        )
        assert r.status_code == 200
        line = b"stty size; tty; echo $TERM; exit 7\n"
        r = rpc(
            client,
            "process.Process/SendInput",
            {"process": {"pid": pid}, "input": {"pty": base64.b64encode(line).decode()}},
        )
        assert r.status_code == 200
        events = [e["event"] for e in ev]
    out = output(events, "pty")
    assert b"40 120" in out
    assert b"/dev/pts/" in out
    assert b"xterm-256color" in out
    assert events[-1]["end"]["exitCode"] == 7
    assert output(events, "stdout") == b""


def test_unary_errors(client: httpx.Client) -> None:
    r = rpc(client, "process.Process/Nope", {})
    assert r.status_code == 501 and r.json()["code"] == "unimplemented"
    r = client.post("/process.Process/List", content=b"{bad", headers=UNARY)
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
    r = rpc(client, "process.Process/SendInput", {"process": {"tag": "none"}, "input": {}})
    assert r.status_code == 404 and r.json()["code"] == "not_found"


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


# ---- auth and /init -------------------------------------------------------------


def sign(path: str, op: str, user: str, token: str, exp: int | None = None) -> str:
    import hashlib

    raw = f"{path}:{op}:{user}:{token}" + (f":{exp}" if exp is not None else "")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()


def test_init_token_and_auth(envd_launcher: Callable[..., str], tmp_path: Path) -> None:
    url = envd_launcher({"AENV_ENVD_DEFAULT_USER": "nobody"})
    with httpx.Client(base_url=url, timeout=20) as c:
        # open until a token is set
        assert c.get("/envs").json() == {}
        r = c.post(
            "/init", json={"accessToken": "t1", "envVars": {"A": "1"}, "defaultUser": "root"}
        )
        assert r.status_code == 204
        assert c.get("/health").status_code == 204
        r = c.get("/envs")
        assert r.status_code == 401 and r.json()["code"] == 401
        assert c.get("/envs", headers={"x-access-token": "t1"}).json() == {"A": "1"}
        r = rpc(c, "process.Process/List", {})
        assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
        r = c.post("/process.Process/Start", content=envelope(bash("true")), headers=STREAM)
        assert parse_envelopes(r.content)[0][1]["error"]["code"] == "unauthenticated"
        events, _ = run(c, bash("echo $A-$USER", envs={"B": "2"}), {"x-access-token": "t1"})
        assert output(events, "stdout") == b"1-root\n"

        # /init with a wrong token is refused; with the current one it replaces it (fork)
        assert c.post("/init", json={"accessToken": "t2"}).status_code == 401
        r = c.post("/init", json={"accessToken": "t2"}, headers={"x-access-token": "t1"})
        assert r.status_code == 204
        assert rpc(c, "process.Process/List", {}, **{"x-access-token": "t1"}).status_code == 401
        assert rpc(c, "process.Process/List", {}, **{"x-access-token": "t2"}).status_code == 200
        # a stale /init (older timestamp) is ignored
        h = {"x-access-token": "t2"}
        assert (
            c.post(
                "/init", json={"timestamp": "2030-01-01T00:00:00.123456789Z"}, headers=h
            ).status_code
            == 204
        )
        c.post("/init", json={"timestamp": "2029-01-01T00:00:00Z", "accessToken": "t3"}, headers=h)
        assert rpc(c, "process.Process/List", {}, **h).status_code == 200

        # /files: token header or signature
        f = tmp_path / "s.txt"
        f.write_text("signed")
        r = c.get("/files", params={"path": str(f)})
        assert r.status_code == 401
        good = sign(str(f), "read", "", "t2")
        assert c.get("/files", params={"path": str(f), "signature": good}).text == "signed"
        bad = sign(str(f), "write", "", "t2")
        assert c.get("/files", params={"path": str(f), "signature": bad}).status_code == 401
        exp = int(time.time()) + 60
        sig = sign(str(f), "read", "root", "t2", exp)
        r = c.get(
            "/files",
            params={
                "path": str(f),
                "username": "root",
                "signature": sig,
                "signature_expiration": exp,
            },
        )
        assert r.text == "signed"
        old = int(time.time()) - 5
        sig = sign(str(f), "read", "", "t2", old)
        r = c.get("/files", params={"path": str(f), "signature": sig, "signature_expiration": old})
        assert r.status_code == 401 and "expired" in r.json()["message"]
        up = tmp_path / "up.txt"
        r = c.post(
            "/files",
            params={"path": str(up), "signature": sign(str(up), "write", "", "t2")},
            content=b"w",
            headers={"content-type": "application/octet-stream"},
        )
        assert r.status_code == 200 and up.read_text() == "w"


@pytest.mark.parametrize(
    "env_vars", [{"A=B": "x"}, {"": "x"}, {"A": "x\0y"}, {"BIG": "x" * (64 << 10)}]
)
def test_init_refuses_env_vars_that_would_break_every_command(
    envd_launcher: Callable[..., str], env_vars: dict[str, str]
) -> None:
    url = envd_launcher()
    with httpx.Client(base_url=url, timeout=20) as c:
        assert c.post("/init", json={"envVars": {"KEEP": "1"}}).status_code == 204
        r = c.post("/init", json={"envVars": env_vars})
        assert r.status_code == 400 and r.json()["code"] == 400
        # Nothing of the refused /init was applied, and commands still run.
        assert c.get("/envs").json() == {"KEEP": "1"}
        events, _ = run(c, bash("echo $KEEP"))
        assert output(events, "stdout") == b"1\n"


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
