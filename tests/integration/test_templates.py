"""Template builds through the stock E2B Python SDK (`Template.build`), end to end: a start
command, local files copied in, a failing step named, the step cache on a rebuild, tags, the
base image alias and /tmp, /tmp as part of the files. Sandboxes are created from the results
and inspected. The images come from a loopback registry (template_images.py): a busybox-static
rootfs without Python or glibc, the same with a non-root image user.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from e2b import Sandbox, Template
from e2b.exceptions import BuildException

from .conftest import Server
from .oci_layouts import NEEDS_REGISTRY
from .template_images import (
    Images,
    build_sandboxes,
    delete_template,
    images,
    unique,
)

pytestmark = [pytest.mark.integration, NEEDS_REGISTRY]

__all__ = ["images"]  # a fixture used here, imported for pytest to find


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
