"""The memory guard on a real cgroup v1 memory controller (root on this host's kind): a
process in a guarded cgroup that passes the size is reported at once, the limit is the size
plus headroom, and an out-of-memory stall is met with rescue room instead of a kill."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from aenv.runtime import memguard
from aenv.runtime.freezer import CGROUP_ROOT

MIB = 1 << 20
MEMORY = CGROUP_ROOT / "memory"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (MEMORY / "cgroup.event_control").exists(),
    reason="needs root and a cgroup v1 memory controller",
)

# Touches `n` MiB, 8 at a time, reporting each step; then waits to be killed.
HOG = (
    "import sys, time\n"
    "chunks = []\n"
    "for i in range(int(sys.argv[1]) // 8):\n"
    "    b = bytearray(8 << 20)\n"
    "    b[::4096] = b'x' * len(b[::4096])\n"
    "    chunks.append(b)\n"
    "print('allocated', flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def cgroup() -> Iterator[str]:
    rel = f"aenv-test-memguard-{os.getpid()}"
    d = MEMORY / rel
    d.mkdir()
    (d / "memory.limit_in_bytes").write_text(str(64 * MIB))  # as runsc would: the size
    try:
        yield "/" + rel
    finally:
        for pid in (d / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                os.kill(int(pid), 9)
        for _ in range(50):
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.1)  # its last task is still exiting


async def test_passing_the_size_is_reported_and_the_limit_has_headroom(cgroup: str) -> None:
    told: list[str] = []
    guard = memguard.MemoryGuard(told.append)
    assert await guard.arm("c1", cgroup, 64 * MIB)
    d = MEMORY / cgroup.strip("/")
    assert int((d / "memory.limit_in_bytes").read_text()) == (64 + 128) * MIB
    assert "oom_kill_disable 1" in (d / "memory.oom_control").read_text()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        HOG,
        "96",
        stdout=subprocess.PIPE,
        preexec_fn=lambda: (d / "cgroup.procs").write_text(str(os.getpid())),
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.strip() == b"allocated"  # 96 MiB in a 64 MiB sandbox: not killed by the host
        for _ in range(100):
            if told:
                break
            await asyncio.sleep(0.05)
        assert told and set(told) == {"c1"}
    finally:
        proc.kill()
        await proc.wait()
        guard.close()


async def test_out_of_memory_gets_rescue_room_then_the_kernel_killer(cgroup: str) -> None:
    told: list[str] = []
    guard = memguard.MemoryGuard(told.append)
    assert await guard.arm("c1", cgroup, 64 * MIB)
    d = MEMORY / cgroup.strip("/")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        HOG,
        "1024",  # far past size + headroom + every rescue: nobody kills it here
        stdout=subprocess.PIPE,
        preexec_fn=lambda: (d / "cgroup.procs").write_text(str(os.getpid())),
    )
    try:
        code = await asyncio.wait_for(proc.wait(), 60)
        assert code == -9  # the kernel's killer, given back after the rescues
        limit = int((d / "memory.limit_in_bytes").read_text())
        assert limit == (64 + 128) * MIB + memguard.RESCUES * memguard.RESCUE_BYTES
        assert len(told) >= memguard.RESCUES
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        guard.close()
