"""A python context: an IPython kernel (Debian's python3-ipykernel) driven through
jupyter_client, its iopub messages turned into `/execute` events (`events.Tracker`).

The kernel listens on unix sockets (`ipc` transport) in the server's run directory rather
than loopback TCP: nothing else in the sandbox can reach them by port, and they are plain
files across checkpoints (pause, snapshots, fork).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
from collections.abc import AsyncIterator
from typing import Any

from . import events
from .events import Event

READY_TIMEOUT = 120.0
POLL = 1.0
# Figures are shown as PNG (inline backend; also at the end of a cell without plt.show()).
SETUP_CODE = "%matplotlib inline\n"


class PythonContext:
    language = "python"

    def __init__(self, context_id: str, cwd: str, env: dict[str, str], run_dir: str) -> None:
        self.id = context_id
        self.cwd = cwd
        self.env = {
            **env,
            "MPLBACKEND": "module://matplotlib_inline.backend_inline",
            # debugpy (an ipykernel dependency) warns about frozen modules at every start.
            "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        }
        self.ipc = os.path.join(run_dir, f"kernel-{context_id}")
        self.lock = asyncio.Lock()
        self.km: Any = None
        self.kc: Any = None

    async def start(self) -> None:
        from jupyter_client.manager import AsyncKernelManager

        self.km = AsyncKernelManager(kernel_name="python3", transport="ipc", ip=self.ipc)
        await self.km.start_kernel(cwd=self.cwd, env=self.env)
        await self._connect()

    async def _connect(self) -> None:
        self.kc = self.km.client()
        self.kc.start_channels()
        await self.kc.wait_for_ready(timeout=READY_TIMEOUT)
        await self.silent(SETUP_CODE)

    async def silent(self, code: str) -> dict[str, Any]:
        """Runs code without output or history; returns the reply's content."""
        msg_id = self.kc.execute(code, silent=True, store_history=False, allow_stdin=False)
        return await self._reply(msg_id)

    async def _reply(self, msg_id: str) -> dict[str, Any]:
        while True:
            msg = await self.kc.get_shell_msg(timeout=None)
            if (msg.get("parent_header") or {}).get("msg_id") == msg_id:
                return dict(msg.get("content") or {})

    async def setenv(self, envs: dict[str, str]) -> None:
        """Sets `envs` in the kernel for good."""
        await self.silent(f"import os as _aenv_os\n_aenv_os.environ.update({envs!r})\n")

    async def execute(self, code: str, envs: dict[str, str]) -> AsyncIterator[Event]:
        if envs:
            await self.silent(events.python_env_push(envs))
        try:
            msg_id = self.kc.execute(
                code, silent=False, store_history=True, allow_stdin=False, stop_on_error=True
            )
            tracker = events.Tracker(msg_id)
            while not tracker.done:
                try:
                    msg = await self.kc.get_iopub_msg(timeout=POLL)
                except queue.Empty:
                    if not await self.km.is_alive():
                        yield events.error(
                            "ContextRestarting",
                            "the kernel of this context died; it is restarted",
                            "",
                        )
                        await self.restart()
                        return
                    continue
                for ev in tracker.feed(msg):
                    yield ev
            await self._reply(msg_id)
        finally:
            if envs and self.km is not None:
                with contextlib.suppress(Exception):
                    await self.silent(events.python_env_pop())

    async def interrupt(self) -> None:
        with contextlib.suppress(Exception):
            await self.km.interrupt_kernel()

    async def restart(self) -> None:
        if self.kc is not None:
            self.kc.stop_channels()
        await self.km.restart_kernel(now=True)
        await self._connect()

    async def close(self) -> None:
        if self.kc is not None:
            with contextlib.suppress(Exception):
                self.kc.stop_channels()
        if self.km is not None:
            with contextlib.suppress(Exception):
                await self.km.shutdown_kernel(now=True)
        self.km = self.kc = None
