"""The image's files (deploy/docker/): the Dockerfile's packages, entrypoint and build
context, and the entrypoint script's cgroup preparation for a node, run against a stand-in
cgroup tree."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"


def _instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n(\s*#.*\n)*", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def _stages(steps: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """The Dockerfile's instructions by stage name (`FROM x AS name`)."""
    out: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for op, rest in steps:
        if op == "FROM":
            current = out.setdefault(rest.split()[-1], [])
        current.append((op, rest))
    return out


def _runs(stage: list[tuple[str, str]]) -> str:
    return " ".join(rest for op, rest in stage if op == "RUN")


def test_dockerfile_builds_anywhere_and_keeps_build_tools_out_of_the_images() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    steps = _instructions(text)
    stages = _stages(steps)
    assert list(stages) == ["debian", "build", "gateway", "node"]  # node: the default target
    # The base image and the Debian archive are the builder's to choose (no Docker Hub).
    assert steps[0] == ("ARG", "BASE_IMAGE=debian:bookworm-slim")
    assert stages["debian"][0] == ("FROM", "${BASE_IMAGE} AS debian")
    assert "ARG DEBIAN_MIRROR=" in text and '"URIs: ${DEBIAN_MIRROR}"' in text
    for name in ("build", "gateway", "node"):
        assert stages[name][0][1].startswith("debian AS ")
    # Python packages pinned, with hashes, by the lock; the console's by its package-lock.
    build = _runs(stages["build"])
    assert "--require-hashes" in build and "-r /tmp/requirements.lock" in build
    assert "npm ci" in build and re.search(r"\bgcc\b", build)
    for image in ("gateway", "node"):
        runs = _runs(stages[image])
        for tool in ("gcc", "libc6-dev", "npm", "nodejs", "python3-venv"):
            assert not re.search(rf"\b{tool}\b", runs), (image, tool)
        assert ("COPY", "--from=build /opt/aenv /opt/aenv") in stages[image]
    node = _runs(stages["node"])
    assert re.search(r"-t bookworm-backports\s+runsc", node)
    for pkg in ("iproute2", "iptables", "nftables", "e2fsprogs", "debootstrap", "tini"):
        assert re.search(rf"\b{pkg}\b", node), pkg
    assert ("CMD", '["server"]') in stages["node"]
    entry = next(rest for op, rest in stages["node"] if op == "ENTRYPOINT")
    assert entry == '["/usr/bin/tini", "--", "/usr/local/bin/aenv-entrypoint"]'
    # The gateway: no sandbox tooling, and not root.
    gateway = _runs(stages["gateway"])
    assert "runsc" not in gateway and "iptables" not in gateway
    assert ("USER", "10001:10001") in stages["gateway"]
    assert ("CMD", '["gateway"]') in stages["gateway"]
    # What it copies exists and is let through .dockerignore's allowlist.
    allowed = [
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    for op, rest in steps:
        if op == "COPY" and not rest.startswith("--from="):
            for src in rest.split()[:-1]:
                assert (ROOT / src).exists(), src
                assert any(src.rstrip("/") == a or src.startswith(a + "/") for a in allowed), src
    assert os.access(DOCKER / "entrypoint.sh", os.X_OK)


def test_the_lock_pins_every_dependency_with_hashes() -> None:
    lock = (DOCKER / "requirements.lock").read_text()
    pinned = {
        m.group(1).lower().replace("_", "-")
        for m in re.finditer(r"^([A-Za-z0-9_.-]+)==\S+", lock, re.MULTILINE)
    }
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    build = pyproject["build-system"]["requires"]
    # the image builds the project without build isolation, from the lock's own tools
    listed = (DOCKER / "build-system.in").read_text().split("\n")
    assert sorted(build) == sorted(x for x in listed if x and not x.startswith("#"))
    wanted = (
        list(project["dependencies"])
        + list(project.get("optional-dependencies", {}).get("server", []))
        + list(build)
    )
    for req in wanted:
        name = re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0].lower().replace("_", "-")
        assert name in pinned, f"{name} is not in deploy/docker/requirements.lock (make lock)"
    # every pin carries hashes (pip's --require-hashes refuses the lock otherwise)
    entries = re.split(r"\n(?=[A-Za-z0-9])", lock)
    for entry in entries:
        if re.match(r"[A-Za-z0-9_.-]+==", entry):
            assert "--hash=sha256:" in entry, entry.splitlines()[0]


def _fake_cgroup(tmp_path: Path, *, v2: bool, self_cgroup: str) -> dict[str, str]:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.procs").write_text("1\n7\n")
    (root / "cgroup.subtree_control").write_text("")
    if v2:
        (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (tmp_path / "self").write_text(self_cgroup + "\n")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "aenv").write_text('#!/bin/sh\necho "aenv $*"\n')
    (bindir / "aenv").chmod(0o755)
    return {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "AENV_CGROUP_ROOT": str(root),
        "AENV_SELF_CGROUP": str(tmp_path / "self"),
    }


def _entrypoint(env: dict[str, str], *args: str) -> str:
    proc = subprocess.run(
        ["sh", str(DOCKER / "entrypoint.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_entrypoint_delegates_cgroup_controllers_to_a_node(tmp_path: Path) -> None:
    env = _fake_cgroup(tmp_path, v2=True, self_cgroup="0::/")
    assert _entrypoint(env, "server") == "aenv server\n"
    root = Path(env["AENV_CGROUP_ROOT"])
    assert (root / "aenv-init" / "cgroup.procs").read_text().split() == ["1", "7"]
    assert (root / "cgroup.subtree_control").read_text().split() == [
        "+cpuset",
        "+cpu",
        "+io",
        "+memory",
        "+pids",
    ]


@pytest.mark.parametrize(
    ("v2", "self_cgroup", "args"),
    [
        (True, "0::/", ("gateway",)),  # not a node
        (True, "0::/kubepods/pod1/abc", ("server",)),  # the host's cgroup namespace
        (False, "0::/", ("server",)),  # cgroup v1
    ],
)
def test_entrypoint_leaves_cgroups_alone_otherwise(
    tmp_path: Path, v2: bool, self_cgroup: str, args: tuple[str, ...]
) -> None:
    env = _fake_cgroup(tmp_path, v2=v2, self_cgroup=self_cgroup)
    assert _entrypoint(env, *args, "--flag") == f"aenv {' '.join(args)} --flag\n"
    root = Path(env["AENV_CGROUP_ROOT"])
    assert not (root / "aenv-init").exists()
    assert (root / "cgroup.subtree_control").read_text() == ""


@pytest.mark.parametrize(
    ("self_cgroup", "group"),
    [
        ("0::/", "memory.oom.group"),  # a private cgroup namespace: the container is the root
        ("0::/kubepods/pod1/abc", "kubepods/pod1/abc/memory.oom.group"),  # the host's
    ],
)
def test_entrypoint_turns_off_the_oom_group_kill_for_a_node(
    tmp_path: Path, self_cgroup: str, group: str
) -> None:
    env = _fake_cgroup(tmp_path, v2=True, self_cgroup=self_cgroup)
    root = Path(env["AENV_CGROUP_ROOT"])
    path = root / group
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("1\n")
    gateway = dict(env)
    assert _entrypoint(gateway, "gateway") == "aenv gateway\n"
    assert path.read_text() == "1\n"  # a gateway's container is left as it is
    assert _entrypoint(env, "server") == "aenv server\n"
    assert path.read_text() == "0\n"
