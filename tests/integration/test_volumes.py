"""Volumes with the stock E2B SDK: the `Volume` class (create, list, get, content API with
the volume's token, destroy), `volume_mounts` on create, read-only mounts (aenv's
`readOnly`), and the mounts kept across pause tiers, fork and snapshots."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import CommandExitException, Sandbox, Volume

from tests.helpers import wait_until

from .conftest import Server
from .helpers import sandbox_record
from .test_cli import aenv

pytestmark = pytest.mark.integration

# Appends a line a second to a file in the volume, holding it open throughout.
APPENDER = """
import time
with open('/mnt/data/log.txt', 'a', buffering=1) as f:
    n = 0
    while True:
        n += 1
        f.write(f'{n}\\n')
        time.sleep(0.2)
"""


@pytest.fixture
def vol_env(e2b_env: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    # The SDK reaches volume content at E2B_VOLUME_API_URL (default https://api.{domain}):
    # the same listener here.
    monkeypatch.setenv("E2B_VOLUME_API_URL", e2b_env.url)
    yield e2b_env


def _run(s: Sandbox, cmd: str) -> str:
    return s.commands.run(cmd).stdout


def _lines(v: Volume) -> int:
    return len(v.read_file("/log.txt").split())


def test_volume_api_and_mounts(vol_env: Server, sandboxes: list[object]) -> None:
    name = f"it-{secrets.token_hex(4)}"
    with pytest.raises(Exception, match="invalid volume name"):
        Volume.create("no spaces")
    vol = Volume.create(name)
    assert Volume.get_info(vol.volume_id).token == vol.token
    assert name in [v.name for v in Volume.list()]
    vol.write_file("/hello.txt", "from the api")
    vol.make_dir("/sub")

    # Unknown volumes are refused before anything boots.
    with pytest.raises(Exception, match="not found"):
        Sandbox.create(volume_mounts={"/mnt/x": "no-such-volume"})

    a = Sandbox.create(volume_mounts={"/mnt/data": vol}, timeout=180)
    sandboxes.append(a)
    assert _run(a, "cat /mnt/data/hello.txt") == "from the api"
    _run(a, "echo from-a > /mnt/data/sub/a.txt")  # as the template's user
    assert vol.read_file("/sub/a.txt") == "from-a\n"
    assert a.get_info().volume_mounts == [{"name": name, "path": "/mnt/data"}]

    # A second sandbox mounts it read-only (aenv's `readOnly`; the SDK has no such option).
    with vol_env.client() as c:
        resp = c.post(
            "/v2/sandboxes",
            json={
                "templateID": "base",
                "volumeMounts": [{"name": name, "path": "/ro", "readOnly": True}],
            },
        )
        assert resp.status_code == 201, resp.text
    b = Sandbox.connect(resp.json()["sandboxID"])
    sandboxes.append(b)
    assert _run(b, "cat /ro/sub/a.txt") == "from-a\n"
    with pytest.raises(CommandExitException) as err:
        b.commands.run("echo no > /ro/b.txt")
    assert "Read-only file system" in err.value.stderr
    # Writes of one sandbox are seen by the other at once.
    _run(a, "echo 2 > /mnt/data/live.txt")
    assert _run(b, "cat /ro/live.txt") == "2\n"

    # Hibernation (checkpoint/restore) keeps the mount and a process writing to it, also
    # when the file it holds open changed meanwhile.
    a.files.write("/home/user/appender.py", APPENDER)
    a.commands.run("python3 /home/user/appender.py", background=True)
    wait_until(lambda: vol.exists("/log.txt") and _lines(vol) > 2, 10, 0.1, "the appender")
    assert a.pause()
    deadline = time.time() + 30
    while (sandbox_record(vol_env.home, a.sandbox_id)["paused"] or {}).get("tier") != "hibernated":
        assert time.time() < deadline, "the paused sandbox was never hibernated"
        time.sleep(0.5)
    vol.write_file("/while-paused.txt", "new")
    _run(b, "true")  # the other sandbox goes on reading meanwhile
    a = Sandbox.connect(a.sandbox_id)
    assert _run(a, "cat /mnt/data/while-paused.txt") == "new"
    seen = _lines(vol)
    wait_until(lambda: _lines(vol) > seen, 10, 0.1, "the appender to go on after resume")

    # A fork child mounts the same volume.
    with vol_env.client() as c:
        resp = c.post(f"/sandboxes/{a.sandbox_id}/fork", json={"count": 1})
        assert resp.status_code == 201, resp.text
        child_id = resp.json()[0]["sandbox"]["sandboxID"]
    child = Sandbox.connect(child_id)
    sandboxes.append(child)
    _run(child, "echo from-child > /mnt/data/child.txt")
    assert _run(a, "cat /mnt/data/child.txt") == "from-child\n"

    # A snapshot records the mount, not the content: its sandboxes see today's files.
    with vol_env.client() as c:
        resp = c.post(f"/sandboxes/{a.sandbox_id}/snapshots", json={})
        assert resp.status_code == 201, resp.text
        snap = resp.json()["snapshotID"]
    vol.write_file("/after-snapshot.txt", "later")
    s = Sandbox.create(snap, timeout=60)
    sandboxes.append(s)
    assert _run(s, "cat /mnt/data/after-snapshot.txt") == "later"
    # A files-only pause (processes dropped) boots it again, with the mount.
    with vol_env.client() as c:
        resp = c.post(f"/sandboxes/{s.sandbox_id}/pause", json={"memory": False})
        assert resp.status_code == 204, resp.text
    s = Sandbox.connect(s.sandbox_id)
    assert _run(s, "cat /mnt/data/child.txt") == "from-child\n"

    # Deleting a volume mounted by a sandbox is refused; once they are gone it works, and
    # the snapshot that names it cannot start any more.
    with pytest.raises(Exception, match="is mounted by"):
        Volume.destroy(vol.volume_id)
    for sbx in (a, b, child, s):
        sbx.kill()
    assert Volume.destroy(vol.volume_id)
    assert not Volume.destroy(vol.volume_id)
    assert name not in [v.name for v in Volume.list()]
    with pytest.raises(Exception, match="was deleted"):
        Sandbox.create(snap)


def test_volume_cli(server: Server, tmp_path: Path) -> None:
    name = f"cli-{secrets.token_hex(4)}"
    vid = aenv(server, "volume", "create", name).stdout.strip()
    try:
        src = tmp_path / "in.bin"
        src.write_bytes(bytes(range(256)) * 4096)
        aenv(server, "volume", "cp", str(src), f"{name}:/in.bin")
        listed = json.loads(aenv(server, "volume", "files", vid, "--json").stdout)
        assert [(e["path"], e["size"]) for e in listed] == [("/in.bin", 256 * 4096)]
        aenv(server, "volume", "cp", f"{vid}:/in.bin", str(tmp_path / "out.bin"))
        assert (tmp_path / "out.bin").read_bytes() == src.read_bytes()
        # A sandbox started with --volume sees it, read-only.
        sid = aenv(server, "start", "-d", "--volume", f"{name}:/v:ro").stdout.strip()
        try:
            script = "wc -c < /v/in.bin; touch /v/x"
            out = aenv(server, "exec", sid, "--", "sh", "-c", script, check=False)
        finally:
            aenv(server, "rm", sid)
        assert out.stdout.split()[0] == str(256 * 4096)
        assert out.returncode != 0 and "Read-only" in out.stderr
        assert name in aenv(server, "volume", "ls").stdout
    finally:
        aenv(server, "volume", "rm", name)
    assert name not in aenv(server, "volume", "ls").stdout
