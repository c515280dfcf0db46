"""Template builds without sandboxes: the request spec, cache keys, the build store, uploads,
layer-stack reads, the in-sandbox COPY helper (run on a scratch root) and the API routes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.builds import stack
from aenv.builds.files import BuildFiles
from aenv.builds.spec import BuildState, Step, apply_state_step, cache_key, parse_spec
from aenv.builds.store import BuildReason, BuildRecord, BuildStore, LogEntry
from aenv.builds.tags import split_name
from aenv.errors import BadRequest, Forbidden
from aenv.server import node_app
from tests import node_harness

ROOT = os.geteuid() == 0
HELPER = Path(__file__).resolve().parents[2] / "src/aenv/builds/copy_in_sandbox.py"


# --------------------------------------------------------------------------------------------
# spec


def test_parse_spec_as_the_sdk_sends_it() -> None:
    spec = parse_spec(
        {
            "steps": [
                {"type": "RUN", "args": ["mkdir -p /tmp/w"], "force": False},
                {"type": "WORKDIR", "args": ["/tmp/w"], "force": False},
                {"type": "ENV", "args": ["A", "1", "B", "2"], "force": False},
                {"type": "COPY", "args": ["a.txt", "/x/"], "filesHash": "ab12", "force": True},
                {"type": "RUN", "args": ["id", "root"], "force": False},
            ],
            "force": False,
            "fromImage": "ubuntu:noble",
            "startCmd": "sleep 100",
            "readyCmd": "test -f x",
        }
    )
    assert spec.from_image == "ubuntu:noble" and spec.from_template is None
    assert [s.type for s in spec.steps] == ["RUN", "WORKDIR", "ENV", "COPY", "RUN"]
    assert spec.steps[3].args == ["a.txt", "/x/", "", ""] and spec.steps[3].force
    assert spec.steps[0].describe() == 'RUN "mkdir -p /tmp/w"'
    assert spec.steps[4].describe() == 'RUN "id" (as root)'
    assert spec.start_cmd == "sleep 100" and spec.ready_cmd == "test -f x"


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"steps": []}, "fromImage or fromTemplate"),
        ({"fromImage": "a", "fromTemplate": "b"}, "either"),
        ({"fromImage": "a", "steps": [{"type": "FROB", "args": []}]}, "unsupported type"),
        ({"fromImage": "a", "steps": [{"type": "ENV", "args": ["A"]}]}, "pairs"),
        ({"fromImage": "a", "steps": [{"type": "COPY", "args": ["a", "/b"]}]}, "filesHash"),
        (
            {
                "fromImage": "a",
                "steps": [{"type": "COPY", "args": ["../a", "/b"], "filesHash": "x"}],
            },
            "outside",
        ),
        ({"fromImage": "a", "steps": [{"type": "RUN", "args": []}]}, "RUN takes"),
    ],
)
def test_parse_spec_errors(raw: dict[str, Any], match: str) -> None:
    with pytest.raises(BadRequest, match=match):
        parse_spec(raw)


def test_build_state_and_cache_key() -> None:
    st = BuildState(env={"PATH": "/bin"})
    apply_state_step(st, Step("ENV", ["PATH", "$PATH:/opt/bin", "X", "${PATH}"]))
    apply_state_step(st, Step("WORKDIR", ["/srv"]))
    apply_state_step(st, Step("WORKDIR", ["app"]))
    apply_state_step(st, Step("USER", ["1000"]))
    assert st.env == {"PATH": "/bin:/opt/bin", "X": "/bin:/opt/bin"}
    assert st.workdir == "/srv/app" and st.user == "1000"

    run = Step("RUN", ["make"])
    k = cache_key(["sha256:" + "a" * 64], run, st)
    assert k == cache_key(["sha256:" + "a" * 64], Step("RUN", ["make"], force=True), st.copy())
    assert k != cache_key(["sha256:" + "b" * 64], run, st)
    assert k != cache_key(["sha256:" + "a" * 64], Step("RUN", ["make all"]), st)
    other = st.copy()
    other.env["Y"] = "1"
    assert k != cache_key(["sha256:" + "a" * 64], run, other)
    copy_a = Step("COPY", ["a", "/b", "", ""], files_hash="h1")
    copy_b = Step("COPY", ["a", "/b", "", ""], files_hash="h2")
    assert cache_key([], copy_a, st) != cache_key([], copy_b, st)


def test_split_name() -> None:
    assert split_name("my-env:v1") == ("my-env", "v1")
    assert split_name("my-env") == ("my-env", None)
    assert split_name("ns/name:tag") == ("ns/name", "tag")


# --------------------------------------------------------------------------------------------
# store and uploads


def test_store_builds_logs_and_cache(tmp_path: Path) -> None:
    store = BuildStore(tmp_path / "builds.db")
    b = BuildRecord("b1", "t1", "waiting", time.time(), time.time(), names=["n"])
    store.put(b)
    store.add_logs("b1", [LogEntry(i, time.time(), "info", f"line {i}") for i in range(5)])
    assert [e.message for e in store.logs("b1")][2:] == ["line 2", "line 3", "line 4"]
    assert [x.build_id for x in store.unfinished()] == ["b1"]
    b.status = "ready"
    store.put(b)
    assert store.unfinished() == [] and store.get("b1").status == "ready"  # type: ignore[union-attr]
    assert store.cached("k") is None
    store.cache("k", "sha256:" + "c" * 64)
    assert store.cached("k") == "sha256:" + "c" * 64
    store.uncache("k")
    assert store.cached("k") is None
    store.delete_template("t1")
    assert store.get("b1") is None and store.logs("b1") == []


def test_store_build_record_round_trip(tmp_path: Path) -> None:
    store = BuildStore(tmp_path / "builds.db")
    spec = parse_spec(
        {
            "fromImage": "alpine:3",
            "fromImageRegistry": {"type": "registry", "username": "u", "password": "p"},
            "steps": [{"type": "COPY", "args": ["a", "/a"], "filesHash": "h1"}],
            "startCmd": "serve",
        }
    )
    b = BuildRecord(
        "b1",
        "t1",
        "error",
        1.0,
        2.0,
        name="env",
        names=["env", "env:v1"],
        tags=["v1"],
        cpu_count=2,
        memory_mb=1024,
        spec=spec,
        reason=BuildReason("it broke", "3"),
        finished=5.0,
    )
    store.put(b)
    got = store.get("b1")
    assert got is not None and got.spec is not None
    # The credentials never reach the disk.
    assert got.spec.registry == {"type": "registry"}
    assert got.spec.to_json() == spec.to_json()
    assert (got.name, got.names, got.tags) == ("env", ["env", "env:v1"], ["v1"])
    assert (got.cpu_count, got.memory_mb, got.finished) == (2, 1024, 5.0)
    assert got.reason == BuildReason("it broke", "3")


def test_store_reads_the_doc_of_existing_builds_db(tmp_path: Path) -> None:
    """A row as earlier versions wrote it (and a key this one does not know) still loads."""
    store = BuildStore(tmp_path / "builds.db")
    doc = {
        "names": ["n", "n:t"],
        "name": "n",
        "tags": ["t"],
        "cpu_count": 4,
        "memory_mb": 2048,
        "spec": {"fromTemplate": "base", "force": False, "steps": []},
        "reason": {"message": "the build was cancelled"},
        "finished": 9.5,
        "from_the_future": 1,
    }
    store._run(
        "INSERT INTO builds(build_id, template_id, status, created, updated, doc) "
        "VALUES(?,?,?,?,?,?)",
        ("b2", "t2", "error", 1.0, 2.0, json.dumps(doc)),
    )
    got = store.get("b2")
    assert got is not None and got.spec is not None
    assert got.spec.from_template == "base"
    assert got.reason == BuildReason("the build was cancelled", None)
    assert (got.names, got.cpu_count, got.memory_mb, got.finished) == (["n", "n:t"], 4, 2048, 9.5)
    store.put(got)
    (raw,) = store._run("SELECT doc FROM builds WHERE build_id='b2'")[0]
    del doc["from_the_future"]
    assert json.loads(raw) == doc


def _tar(entries: dict[str, bytes], gz: bool = True) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as tf:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_build_files_signing_and_commit(tmp_path: Path) -> None:
    files = BuildFiles(tmp_path / "bf", "secret")
    q = files.sign("abc123")
    files.check("abc123", q["expires"], q["signature"])
    with pytest.raises(Forbidden, match="invalid"):
        files.check("other", q["expires"], q["signature"])
    with pytest.raises(Forbidden, match="expired"):
        past = files.sign("abc123", now=time.time() - 7200)
        files.check("abc123", past["expires"], past["signature"])
    with pytest.raises(Forbidden, match="not signed"):
        files.check("abc123", None, None)
    with pytest.raises(BadRequest):
        files.path("../etc")
    staged = files.staging()
    staged.write_bytes(b"not a tar at all")
    with pytest.raises(BadRequest, match="not a tar"):
        files.commit(staged, "abc123")
    assert not staged.exists() and not files.present("abc123")
    staged = files.staging()
    staged.write_bytes(_tar({"a.txt": b"a"}))
    files.commit(staged, "abc123")
    assert files.present("abc123")


# --------------------------------------------------------------------------------------------
# layer stacks


def test_stack_read_file_whiteouts_and_symlinks(tmp_path: Path) -> None:
    low, mid, top = (tmp_path / n for n in ("low", "mid", "top"))
    for d in (low, mid, top):
        (d / "etc").mkdir(parents=True)
    (low / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (low / "etc/hosts").write_text("low hosts\n")
    (mid / "etc/passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n"
    )
    (top / "etc/alias").symlink_to("passwd")
    layers = [top, mid, low]
    assert stack.read_file(layers, "etc/hosts") == b"low hosts\n"
    assert b"user:x:1000" in (stack.read_file(layers, "/etc/alias") or b"")
    if ROOT:
        os.mknod(top / "etc/hosts", 0o600 | 0o020000, os.makedev(0, 0))  # a whiteout
        assert stack.read_file(layers, "etc/hosts") is None
    assert stack.exists(layers, "/etc") and stack.exists(layers, "etc/alias")
    assert not stack.exists(layers, "/nope") and stack.exists(layers, "/")
    entries = stack.passwd(layers)
    assert [e.name for e in entries] == ["root", "user"]
    assert stack.resolve_user(entries, None) == (None, None)
    assert stack.resolve_user(entries, "1000:1000") == ("user", None)
    assert stack.resolve_user(entries, "user") == ("user", None)
    assert stack.resolve_user(entries, "0") == ("root", None)
    name, warning = stack.resolve_user(entries, "nginx")
    assert name == "root" and warning and "does not exist" in warning
    name, warning = stack.resolve_user(entries, "4242")
    assert name == "root" and warning and "4242" in warning
    assert stack.default_user(entries) == "user"
    assert stack.default_user(entries[:1]) == "root"
    # A command's own user must exist (E2B's envd refuses it); a USER falls back to root.
    assert stack.run_user_error(entries, "whoami", "user") is None
    assert stack.run_user_error(entries, "whoami", "0") is None
    assert stack.run_user_error(entries, "whoami", "root123") == (
        "failed to run command 'whoami': command failed: unauthenticated: "
        "invalid username: 'root123'"
    )


# --------------------------------------------------------------------------------------------
# the in-sandbox COPY helper, on a scratch root


def _copy(root: Path, archive: bytes, **spec: str) -> subprocess.CompletedProcess[str]:
    (root / ".aenv-build").mkdir(exist_ok=True)
    (root / ".aenv-build/h.tar").write_bytes(archive)
    full = {"tar": "/.aenv-build/h.tar", "root": str(root), "owner": "", "mode": "", **spec}
    return subprocess.run(
        [sys.executable, "-c", HELPER.read_text(), json.dumps(full)],
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.skipif(not ROOT, reason="the helper chowns (root only)")
def test_copy_helper_docker_semantics(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/passwd").write_text(
        "root:x:0:0::/root:/bin/sh\nuser:x:1000:1001::/home/user:/bin/sh\n"
    )
    (root / "etc/group").write_text("root:x:0:\nstaff:x:50:\n")
    archive = _tar({"app/run.sh": b"echo", "app/lib/x.py": b"x", "one.txt": b"1", "two.txt": b"2"})
    # A directory source copies its contents.
    r = _copy(root, archive, src="app", dest="/opt/app", owner="user", mode="0755")
    assert r.returncode == 0, r.stderr
    st = (root / "opt/app/run.sh").stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (1000, 1001, 0o755)
    assert (root / "opt/app/lib/x.py").read_text() == "x"
    assert (root / "opt/app").stat().st_uid == 1000  # created for the owner
    assert (root / "opt").stat().st_uid == 1000
    # A file to a path, to a directory (trailing /), globs into a directory.
    assert _copy(root, archive, src="one.txt", dest="/data/renamed.txt").returncode == 0
    assert (root / "data/renamed.txt").read_text() == "1"
    assert _copy(root, archive, src="one.txt", dest="/data/").returncode == 0
    assert (root / "data/one.txt").stat().st_uid == 0
    r = _copy(root, archive, src="*.txt", dest="rel", workdir="/w", owner="1000:staff")
    assert r.returncode == 0, r.stderr
    st = (root / "w/rel/two.txt").stat()
    assert (st.st_uid, st.st_gid) == (1000, 50)
    # Nothing of the archive is left behind.
    assert not (root / ".aenv-build").exists()
    # User errors: exit 2, one line.
    r = _copy(root, archive, src="missing", dest="/x")
    assert r.returncode == 2 and "matched nothing" in r.stderr
    r = _copy(root, archive, src="one.txt", dest="/x", owner="nobody")
    assert r.returncode == 2 and "does not exist" in r.stderr


@pytest.mark.skipif(not ROOT, reason="the helper chowns (root only)")
def test_copy_helper_keeps_symlinks_and_refuses_escapes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        f = tarfile.TarInfo("folder/test.txt")
        f.size = 4
        tf.addfile(f, io.BytesIO(b"text"))
        for name, target in (("folder/rel.txt", "test.txt"), ("folder/abs.txt", "/etc/passwd")):
            link = tarfile.TarInfo(name)
            link.type, link.linkname = tarfile.SYMTYPE, target
            tf.addfile(link)
    r = _copy(root, buf.getvalue(), src="folder/*", dest="/app/folder")
    assert r.returncode == 0, r.stderr
    assert (root / "app/folder/test.txt").read_text() == "text"
    assert os.readlink(root / "app/folder/rel.txt") == "test.txt"
    assert os.readlink(root / "app/folder/abs.txt") == "/etc/passwd"  # as Docker's COPY
    # a member written through a symlink out of the context is refused
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        out = tarfile.TarInfo("up")
        out.type, out.linkname = tarfile.SYMTYPE, str(tmp_path)
        tf.addfile(out)
        evil = tarfile.TarInfo("up/evil.txt")
        evil.size = 1
        tf.addfile(evil, io.BytesIO(b"x"))
    assert _copy(root, buf.getvalue(), src="up", dest="/x").returncode != 0
    assert not (tmp_path / "evil.txt").exists()


# --------------------------------------------------------------------------------------------
# routes (no sandboxes: a build is only requested, its record and logs written directly)


async def test_routes_request_upload_and_status(tmp_path: Path) -> None:
    node = node_harness.build(tmp_path, api_key="k")  # the real orchestrator, fake runtime
    app = node_app(node.settings, node.orch)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://node.example:8123", headers={"X-API-Key": "k"}
    ) as c:
        r = await c.post("/v3/templates", json={"name": "demo:v1", "cpuCount": 1})
        assert r.status_code == 202, r.text
        body = r.json()
        assert body["names"] == ["demo"] and body["tags"] == ["v1"] and body["public"] is False
        tid, bid = body["templateID"], body["buildID"]
        # Same name, same template.
        r2 = await c.post("/v3/templates", json={"alias": "demo"})
        assert r2.json()["templateID"] == tid and r2.json()["buildID"] != bid

        r = await c.get(f"/templates/{tid}/files/abc123")
        assert r.status_code == 201 and r.json()["present"] is False
        url = r.json()["url"]
        assert url.startswith("http://node.example:8123/build-files/abc123?")
        # The upload is authorised by the signature alone.
        async with httpx.AsyncClient(transport=transport) as anon:
            bad = await anon.put(url.split("?")[0], content=_tar({"a": b"a"}))
            assert bad.status_code == 403
            ok = await anon.put(url, content=_tar({"a": b"a"}))
            assert ok.status_code == 201, ok.text
            notar = await anon.put(url.replace("abc123", "zzz"), content=b"x")
            assert notar.status_code == 403
        assert (await c.get(f"/templates/{tid}/files/abc123")).json() == {"present": True}

        # Starting a build whose COPY files are missing is refused before anything runs.
        r = await c.post(
            f"/v2/templates/{tid}/builds/{bid}",
            json={
                "fromImage": "x",
                "steps": [{"type": "COPY", "args": ["a", "/a"], "filesHash": "nope"}],
            },
        )
        assert r.status_code == 400 and "not uploaded" in r.json()["message"]

        store = BuildStore(tmp_path / "builds.db")
        rec = store.get(bid)
        assert rec is not None
        rec.status = "error"
        rec.reason = BuildReason('step 1 RUN "false" failed: exit status 1', "1")
        store.put(rec)
        store.add_logs(bid, [LogEntry(i, time.time(), "info", f"l{i}") for i in range(150)])
        seen: list[str] = []
        offset = 0
        while True:
            r = await c.get(f"/templates/{tid}/builds/{bid}/status", params={"logsOffset": offset})
            assert r.status_code == 200, r.text
            data = r.json()
            assert data["status"] == "error"
            assert data["reason"] == {
                "message": 'step 1 RUN "false" failed: exit status 1',
                "step": "1",
            }
            if not data["logEntries"]:
                break
            assert (
                len(data["logEntries"]) <= 100
                and data["logs"][0] == data["logEntries"][0]["message"]
            )
            seen += data["logs"]
            offset += len(data["logEntries"])
        assert seen == [f"l{i}" for i in range(150)]
        r = await c.get(f"/templates/{tid}/builds/nope/status")
        assert r.status_code == 404

        # Listed (its only build failed), alias known, deleted with its builds.
        listed = (await c.get("/templates")).json()
        ours = [(t["templateID"], t["buildStatus"]) for t in listed if t["templateID"] != "base"]
        assert ours == [(tid, "waiting")]
        assert (await c.get("/templates/aliases/demo")).json()["templateID"] == tid
        assert (await c.get("/templates/aliases/other")).status_code == 404
        info = (await c.get(f"/templates/{tid}")).json()
        assert {b["buildID"] for b in info["builds"]} == {bid, r2.json()["buildID"]}
        assert (await c.delete(f"/templates/{tid}")).status_code == 204
        assert (await c.get("/templates/aliases/demo")).status_code == 404
