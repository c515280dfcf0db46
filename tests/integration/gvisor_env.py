"""The gVisor backend's test environment: busybox rootfs layers and sandbox specs (`httpd` on
port 49983 serving `/`, so GET /tmp/counter reads a file; a CGI `/cgi-bin/run` that runs the
POSTed shell command; a counter loop in the background), writable upper dirs, the host's
traces of a prefix (netns, links, iptables chains, containers, mounts, cgroups), and a started
runtime with a net prefix/range of this session's (tests/netplan.py) and a temporary
AENV_HOME, purged and checked gone afterwards. The module-scoped fixtures `rootfs`,
`upper_layer` and `runtime` are imported by the test modules for pytest to find.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from aenv.config import Settings
from aenv.runtime.base import Instance, SandboxSpec
from aenv.runtime.gvisor import GVisorRuntime
from aenv.runtime.gvisor.container import Container
from aenv.runtime.net.network import SlotAddressing
from aenv.runtime.rootfs import mount_points
from tests import netplan

PREFIX, CIDR = netplan.slot_net("rgv").prefix, netplan.slot_net("rgv").cidr
RECONCILE_PREFIX, RECONCILE_CIDR = netplan.slot_net("rrc").prefix, netplan.slot_net("rrc").cidr
EXT_NS, EXT_IF = netplan.name("ext"), netplan.name("ext0")
EXT_HOST, EXT_PEER = netplan.link(1).host, netplan.link(1).peer
PORT = 49983
MiB = 1024 * 1024

INIT = [
    "/bin/sh",
    "-c",
    "i=0; while :; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.1; done & "
    f"exec httpd -f -p {PORT} -h /",
]
CGI = """#!/bin/sh
echo "Content-Type: text/plain"
echo ""
sh -c "$(head -c "$CONTENT_LENGTH")" 2>&1
"""

TIMINGS: dict[str, list[float]] = {}


def timed(name: str, seconds: float) -> None:
    TIMINGS.setdefault(name, []).append(seconds * 1000)


# Rootfs and layers --------------------------------------------------------------------------


def make_rootfs(dest: Path) -> Path:
    for d in ("bin", "etc", "www", "tmp", "proc", "sys", "dev", "root", "cgi-bin"):
        (dest / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2("/bin/busybox", dest / "bin" / "busybox")
    names = subprocess.run(
        ["/bin/busybox", "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    for name in names:
        if name != "busybox":
            (dest / "bin" / name).symlink_to("busybox")
    (dest / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (dest / "etc" / "group").write_text("root:x:0:\n")
    (dest / "etc" / "hosts").write_text("127.0.0.1 localhost\n")
    (dest / "www" / "index.html").write_text("hello from aenv\n")
    cgi = dest / "cgi-bin" / "run"
    cgi.write_text(CGI)
    cgi.chmod(0o755)
    (dest / "tmp").chmod(0o1777)
    return dest


def tree_digest(root: Path) -> dict[str, tuple[int, int]]:
    """Path -> (size, mtime_ns) of every entry, to prove a layer was not written."""
    out = {}
    for p in root.rglob("*"):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_rootfs(tmp_path_factory.mktemp("layer-base"))


@pytest.fixture(scope="module")
def upper_layer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("layer-upper")
    (d / "www").mkdir()
    (d / "www" / "extra.html").write_text("from the upper layer\n")
    (d / "etc").mkdir()
    (d / "etc" / "layer-marker").write_text("upper\n")
    return d


def rec(inst: Instance) -> Container:
    """The gVisor record behind a handle (its slot, bundle dir, rootfs key...)."""
    return Container.of(inst)


def spec(layers: list[Path], sandbox_id: str, **kw: object) -> SandboxSpec:
    s = SandboxSpec(sandbox_id=sandbox_id, layers=layers, args=INIT, memory_mb=256, cpu_count=1)
    for k, v in kw.items():
        setattr(s, k, v)
    return s


# Host inspection and cleanup -----------------------------------------------------------------


def host_traces(settings: Settings) -> dict[str, list[str]]:
    """Everything of this prefix/home still on the host."""
    addr = SlotAddressing.from_settings(settings)
    netns = (
        sorted(n for n in os.listdir("/run/netns") if addr.parse_netns(n) is not None)
        if Path("/run/netns").is_dir()
        else []
    )
    links = sorted(n for n in os.listdir("/sys/class/net") if addr.parse_host_if(n) is not None)
    rules = subprocess.run(
        "iptables -S; iptables -t nat -S", shell=True, capture_output=True, text=True
    ).stdout
    chains = sorted({line for line in rules.splitlines() if f"{settings.net_prefix}-" in line})
    containers = []
    if settings.runsc_root.is_dir():
        out = subprocess.run(
            ["runsc", f"--root={settings.runsc_root}", "list", "--format=json"],
            capture_output=True,
            text=True,
        ).stdout
        containers = [c["id"] for c in json.loads(out or "null") or []]
    mounts = [str(p) for p in mount_points(settings.home)]
    cgroups = [
        str(p) for p in Path("/sys/fs/cgroup").glob(f"*/{settings.net_prefix}/*") if p.is_dir()
    ]
    return {
        "netns": netns,
        "links": links,
        "rules": chains,
        "containers": containers,
        "mounts": mounts,
        "cgroups": cgroups,
    }


def assert_no_traces(settings: Settings) -> None:
    traces = host_traces(settings)
    assert all(not v for v in traces.values()), traces


def slot_traces(settings: Settings, slot: int) -> list[str]:
    addr = SlotAddressing.from_settings(settings)
    names = []
    for ns in (addr.router_ns(slot), addr.inner_ns(slot)):
        if Path("/run/netns", ns).exists():
            names.append(ns)
    if Path("/sys/class/net", addr.host_if(slot)).exists():
        names.append(addr.host_if(slot))
    return names


def make_settings(home: Path, prefix: str, cidr: str, pool: int = 2) -> Settings:
    return Settings(home=home, net_prefix=prefix, net_cidr=cidr, net_pool_size=pool)


@contextlib.asynccontextmanager
async def started_runtime(home: Path, prefix: str, cidr: str) -> AsyncIterator[GVisorRuntime]:
    """A started runtime with a prefix of its own; all it made is purged, and checked gone."""
    settings = make_settings(home, prefix, cidr)
    rt = GVisorRuntime(settings)
    try:
        await rt.start(set())
        yield rt
    finally:
        await GVisorRuntime(settings).purge()
        assert_no_traces(settings)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runtime(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GVisorRuntime]:
    async with started_runtime(tmp_path_factory.mktemp("aenv-home"), PREFIX, CIDR) as rt:
        yield rt
    if TIMINGS:
        print("\n\ngVisor runtime timings (ms):")
        for name, values in TIMINGS.items():
            vals = ", ".join(f"{v:.0f}" for v in values)
            print(f"  {name:<28} median {sorted(values)[len(values) // 2]:7.1f}   [{vals}]")
        TIMINGS.clear()  # each module's runtime reports its own


def _pool_slots(rt: GVisorRuntime) -> set[int]:
    return {s.index for s in rt.pool._ready}


# Writable host overlays (spec.upper), stop and re-stack --------------------------------------

# The counter goes to the rootfs (/root/counter) and to /tmp (/tmp/counter): both land in the
# host upper dir (/tmp is the rootfs's own, bound over /tmp).
INIT_RW = [
    "/bin/sh",
    "-c",
    "i=0; while :; do i=$((i+1)); echo $i > /root/counter; echo $i > /tmp/counter; "
    "sleep 0.1; done & "
    f"exec httpd -f -p {PORT} -h /",
]


def rw_spec(layers: list[Path], sandbox_id: str, upper: Path, **kw: object) -> SandboxSpec:
    return spec(layers, sandbox_id, args=INIT_RW, upper=upper, **kw)


def new_upper(root: Path, name: str) -> Path:
    d = root / "uppers" / name
    d.mkdir(parents=True)
    return d


def work_dirs(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("work-*"))


# Reconcile after a crash --------------------------------------------------------------------------


def crash(rt: GVisorRuntime) -> None:
    """Drops a runtime like a killed process would: no cleanup, pool slots left behind."""
    for task in (rt.pool._task, rt.reaper.sweep._task):
        if task is not None:
            task.cancel()
    rt.pool._task = None
    rt.reaper.sweep._task = None
