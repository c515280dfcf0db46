"""The runtime's subreaper: orphans of the processes it starts come to it while it runs,
and to nobody here once it closed (a test session that ran a runtime in-process must not go
on adopting the orphans of the servers it starts and never reap them)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

from aenv.runtime._proc import proc_stat
from aenv.runtime.gvisor.reaping import Reaper


def orphan() -> int:
    """A `sleep` whose parent shell has exited: the pid of an orphan."""
    out = subprocess.run(
        ["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True
    )
    return int(out.stdout)


def parent_of(pid: int) -> int:
    st = proc_stat(pid)
    assert st is not None
    return st.ppid


async def test_orphans_come_to_a_started_reaper_and_no_longer_once_it_closed() -> None:
    reaper = Reaper()
    reaper.start()
    try:
        adopted = orphan()
        assert parent_of(adopted) == os.getpid()
    finally:
        await reaper.close()
    os.kill(adopted, signal.SIGKILL)
    await asyncio.to_thread(os.waitpid, adopted, 0)  # ours, adopted while the reaper ran

    later = orphan()
    try:
        assert parent_of(later) != os.getpid()
    finally:
        os.kill(later, signal.SIGKILL)
