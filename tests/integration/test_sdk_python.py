"""The stock E2B Python SDK against a real server with real gVisor sandboxes."""

from __future__ import annotations

import os
import threading
import time

import pytest
from e2b import CommandExitException, NotFoundException, Sandbox, SandboxQuery
from e2b.exceptions import SandboxException

from .helpers import assert_kill_ends_streams

pytestmark = pytest.mark.integration


@pytest.fixture
def sbx(sandboxes: list[object]) -> Sandbox:
    s = Sandbox.create(
        template="base",
        timeout=120,
        metadata={"suite": "sdk", "who": "pytest"},
        envs={"GREETING": "hi"},
    )
    sandboxes.append(s)
    return s


def test_create_info_and_list(sbx: Sandbox) -> None:
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id
    assert info.template_id
    assert info.metadata == {"suite": "sdk", "who": "pytest"}
    assert info.state.value == "running"
    listed = Sandbox.list(query=SandboxQuery(metadata={"who": "pytest"})).next_items()
    assert sbx.sandbox_id in [s.sandbox_id for s in listed]
    other = Sandbox.list(query=SandboxQuery(metadata={"who": "nobody"})).next_items()
    assert sbx.sandbox_id not in [s.sandbox_id for s in other]


def test_commands(sbx: Sandbox) -> None:
    r = sbx.commands.run("echo out; echo err >&2")
    assert r.stdout == "out\n" and r.stderr == "err\n" and r.exit_code == 0
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("echo bad >&2; exit 3")
    assert ei.value.exit_code == 3 and "bad" in ei.value.stderr
    # create-time envs, per-command envs, cwd
    assert sbx.commands.run("echo $GREETING-$X", envs={"X": "y"}).stdout == "hi-y\n"
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    # default user and root
    assert sbx.commands.run("whoami").stdout.strip() == "user"
    assert sbx.commands.run("pwd").stdout.strip() == "/home/user"
    assert sbx.commands.run("whoami", user="root").stdout.strip() == "root"
    assert sbx.commands.run("sudo -n whoami").stdout.strip() == "root"


def test_streaming_callbacks_in_order(sbx: Sandbox) -> None:
    seen: list[str] = []
    sbx.commands.run(
        "for i in 1 2 3 4 5; do echo line$i; sleep 0.05; done", on_stdout=lambda s: seen.append(s)
    )
    assert "".join(seen) == "".join(f"line{i}\n" for i in range(1, 6))


def test_background_stdin_and_kill(sbx: Sandbox) -> None:
    h = sbx.commands.run("cat; echo done", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "hello stdin\n")
    assert h.pid in [p.pid for p in sbx.commands.list()]
    sbx.commands.close_stdin(h.pid)
    assert h.wait().stdout == "hello stdin\ndone\n"
    sleeper = sbx.commands.run("sleep 600", background=True)
    assert sbx.commands.kill(sleeper.pid)
    with pytest.raises(CommandExitException):
        sleeper.wait()
    assert sleeper.pid not in [p.pid for p in sbx.commands.list()]
    assert not sbx.commands.kill(sleeper.pid)


def test_files(sbx: Sandbox) -> None:
    sbx.files.write("notes/a.txt", "hello files")
    assert sbx.files.read("notes/a.txt") == "hello files"
    assert sbx.files.read("/home/user/notes/a.txt") == "hello files"
    blob = os.urandom(1024 * 1024)
    sbx.files.write("/tmp/blob.bin", blob)
    assert bytes(sbx.files.read("/tmp/blob.bin", format="bytes")) == blob
    assert sbx.commands.run("stat -c %s /tmp/blob.bin").stdout.strip() == str(len(blob))
    names = [e.name for e in sbx.files.list("notes")]
    assert names == ["a.txt"]
    assert sbx.files.exists("notes/a.txt") and not sbx.files.exists("notes/missing")
    sbx.files.rename("notes/a.txt", "notes/b.txt")
    assert not sbx.files.exists("notes/a.txt") and sbx.files.read("notes/b.txt") == "hello files"
    assert sbx.files.make_dir("deep/er/dir")
    assert sbx.files.get_info("deep/er/dir").type is not None
    sbx.files.remove("notes")
    assert not sbx.files.exists("notes")
    # files written through the API are the default user's
    sbx.files.write("owned.txt", "x")
    assert sbx.commands.run("stat -c %U owned.txt").stdout.strip() == "user"


def test_pty(sbx: Sandbox) -> None:
    from e2b.sandbox.commands.command_handle import PtySize

    out: list[bytes] = []
    got = threading.Event()

    def on_pty(b: bytes) -> None:
        out.append(b)
        if b"24 80" in b"".join(out):
            got.set()

    h = sbx.pty.create(PtySize(rows=24, cols=80))
    waiter = threading.Thread(target=lambda: h.wait(on_pty=on_pty), daemon=True)
    waiter.start()
    sbx.pty.send_stdin(h.pid, b"echo pty-marker-$((40+2)); tty; stty size\n")
    assert got.wait(15), b"".join(out)
    sbx.pty.resize(h.pid, PtySize(rows=30, cols=100))
    sbx.pty.send_stdin(h.pid, b"stty size; exit\n")
    waiter.join(15)
    text = b"".join(out).decode(errors="replace")
    assert "/dev/pts/" in text and "24 80" in text and "30 100" in text


def test_timeout_kill_and_not_found(sandboxes: list[object]) -> None:
    s = Sandbox.create(template="base", timeout=60)
    sandboxes.append(s)
    s.set_timeout(300)
    end = s.get_info().end_at
    assert end.timestamp() - time.time() > 200
    assert s.kill()
    with pytest.raises(NotFoundException):
        s.get_info()
    assert Sandbox.kill(s.sandbox_id) is False
    with pytest.raises(NotFoundException):
        Sandbox.get_info("inotexisting0000000")
    with pytest.raises((NotFoundException, SandboxException)):
        Sandbox.connect("inotexisting0000000")


def test_kill_ends_open_streams_and_is_running(sandboxes: list[object]) -> None:
    """As on E2B: a kill ends a running command's and a PTY's streams (not a hang until the
    command would have ended) with the SDK's "killed" error, and `is_running()` says False."""
    s = Sandbox.create(template="base", timeout=120)
    sandboxes.append(s)
    assert s.is_running()
    assert_kill_ends_streams(s, s.kill)


def test_signed_file_urls_without_a_domain(sandboxes: list[object]) -> None:
    """`download_url`/`upload_url` of a secured sandbox, made against the node's address (no
    sandbox in the URL), reach that sandbox by their signature; an expired one is a 401."""
    import json
    import urllib.error
    import urllib.request

    s = Sandbox.create(template="base", timeout=120, secure=True)
    sandboxes.append(s)
    s.files.write("signed.txt", "signed content")
    with urllib.request.urlopen(s.download_url("signed.txt", "user", 60)) as resp:
        assert resp.read() == b"signed content"
    req = urllib.request.Request(
        s.upload_url("up.txt", "user"),
        data=b"uploaded",
        headers={"content-type": "application/octet-stream"},
        method="POST",
    )
    with urllib.request.urlopen(req) as resp:
        assert resp.status == 200
    assert s.files.read("up.txt") == "uploaded"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(s.download_url("signed.txt", "user", use_signature_expiration=-60))
    assert refused.value.code == 401
    assert json.loads(refused.value.read()) == {
        "code": 401,
        "message": "signature is already expired",
    }


def test_ttl_expiry_kills(sandboxes: list[object]) -> None:
    s = Sandbox.create(template="base", timeout=2)
    sandboxes.append(s)
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            s.get_info()
        except NotFoundException:
            return
        time.sleep(0.5)
    pytest.fail("sandbox outlived its timeout")
