"""Cold starts from images, the pull/build CLI, and the layer cache bound, end to end: a
sandbox cold-started from a registry image (its env, workdir, user and command), `aenv
template pull` and `build` against the session's server, and a second node with a tiny layer
cache that evicts under a running sandbox. The images come from a loopback registry
(template_images.py).
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from e2b import Sandbox

from tests import netplan

from .conftest import AENV, TEST_REGISTRY, Server, running_server
from .oci_layouts import NEEDS_REGISTRY
from .template_images import (
    CACHE_LAYER_BYTES,
    Images,
    delete_template,
    images,
    unique,
)

pytestmark = [pytest.mark.integration, NEEDS_REGISTRY]

__all__ = ["images"]  # a fixture used here, imported for pytest to find


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
