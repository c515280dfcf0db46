"""The node waits for its child processes through pidfds on its loop (`server.py`): commands
started after it still report their exit status, and no thread is started per child."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from aenv.serving import watch_children_by_pidfd

pytestmark = pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12 does it already")


async def test_children_exit_statuses_arrive_without_a_thread_each() -> None:
    before = asyncio.get_child_watcher()
    try:
        watch_children_by_pidfd()
        assert isinstance(asyncio.get_child_watcher(), asyncio.PidfdChildWatcher)
        threads = threading.active_count()
        procs = [
            await asyncio.create_subprocess_exec("sh", "-c", f"sleep 0.3; exit {n}")
            for n in range(5)
        ]
        assert threading.active_count() == threads
        assert [await p.wait() for p in procs] == [0, 1, 2, 3, 4]
    finally:
        asyncio.get_child_watcher().close()
        asyncio.set_child_watcher(before)
