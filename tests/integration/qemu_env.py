"""The QEMU backend's test environment: settings for a runtime of its own (net prefix and
range of this session's, a temporary home), whether this host can run it, and the host's
traces of it (QEMU processes, RAM files, VM dirs) besides the network's."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

from aenv.config import Settings
from aenv.runtime.qemu import QemuRuntime

from .gvisor_env import host_traces

GUEST_DIR = Settings().qemu_guest_dir


def missing() -> str | None:
    """Why the QEMU backend cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("qemu-system-x86_64") is None:
        return "needs qemu-system-x86 (make install)"
    if not (GUEST_DIR / "vmlinuz").exists():
        return "needs the guest kernel (make install: scripts/install-guest-kernel.sh)"
    if not Path("/bin/busybox").exists():
        return "needs busybox-static"
    return None


def make_settings(home: Path, prefix: str, cidr: str, pool: int = 2) -> Settings:
    return Settings(home=home, net_prefix=prefix, net_cidr=cidr, net_pool_size=pool, runtime="qemu")


def qemu_processes(settings: Settings) -> list[int]:
    """QEMU processes whose VM dirs are under this settings' home."""
    found = []
    needle = str(settings.home / "qemu").encode()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in (d / "cmdline").read_bytes():
                    found.append(int(d.name))
    return found


def assert_no_traces(settings: Settings) -> None:
    traces = {k: v for k, v in host_traces(settings).items() if k != "containers"}
    traces["qemu"] = [str(p) for p in qemu_processes(settings)]
    ram = Path("/dev/shm") / f"aenv-{settings.net_prefix}"
    traces["ram"] = [str(ram)] if ram.exists() else []
    vms = settings.home / "qemu" / "vms"
    traces["vms"] = [str(p) for p in vms.iterdir()] if vms.is_dir() else []
    assert all(not v for v in traces.values()), traces


@contextlib.asynccontextmanager
async def started_runtime(home: Path, prefix: str, cidr: str) -> AsyncIterator[QemuRuntime]:
    settings = make_settings(home, prefix, cidr)
    rt = QemuRuntime(settings)
    try:
        await rt.start(set())
        yield rt
    finally:
        await QemuRuntime(settings).purge()
        assert_no_traces(settings)
