"""Template builds, cold starts from images and the pull/build CLI, end to end.

A loopback `docker-registry` (on `TEST_REGISTRY`, which the session's server trusts as a
plain-HTTP registry) serves images built here as OCI layouts and pushed with skopeo (helpers
from test_registry.py): a busybox-static rootfs without Python or glibc, the same with a
non-root image user, and small data-only images for the layer cache bound. The stock E2B
Python SDK drives the builds (`Template.build`), sandboxes are created from the results and
inspected; a second node with a tiny layer cache checks eviction under a running sandbox.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from e2b import Sandbox, Template
from e2b.exceptions import BuildException

from tests import netplan
from tests.helpers import wait_healthy

from .conftest import AENV, TEST_REGISTRY, Server, running_server
from .test_registry import (
    BUSYBOX,
    NEEDS_REGISTRY,
    REGISTRY_BIN,
    Entry,
    Layout,
    Registry,
    push,
)

pytestmark = [pytest.mark.integration, NEEDS_REGISTRY]

PASSWD_ROOT = (
    b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
)
CACHE_IMAGES = 6
CACHE_LAYER_BYTES = 400_000


def busybox_rootfs(passwd: bytes = PASSWD_ROOT, extra: list[Entry] | None = None) -> list[Entry]:
    """A static busybox with every applet linked in /bin, and /bin/bash as a tiny wrapper
    (the SDK runs commands with `/bin/bash -l -c`). No Python, no libc."""
    entries = [
        Entry("bin", "dir", mode=0o755),
        Entry("bin/busybox", data=BUSYBOX.read_bytes(), mode=0o755),
        Entry("bin/bash", data=b'#!/bin/sh\nexec /bin/sh "$@"\n', mode=0o755),
        Entry("etc", "dir", mode=0o755),
        Entry("etc/passwd", data=passwd),
        Entry("etc/group", data=b"root:x:0:\nnobody:x:65534:\napp:x:1000:\n"),
        Entry("root", "dir", mode=0o700),
        Entry("tmp", "dir", mode=0o1777),
        *(extra or []),
    ]
    applets = subprocess.run(
        [str(BUSYBOX), "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    entries += [
        Entry(f"bin/{a}", "symlink", target="busybox")
        for a in applets
        if a not in ("busybox", "bash")
    ]
    return entries


@dataclass
class Images:
    host: str
    busybox: str  # root only; WorkingDir /srv (missing); Cmd writes /tmp/entry.txt
    busybox_user: str  # User 1000 (app), WorkingDir /home/app
    cache: list[str]


def _start_registry(workdir: Path) -> Registry:
    host = TEST_REGISTRY
    storage = workdir / "storage"
    storage.mkdir(parents=True)
    cfg = workdir / "config.yml"
    cfg.write_text(
        json.dumps(
            {
                "version": 0.1,
                "log": {"level": "warn", "accesslog": {"disabled": True}},
                "storage": {"filesystem": {"rootdirectory": str(storage)}},
                "http": {"addr": host, "secret": uuid.uuid4().hex},
            }
        )
    )
    log = workdir / "registry.log"
    proc = subprocess.Popen(
        [REGISTRY_BIN, "serve", str(cfg)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    reg = Registry(host, storage, proc, log)
    try:
        wait_healthy(f"http://{host}", 20, proc=proc, path="/v2/", status=200, log=log)
    except AssertionError:
        reg.stop()
        raise
    return reg


@pytest.fixture(scope="module")
def images() -> Iterator[Images]:
    tmp = Path(tempfile.mkdtemp(prefix="aenv-templates-it-"))
    reg: Registry | None = None
    try:
        reg = _start_registry(tmp / "registry")
        lay = Layout(tmp / "oci-busybox")
        lay.tag(
            "latest",
            lay.image(
                [(busybox_rootfs(), "gzip")],
                {
                    "Env": ["PATH=/bin", "HELLO=from-image"],
                    "WorkingDir": "/srv",
                    "Entrypoint": ["/bin/sh", "-c"],
                    "Cmd": ["echo started > /tmp/entry.txt; exec sleep 3600"],
                },
            ),
        )
        push(lay, "latest", reg, "busybox")
        lay = Layout(tmp / "oci-busybox-user")
        passwd = PASSWD_ROOT + b"app:x:1000:1000:app:/home/app:/bin/sh\n"
        home = [
            Entry("home", "dir", mode=0o755),
            Entry("home/app", "dir", mode=0o750, uid=1000, gid=1000),
        ]
        lay.tag(
            "latest",
            lay.image(
                [(busybox_rootfs(passwd, home), "gzip")],
                {
                    "Env": ["PATH=/bin", "HELLO=from-image"],
                    "WorkingDir": "/home/app",
                    "User": "1000",
                },
            ),
        )
        push(lay, "latest", reg, "busybox-user")
        lay = Layout(tmp / "oci-cache")
        base = [Entry("etc", "dir", mode=0o755), Entry("etc/os-release", data=b"ID=cache\n")]
        for i in range(CACHE_IMAGES):
            own = [Entry(f"data{i}", data=os.urandom(CACHE_LAYER_BYTES))]
            lay.tag(f"c{i}", lay.image([(base, "gzip"), (own, "gzip")]))
            push(lay, f"c{i}", reg, "cache")
        yield Images(
            host=reg.host,
            busybox=f"{reg.host}/busybox:latest",
            busybox_user=f"{reg.host}/busybox-user:latest",
            cache=[f"{reg.host}/cache:c{i}" for i in range(CACHE_IMAGES)],
        )
    finally:
        if reg is not None:
            reg.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def delete_template(server: Server, name: str) -> None:
    with server.client() as c:
        c.delete(f"/templates/{name}")


def build_sandboxes(server: Server) -> list[dict[str, Any]]:
    with server.client() as c:
        return [s for s in c.get("/v2/sandboxes").json() if "aenv.build" in s.get("metadata", {})]


# --------------------------------------------------------------------------------------------
# E2B SDK builds


@pytest.mark.timeout(900)
def test_sdk_build_with_start_cmd(images: Images, e2b_env: Server, sandboxes: list[object]) -> None:
    """The AgentENV compat flow: the start command runs in every sandbox of the template."""
    name = unique("sdk-start")
    logs: list[str] = []
    template = (
        Template()
        .from_image(images.busybox)
        .run_cmd("mkdir -p /work && echo built > /work/marker.txt")
        .set_workdir("/work")
        .set_envs({"A": "1"})
        .run_cmd("printf 'while true; do sleep 1; done\\n' > aenv-startup-xyz.sh")
        .set_start_cmd("sh /work/aenv-startup-xyz.sh", "test -f /work/marker.txt")
    )
    info = Template.build(
        template,
        name,
        cpu_count=1,
        memory_mb=256,
        skip_cache=True,
        on_build_logs=lambda e: logs.append(e.message),
    )
    try:
        assert info.name == name
        assert any("snapshot" in line for line in logs), logs
        assert Template.exists(name)
        for _ in range(2):  # every sandbox of the template has the process
            sbx = Sandbox.create(template=name, timeout=120)
            sandboxes.append(sbx)
            assert sbx.commands.run("cat marker.txt").stdout == "built\n"
            assert sbx.commands.run("pwd").stdout.strip() == "/work"
            assert sbx.commands.run("echo $A").stdout.strip() == "1"
            ps = sbx.commands.run("ps -o pid,args").stdout
            assert "sh /work/aenv-startup-xyz.sh" in ps, ps
            # The image's PATH came along (ENV merged over the image's Env).
            assert sbx.commands.run("echo $PATH").stdout.strip() == "/bin"
        assert build_sandboxes(e2b_env) == []
    finally:
        delete_template(e2b_env, name)
    assert not Template.exists(name)


@pytest.mark.timeout(900)
def test_sdk_copy_local_files(
    images: Images, e2b_env: Server, sandboxes: list[object], tmp_path: Path
) -> None:
    (tmp_path / "hello.txt").write_text("hello from the context\n")
    (tmp_path / "tool").mkdir()
    (tmp_path / "tool/run.sh").write_text("#!/bin/sh\necho tool ran\n")
    (tmp_path / "tool/sub").mkdir()
    (tmp_path / "tool/sub/x.cfg").write_text("x=1\n")
    name = unique("sdk-copy")
    template = (
        Template(file_context_path=str(tmp_path))
        .from_image(images.busybox)
        .copy("hello.txt", "/data/")
        .copy("tool", "/opt/tool", mode=0o755)
        .set_workdir("/data")
    )
    Template.build(template, name, cpu_count=1, memory_mb=256)
    try:
        sbx = Sandbox.create(template=name, timeout=120)
        sandboxes.append(sbx)
        assert sbx.commands.run("cat hello.txt").stdout == "hello from the context\n"
        assert sbx.commands.run("/opt/tool/run.sh").stdout == "tool ran\n"
        assert sbx.commands.run("cat /opt/tool/sub/x.cfg").stdout == "x=1\n"
        mode = sbx.commands.run("stat -c %a /opt/tool/run.sh").stdout.strip()
        assert mode == "755"
        # Nothing of the upload machinery is left in the image.
        assert sbx.commands.run("ls -a /").stdout.split().count(".aenv-build") == 0
    finally:
        delete_template(e2b_env, name)


@pytest.mark.timeout(900)
def test_sdk_failing_run_names_the_step(images: Images, e2b_env: Server) -> None:
    name = unique("sdk-fail")
    logs: list[str] = []
    template = (
        Template()
        .from_image(images.busybox)
        .run_cmd("echo fine")
        .run_cmd("echo oops-on-stderr >&2; false")
        .run_cmd("echo never")
    )
    try:
        with pytest.raises(
            BuildException,
            match=r'step 2 RUN "echo oops-on-stderr >&2; false" failed: exit status 1',
        ):
            Template.build(
                template, name, skip_cache=True, on_build_logs=lambda e: logs.append(e.message)
            )
        assert "oops-on-stderr" in logs and "never" not in logs
        with e2b_env.client() as c:
            listed = {t["aliases"][0]: t for t in c.get("/templates").json() if t["aliases"]}
        assert listed[name]["buildStatus"] == "error"
        assert build_sandboxes(e2b_env) == []
    finally:
        delete_template(e2b_env, name)


@pytest.mark.timeout(900)
def test_rebuild_reuses_the_step_cache(images: Images, e2b_env: Server) -> None:
    name = unique("sdk-cache")
    marker = uuid.uuid4().hex

    def build() -> tuple[float, list[str]]:
        logs: list[str] = []
        template = (
            Template()
            .from_image(images.busybox)
            .run_cmd(f"echo {marker} > /m.txt && sleep 2")
            .set_envs({"K": "v"})
            .run_cmd("cat /m.txt > /m2.txt")
        )
        t0 = time.monotonic()
        Template.build(template, name, on_build_logs=lambda e: logs.append(e.message))
        return time.monotonic() - t0, logs

    try:
        first, logs1 = build()
        assert not any(line.endswith("CACHED") for line in logs1), logs1
        second, logs2 = build()
        cached = [line for line in logs2 if line.endswith("CACHED")]
        assert len(cached) == 2, logs2
        assert not any(marker == line for line in logs2)  # the RUN did not run again
        print(f"first build {first:.1f}s, rebuild {second:.1f}s")
        # skip_cache runs everything again.
        logs3: list[str] = []
        template = (
            Template()
            .from_image(images.busybox)
            .run_cmd(f"echo {marker} > /m.txt && sleep 2")
            .set_envs({"K": "v"})
            .run_cmd("cat /m.txt > /m2.txt")
        )
        Template.build(
            template, name, skip_cache=True, on_build_logs=lambda e: logs3.append(e.message)
        )
        assert not any(line.endswith("CACHED") for line in logs3), logs3
        sbx = Sandbox.create(template=name, timeout=60)
        try:
            assert sbx.commands.run("cat /m2.txt").stdout.strip() == marker
        finally:
            sbx.kill()
    finally:
        delete_template(e2b_env, name)


@pytest.mark.timeout(900)
def test_sdk_tags_base_image_alias_and_tmp(e2b_env: Server, sandboxes: list[object]) -> None:
    """E2B's base image resolves to the local `base` (no registry is reachable here); a
    tagged build stays where its tags are while the next build moves the default; files
    the build wrote under /tmp and the bash start command's work are in the template."""
    name = unique("sdk-tags")

    def kept(ref: str) -> str:
        sbx = Sandbox.create(template=ref, timeout=120)
        sandboxes.append(sbx)
        return str(sbx.commands.run("cat /tmp/kept").stdout.strip())

    logs: list[str] = []
    v1 = (
        Template()
        .from_base_image()
        .run_cmd("echo one > /tmp/kept && echo step-output-$((6 * 7))")
        .set_start_cmd(
            "words=(alpha beta); echo ${words[1]} > /tmp/started; exec sleep infinity",
            "test -f /tmp/started",
        )
    )
    try:
        first = Template.build(v1, f"{name}:v1", on_build_logs=lambda e: logs.append(e.message))
        assert "step-output-42" in logs, logs  # the step's own output, as it ran
        assert any("local template base (image alias)" in line for line in logs), logs
        tags = {t.tag: t.build_id for t in Template.get_tags(name)}
        assert tags == {"v1": first.build_id, "default": first.build_id}
        sbx = Sandbox.create(template=f"{name}:v1", timeout=120)
        sandboxes.append(sbx)
        assert sbx.commands.run("cat /tmp/kept /tmp/started").stdout.split() == ["one", "beta"]
        assert sbx.commands.run("python -c 'print(6 * 7)'").stdout.strip() == "42"

        # A Dockerfile FROM E2B's base image, untagged: it moves the default only.
        second = Template.build(
            Template().from_dockerfile("FROM e2bdev/base\nRUN echo two > /tmp/kept\n"), name
        )
        assert kept(name) == "two" and kept(f"{name}:{second.build_id}") == "two"
        assert kept(f"{name}:v1") == "one" and kept(f"{name}:{first.build_id}") == "one"
        tags = {t.tag: t.build_id for t in Template.get_tags(name)}
        assert tags == {"v1": first.build_id, "default": second.build_id}

        assigned = Template.assign_tags(f"{name}:v1", ["prod"])
        assert assigned.build_id == first.build_id and assigned.tags == ["prod"]
        assert kept(f"{name}:prod") == "one"
        with pytest.raises(Exception):  # noqa: B017 (the SDK's exception type varies)
            Template.assign_tags(f"{name}:v1", ":invalid-tag")
        Template.remove_tags(name, ["v1", "prod"])
        assert {t.tag for t in Template.get_tags(name)} == {"default"}
        with pytest.raises(Exception, match="does not exist"):  # noqa: B017
            Sandbox.create(template=f"{name}:v1", timeout=60)
        with e2b_env.client() as c:
            listed = [t for t in c.get("/v2/templates").json() if name in t["names"]]
            assert [t["buildID"] for t in listed] == [second.build_id]
    finally:
        delete_template(e2b_env, name)
    assert not Template.exists(name)


@pytest.mark.timeout(600)
def test_tmp_is_part_of_the_files(images: Images, e2b_env: Server, sandboxes: list[object]) -> None:
    """/tmp is the sandbox's disk like the rest: kept by a build, a files-only pause and a
    snapshot; and an image without bash still runs the SDK's commands (with /bin/sh)."""
    name = unique("sdk-nobash")
    Template.build(
        Template()
        .from_image(images.busybox)
        .run_cmd("rm /bin/bash && echo from-build > /tmp/built"),
        name,
        cpu_count=1,
        memory_mb=256,
    )
    try:
        sbx = Sandbox.create(template=name, timeout=120)
        sandboxes.append(sbx)
        assert sbx.commands.run("echo $((1 + 2)); cat /tmp/built").stdout.split() == [
            "3",
            "from-build",
        ]
        sbx.files.write("/tmp/paused.txt", "before the pause")
        sbx.pause(mode="filesystem")
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.files.read("/tmp/paused.txt") == "before the pause"
        again.commands.run("echo snap > /tmp/snap.txt")
        snap = again.create_snapshot()
        child = Sandbox.create(template=snap.snapshot_id, timeout=60)
        sandboxes.append(child)
        assert child.commands.run("cat /tmp/snap.txt /tmp/built").stdout.split() == [
            "snap",
            "from-build",
        ]
        Sandbox.delete_snapshot(snap.snapshot_id)
    finally:
        delete_template(e2b_env, name)


# --------------------------------------------------------------------------------------------
# cold starts


def _cold(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    with server.client() as c:
        r = c.post("/sandboxes-cold", json=body)
        assert r.status_code == 201, r.text
        return dict(r.json())


@pytest.mark.timeout(600)
def test_cold_start_from_image(images: Images, e2b_env: Server, sandboxes: list[object]) -> None:
    created = _cold(
        e2b_env,
        {
            "image": images.busybox_user,
            "envVars": {"B": "2"},
            "metadata": {"k": "v"},
            "timeout": 120,
        },
    )
    sbx = Sandbox.connect(created["sandboxID"])
    sandboxes.append(sbx)
    assert sbx.commands.run("id -un").stdout.strip() == "app"  # User 1000 -> app
    assert sbx.commands.run("pwd").stdout.strip() == "/home/app"
    assert sbx.commands.run("echo $HELLO $B").stdout.strip() == "from-image 2"
    meta = sbx.get_info().metadata
    assert meta["k"] == "v" and meta["aenv.image"].startswith(images.busybox_user.rsplit(":", 1)[0])

    # Root-only image: its missing WorkingDir is created; Entrypoint+Cmd runs when asked.
    created = _cold(e2b_env, {"image": images.busybox, "startEntrypoint": True, "timeout": 120})
    sbx = Sandbox.connect(created["sandboxID"])
    sandboxes.append(sbx)
    assert sbx.commands.run("id -un; pwd").stdout.split() == ["root", "/srv"]
    info = sbx.get_info()
    assert json.loads(info.metadata["aenv.entrypoint"]) == ["/bin/sh", "-c"]
    for _ in range(50):
        out = sbx.commands.run("cat /tmp/entry.txt 2>/dev/null; ps -o args", timeout=30).stdout
        if "started" in out:
            break
        time.sleep(0.2)
    assert "started" in out and "sleep 3600" in out, out
    # Internal image templates are neither listed nor kept.
    with e2b_env.client() as c:
        assert not any(t["templateID"].startswith("img-") for t in c.get("/templates").json())
        r = c.post("/sandboxes-cold", json={"image": f"{images.host}/does-not-exist:1"})
        assert r.status_code == 404 and "not found" in r.json()["message"]


# --------------------------------------------------------------------------------------------
# the CLI


def _aenv(server: Server, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [AENV, "--url", server.url, "--api-key", server.api_key, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.timeout(900)
def test_cli_pull_and_build(
    images: Images, e2b_env: Server, sandboxes: list[object], tmp_path: Path
) -> None:
    pulled = unique("cli-pulled")
    built = unique("cli-built")
    try:
        r = _aenv(e2b_env, "pull", images.busybox)
        assert r.returncode == 0, r.stderr
        assert f"pulled {images.busybox}@sha256:" in r.stderr
        r = _aenv(e2b_env, "pull", images.busybox, "--name", pulled, "--start-cmd", "sleep 3600")
        assert r.returncode == 0, r.stderr
        template_id = r.stdout.strip()
        sbx = Sandbox.create(template=pulled, timeout=60)
        sandboxes.append(sbx)
        assert sbx.get_info().template_id == template_id
        assert "sleep 3600" in sbx.commands.run("ps -o args").stdout
        # The image's WorkingDir (missing in the image) was created and is the default cwd.
        assert sbx.commands.run("pwd").stdout.strip() == "/srv"

        ctx = tmp_path / "ctx"
        (ctx / "app").mkdir(parents=True)
        (ctx / "app/main.sh").write_text("#!/bin/sh\necho main\n")
        (ctx / "app/skip.tmp").write_text("ignored\n")
        (ctx / ".dockerignore").write_text("app/*.tmp\n")
        (ctx / "Dockerfile").write_text(
            f"""
            ARG BASE={images.busybox}
            FROM $BASE
            ARG WHO=nobody
            ENV APP_HOME=/app GREETING="hello there"
            WORKDIR $APP_HOME
            COPY --chmod=755 app/ ./
            RUN echo "$GREETING $WHO" > greeting.txt
            EXPOSE 8080
            CMD ["sh", "-c", "exec sleep 4242"]
            """.replace("\n            ", "\n")
        )
        r = _aenv(
            e2b_env,
            "build",
            str(ctx / "Dockerfile"),
            "--name",
            built,
            "--build-arg",
            "WHO=you",
            "--start",
        )
        assert r.returncode == 0, r.stderr
        assert "COPY app /app/" in r.stderr and "build finished" in r.stderr
        sbx = Sandbox.create(template=built, timeout=60)
        sandboxes.append(sbx)
        out = sbx.commands.run("pwd; cat greeting.txt; ./main.sh; ls; ps -o args").stdout
        lines = out.splitlines()
        assert lines[:3] == ["/app", "hello there you", "main"], out
        assert "skip.tmp" not in out and "sleep 4242" in out

        r = _aenv(e2b_env, "template", "ls")
        assert r.returncode == 0 and pulled in r.stdout and built in r.stdout
        # A second build of the same Dockerfile: every layer step comes from the cache.
        r = _aenv(e2b_env, "build", str(ctx), "--name", built, "--build-arg", "WHO=you")
        assert r.returncode == 0, r.stderr
        assert r.stderr.count("CACHED") == 2, r.stderr
        r = _aenv(
            e2b_env,
            "build",
            str(ctx),
            "--name",
            built,
            "--build-arg",
            "WHO=you",
            "-f",
            str(ctx / "nope"),
        )
        assert r.returncode == 1 and "no Dockerfile" in r.stderr
        r = _aenv(e2b_env, "template", "rm", built, pulled)
        assert r.returncode == 0 and r.stdout.split() == [built, pulled]
        r = _aenv(e2b_env, "template", "rm", built)
        assert r.returncode == 1 and "not found" in r.stderr
    finally:
        delete_template(e2b_env, built)
        delete_template(e2b_env, pulled)


# --------------------------------------------------------------------------------------------
# the layer cache bound


def _unreferenced_usage(home: Path) -> tuple[int, set[str]]:
    """Bytes of layers nobody references (what the cache bound applies to), and all layers."""
    db = sqlite3.connect(str(home / "layers/refs.db"))
    try:
        held = {d for (d,) in db.execute("SELECT DISTINCT digest FROM layer_refs")}
    finally:
        db.close()
    total = 0
    present = set()
    for meta in (home / "layers").glob("sha256-*/meta.json"):
        doc = json.loads(meta.read_text())
        present.add(doc["digest"])
        if doc["digest"] not in held:
            total += int(doc["size"])
    return total, present


@pytest.mark.timeout(900)
def test_small_layer_cache_keeps_its_bound(images: Images) -> None:
    capacity = 1_000_000
    with running_server(
        *netplan.slot_net("tpl").astuple(),
        AENV_LAYER_CACHE_GB=str(capacity / (1 << 30)),
        AENV_INSECURE_REGISTRIES=TEST_REGISTRY,
    ) as srv:
        with srv.client() as c:
            created = c.post("/sandboxes-cold", json={"image": images.cache[0], "timeout": 300})
            assert created.status_code == 201, created.text
        sbx = Sandbox.connect(
            created.json()["sandboxID"], api_url=srv.url, sandbox_url=srv.url, api_key=srv.api_key
        )
        pulled: list[list[str]] = []
        for ref in images.cache[1:]:
            with srv.client() as c, c.stream("POST", "/images/pull", json={"image": ref}) as r:
                assert r.status_code == 200
                events = [json.loads(line) for line in r.iter_lines() if line.strip()]
            assert events[-1]["type"] == "done", events[-1]
            assert any(e["type"] == "layer" and e["status"] == "done" for e in events)
            pulled.append(events[-1]["image"]["layers"])
            usage, present = _unreferenced_usage(srv.home)
            assert usage <= capacity, (usage, capacity)
            # The image just pulled is complete; the sandbox's image (no shell in it: envd
            # reads through its own runtime) still works.
            assert all(d in present for d in pulled[-1])
            assert sbx.files.read("/etc/os-release") == "ID=cache\n"
            assert len(sbx.files.read("/data0", format="bytes")) == CACHE_LAYER_BYTES
        # Images pulled earlier were evicted (their own layers), the running one's were not.
        _, present = _unreferenced_usage(srv.home)
        assert not all(d in present for d in pulled[0])
        sbx.kill()
