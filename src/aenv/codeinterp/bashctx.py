"""A bash context: one persistent bash process; each execution is sourced into it.

Sourcing (not a subshell) keeps variables, functions, aliases and the working directory from
one execution to the next. The end of an execution is a per-context random marker that the
shell prints on stdout (with the exit status) and on stderr after the code ran; output is
streamed line by line as it arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import uuid
from collections.abc import AsyncIterator

from . import events
from .events import Event

READ_SIZE = 64 * 1024


class BashContext:
    language = "bash"

    def __init__(self, context_id: str, cwd: str, env: dict[str, str], run_dir: str) -> None:
        self.id = context_id
        self.cwd = cwd
        self.env = env
        self.script = os.path.join(run_dir, f"bash-{context_id}.sh")
        self.marker = "__aenv_end_" + uuid.uuid4().hex
        self._end_out = re.compile(re.escape(self.marker).encode() + rb" (-?\d+)\n")
        self._end_err = (self.marker + "\n").encode()
        self.lock = asyncio.Lock()
        self.count = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        self.readers: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self.queue = asyncio.Queue()
        self.proc = await asyncio.create_subprocess_exec(
            "bash",
            "--login",
            "-s",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=self.cwd,
            env=self.env,
            start_new_session=True,
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.readers = [
            asyncio.create_task(self._read("stdout", self.proc.stdout)),
            asyncio.create_task(self._read("stderr", self.proc.stderr)),
        ]

    async def _read(self, name: str, stream: asyncio.StreamReader) -> None:
        while True:
            data = await stream.read(READ_SIZE)
            await self.queue.put((name, data))
            if not data:
                return

    async def execute(self, code: str, envs: dict[str, str]) -> AsyncIterator[Event]:
        if self.proc is None or self.proc.returncode is not None:
            await self.restart()
        self.count += 1
        yield events.count(self.count)
        async for ev in self._run(code, envs):
            yield ev

    async def setenv(self, envs: dict[str, str]) -> None:
        """Exports `envs` in the shell for good (not counted as an execution)."""
        if self.proc is None or self.proc.returncode is not None:
            await self.restart()
        script = "".join(f"export {k}={events.shell_quote(v)}\n" for k, v in envs.items())
        async for _ev in self._run(script, {}):
            pass

    async def _run(self, code: str, envs: dict[str, str]) -> AsyncIterator[Event]:
        assert self.proc is not None and self.proc.stdin is not None
        fd = os.open(self.script, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(code if code.endswith("\n") else code + "\n")
        try:
            self.proc.stdin.write(events.bash_script(self.script, envs, self.marker).encode())
            await self.proc.stdin.drain()
        except (ConnectionError, OSError):
            pass  # the shell is gone: the readers' EOF says so below
        bufs = {"stdout": b"", "stderr": b""}
        open_ = {"stdout", "stderr"}
        status: int | None = None
        while open_:
            name, data = await self.queue.get()
            if not data:
                open_.clear()
                break
            bufs[name] += data
            buf = bufs[name]
            if name == "stdout":
                m = self._end_out.search(buf)
                if m:
                    status = int(m.group(1))
                    text, bufs[name] = buf[: m.start()], buf[m.end() :]
                    open_.discard(name)
                else:
                    cut = buf.rfind(b"\n") + 1
                    text, bufs[name] = buf[:cut], buf[cut:]
            else:
                i = buf.find(self._end_err)
                if i >= 0:
                    text, bufs[name] = buf[:i], buf[i + len(self._end_err) :]
                    open_.discard(name)
                else:
                    cut = buf.rfind(b"\n") + 1
                    text, bufs[name] = buf[:cut], buf[cut:]
            if text:
                yield events.stream(name, text.decode("utf-8", "replace"))
        if status is None:
            # The shell exited (`exit`, a crash): what it printed, then the error.
            for name in ("stdout", "stderr"):
                if bufs[name]:
                    yield events.stream(name, bufs[name].decode("utf-8", "replace"))
            rc = await self._reap()
            yield events.error(
                "ContextRestarting",
                f"the bash process of this context exited (status {rc}); it is restarted",
                "",
            )
            await self.restart()
        elif status != 0:
            yield events.error("ExitCode", str(status), f"the code exited with status {status}")

    async def _reap(self) -> int | None:
        if self.proc is None:
            return None
        with contextlib.suppress(ProcessLookupError, asyncio.TimeoutError):
            return await asyncio.wait_for(self.proc.wait(), 5)
        return self.proc.returncode

    async def interrupt(self) -> None:
        """The code runs in the shell itself, so stopping it ends the shell (the running
        execution reports it; the next one gets a new shell)."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    async def restart(self) -> None:
        await self.close()
        self.count = 0
        await self.start()

    async def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.wait(), 5)
        for t in self.readers:
            t.cancel()
        self.readers = []
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.script)
