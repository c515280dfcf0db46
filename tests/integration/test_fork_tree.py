"""The fork tree's diff and apply (docs/fork-tree.md), as a best-of-N harness uses them: fork
children of an agent-like sandbox, each edits its own files; what each changed since the fork
point is listed exactly and served as a patch and a tar; the winner's changes go back into
the parent; a conflicting apply is refused with the paths. Stock SDK + raw HTTP, real gVisor."""

from __future__ import annotations

import io
import tarfile

import pytest
from e2b import Sandbox

from .conftest import Server
from .test_cli import aenv

pytestmark = pytest.mark.integration

W = "/home/user/work"


def changes(server: Server, sid: str, **params: str) -> set[tuple[str, str]]:
    with server.client() as c:
        r = c.get(f"/sandboxes/{sid}/diff", params=params)
    assert r.status_code == 200, r.text
    return {(x["path"], x["change"]) for x in r.json()}


def test_diff_and_apply_across_a_fork(e2b_env: Server, sandboxes: list[object]) -> None:
    server = e2b_env
    p = Sandbox.create(template="base", timeout=300)
    sandboxes.append(p)
    p.commands.run(
        f"mkdir -p {W} && printf 'x = 1\\n' > {W}/main.py && echo keep > {W}/notes.txt "
        f"&& echo old > {W}/old.txt"
    )
    kids = [k for k in p.fork(count=4) if isinstance(k, Sandbox)]
    sandboxes.extend(kids)
    assert len(kids) == 4
    win, other, third, fourth = kids
    # The winner edits, adds and deletes (and leaves a cache behind); the others each edit
    # something else.
    win.commands.run(
        f"printf 'x = 2\\n' > {W}/main.py && echo new > {W}/new.txt && rm {W}/old.txt "
        f"&& mkdir -p {W}/__pycache__ && echo c > {W}/__pycache__/main.pyc"
    )
    other.commands.run(f"echo other > {W}/notes.txt")
    third.commands.run(f"mkdir -p {W}/lib && echo 'def f(): pass' > {W}/lib/util.py")
    fourth.commands.run(f"chmod 600 {W}/notes.txt && ln -s main.py {W}/link.py")

    assert changes(server, win.sandbox_id) == {
        (f"{W}/main.py", "changed"),
        (f"{W}/new.txt", "added"),
        (f"{W}/old.txt", "deleted"),
    }
    assert changes(server, other.sandbox_id) == {(f"{W}/notes.txt", "changed")}
    assert changes(server, third.sandbox_id) == {
        (f"{W}/lib", "added"),
        (f"{W}/lib/util.py", "added"),
    }
    assert changes(server, fourth.sandbox_id) == {
        (f"{W}/notes.txt", "changed"),
        (f"{W}/link.py", "added"),
    }
    # Paused (its memory kept) it answers the same, what it wrote last included.
    other.commands.run(f"echo 'other, later' > {W}/notes.txt")
    with server.client() as c:
        assert c.post(f"/sandboxes/{other.sandbox_id}/pause").status_code == 204
        r = c.get(f"/sandboxes/{other.sandbox_id}/diff", params={"format": "patch"})
        assert r.status_code == 200 and "+other, later\n" in r.text, r.text
        assert c.get(f"/sandboxes/{other.sandbox_id}").json()["state"] == "paused"
    # The cache is there when asked for.
    assert (f"{W}/__pycache__/main.pyc", "added") in changes(
        server, win.sandbox_id, defaultExcludes="false"
    )
    # Between siblings: what the winner has that the other does not.
    assert changes(server, win.sandbox_id, base=other.sandbox_id) == {
        (f"{W}/main.py", "changed"),
        (f"{W}/new.txt", "added"),
        (f"{W}/old.txt", "deleted"),
        (f"{W}/notes.txt", "changed"),
    }

    with server.client() as c:
        patch = c.get(f"/sandboxes/{win.sandbox_id}/diff", params={"format": "patch"})
        assert patch.status_code == 200 and patch.headers["content-type"].startswith("text/x-diff")
        assert f"--- a{W}/main.py\n+++ b{W}/main.py\n" in patch.text
        assert "-x = 1\n+x = 2\n" in patch.text
        assert f"deleted file mode 100644\n--- a{W}/old.txt\n+++ /dev/null\n" in patch.text
        tar = c.get(f"/sandboxes/{win.sandbox_id}/diff", params={"format": "tar"})
        assert tar.status_code == 200
        with tarfile.open(fileobj=io.BytesIO(tar.content)) as t:
            assert sorted(t.getnames()) == [f"{W}/main.py"[1:], f"{W}/new.txt"[1:]]
            f = t.extractfile(f"{W}/new.txt"[1:])
            assert f is not None and f.read() == b"new\n"

        # The parent changed main.py too: taking the winner's changes is refused, with the path.
        p.commands.run(f"printf 'x = 3\\n' > {W}/main.py")
        r = c.post(f"/sandboxes/{p.sandbox_id}/apply", json={"from": win.sandbox_id})
        assert r.status_code == 409, r.text
        assert r.json()["paths"] == [f"{W}/main.py"]
        # The same with the CLI: one line per path, exit code 1.
        out = aenv(server, "apply", p.sandbox_id, "--from", win.sandbox_id, check=False)
        assert out.returncode == 1 and f"C {W}/main.py" in out.stderr, out
        assert aenv(server, "diff", win.sandbox_id).stdout.splitlines() == [
            f"M {W}/main.py",
            f"A {W}/new.txt",
            f"D {W}/old.txt",
        ]
        assert "-x = 1\n+x = 2\n" in aenv(server, "diff", win.sandbox_id, "--patch").stdout
        assert p.files.read(f"{W}/main.py") == "x = 3\n"  # nothing was written
        # Part of it, where there is no conflict.
        r = c.post(
            f"/sandboxes/{p.sandbox_id}/apply",
            json={"from": win.sandbox_id, "paths": [f"{W}/new.txt"]},
        )
        assert r.status_code == 200, r.text
        assert [x["path"] for x in r.json()["applied"]] == [f"{W}/new.txt"]
        assert p.files.read(f"{W}/new.txt") == "new\n"
        assert p.files.exists(f"{W}/old.txt")
        # All of it, the winner's side taken: the parent keeps running.
        r = c.post(
            f"/sandboxes/{p.sandbox_id}/apply",
            json={"from": win.sandbox_id, "strategy": "theirs"},
        )
        assert r.status_code == 200, r.text
        assert r.json()["conflicts"] == [f"{W}/main.py"]
    assert p.files.read(f"{W}/main.py") == "x = 2\n"
    assert not p.files.exists(f"{W}/old.txt")
    assert p.files.read(f"{W}/notes.txt") == "keep\n"
    # The files keep their owner: the sandbox's user can still write them.
    p.commands.run(f"echo more >> {W}/main.py")
    # Bad input: a base that is nothing, a sandbox without a fork point.
    with server.client() as c:
        r = c.get(f"/sandboxes/{win.sandbox_id}/diff", params={"base": "nope"})
        assert r.status_code == 404 and "nope" in r.json()["message"]
        fresh = Sandbox.create(template="base", timeout=60)
        sandboxes.append(fresh)
        r = c.get(f"/sandboxes/{fresh.sandbox_id}/diff")
        assert r.status_code == 400 and "fork point" in r.json()["message"]


COUNTER = (
    "python3 -c 'import time\n"
    "n = 0\n"
    "while True:\n"
    "    n += 1\n"
    '    open("/tmp/n", "w").write(str(n))\n'
    "    time.sleep(0.1)'"
)


def test_rollback_in_place(e2b_env: Server, sandboxes: list[object]) -> None:
    """Back to its own snapshot: the files and a process's memory as they were, under the
    same id and envd URL (the SDK object goes on working), the process running on."""
    server = e2b_env
    s = Sandbox.create(template="base", timeout=300)
    sandboxes.append(s)
    s.files.write("/home/user/a.txt", "v1")
    counter = s.commands.run(COUNTER, background=True)
    wait = "sleep 1.5; cat /tmp/n"
    s.commands.run(wait)
    snap = s.create_snapshot()
    try:
        at_snapshot = int(s.commands.run("cat /tmp/n").stdout)
        s.commands.run("sleep 3")
        s.files.write("/home/user/a.txt", "v2")
        s.files.write("/home/user/b.txt", "new")
        before = int(s.commands.run("cat /tmp/n").stdout)
        assert before > at_snapshot + 10
        out = aenv(server, "rollback", s.sandbox_id, snap.snapshot_id)
        assert snap.snapshot_id in out.stdout
        # The same SDK object: same id, same envd URL and token.
        assert s.files.read("/home/user/a.txt") == "v1"
        assert not s.files.exists("/home/user/b.txt")
        after = int(s.commands.run("cat /tmp/n").stdout)
        assert after < before  # the counter's memory went back with the files
        assert counter.pid in [p.pid for p in s.commands.list()]
        assert int(s.commands.run(wait).stdout) > after  # and it runs on
        assert s.get_info().sandbox_id == s.sandbox_id
        with server.client() as c:
            # Bad input: not a snapshot, not one of its own.
            r = c.post(f"/sandboxes/{s.sandbox_id}/rollback", json={"snapshotID": "nope"})
            assert r.status_code == 404, r.text
            other = Sandbox.create(template="base", timeout=60)
            sandboxes.append(other)
            r = c.post(
                f"/sandboxes/{other.sandbox_id}/rollback", json={"snapshotID": snap.snapshot_id}
            )
            assert r.status_code == 400 and "not taken of" in r.json()["message"], r.text
    finally:
        Sandbox.delete_snapshot(snap.snapshot_id)
