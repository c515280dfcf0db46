"""What build steps do inside a build sandbox, over envd (no tools needed in the image but
`/bin/sh`; COPY runs envd's own bundled Python)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from ..envd_client import EnvdClient, ProcessEvent

# Where a COPY step's archive is put inside the sandbox (removed again by the helper).
COPY_DIR = "/.aenv-build"
_HELPER = Path(__file__).with_name("copy_in_sandbox.py")
_CHUNK = 1 << 20
MAX_LINE = 4000
# RUN steps run as Docker runs them; startCmd and readyCmd as E2B runs them, in a login
# bash (envd falls back to `/bin/sh -l -c` in an image without bash).
RUN_SHELL = ("/bin/sh", "-c")
LOGIN_SHELL = ("/bin/bash", "-l", "-c")


class LineSplitter:
    """Turns output chunks into lines per stream (a partial line waits for its end)."""

    def __init__(self, emit: Callable[[str, str], None]) -> None:
        self._emit = emit
        self._buf: dict[str, bytes] = {}

    def feed(self, stream: str, data: bytes) -> None:
        buf = self._buf.get(stream, b"") + data
        *lines, rest = buf.split(b"\n")
        for line in lines:
            self._out(stream, line)
        if len(rest) > MAX_LINE:
            self._out(stream, rest)
            rest = b""
        self._buf[stream] = rest

    def flush(self) -> None:
        for stream, rest in list(self._buf.items()):
            if rest:
                self._out(stream, rest)
        self._buf.clear()

    def _out(self, stream: str, line: bytes) -> None:
        text = line.decode("utf-8", "replace").rstrip("\r")
        self._emit(stream, text[:MAX_LINE])


async def run_shell(
    rpc: EnvdClient,
    command: str,
    *,
    user: str | None,
    env: dict[str, str],
    cwd: str | None,
    timeout: float | None,
    on_line: Callable[[str, str], None] | None = None,
    shell: tuple[str, ...] = RUN_SHELL,
) -> ProcessEvent:
    lines = LineSplitter(on_line or (lambda _s, _l: None))
    try:
        return await rpc.run(
            shell[0],
            [*shell[1:], command],
            user=user,
            envs=env,
            cwd=cwd,
            timeout=timeout,
            on_output=lines.feed,
        )
    finally:
        lines.flush()


async def _file_chunks(path: Path) -> AsyncIterator[bytes]:
    f = await asyncio.to_thread(path.open, "rb")
    try:
        while chunk := await asyncio.to_thread(f.read, _CHUNK):
            yield chunk
    finally:
        await asyncio.to_thread(f.close)


async def copy_files(
    rpc: EnvdClient,
    archive: Path,
    files_hash: str,
    *,
    python: list[str],
    python_env: dict[str, str],
    src: str,
    dest: str,
    owner: str,
    mode: str,
    workdir: str | None,
    on_line: Callable[[str, str], None] | None = None,
) -> ProcessEvent:
    """Uploads the step's archive and unpacks `src` of it to `dest` (Docker semantics)."""
    target = f"{COPY_DIR}/{files_hash}.tar"
    await rpc.upload(target, _file_chunks(archive), user="root")
    spec: dict[str, Any] = {
        "tar": target,
        "src": src,
        "dest": dest,
        "owner": owner,
        "mode": mode,
        "workdir": workdir or "/",
    }
    script = await asyncio.to_thread(_HELPER.read_text)
    lines = LineSplitter(on_line or (lambda _s, _l: None))
    try:
        return await rpc.run(
            python[0],
            [*python[1:], "-c", script, json.dumps(spec)],
            user="root",
            envs=python_env,
            cwd="/",
            timeout=3600,
            on_output=lines.feed,
        )
    finally:
        lines.flush()


class Background:
    """A process started and followed in the background (the template's startCmd)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.pid = 0
        self.end: ProcessEvent | None = None
        self.error: str | None = None
        self._task: asyncio.Task[None] | None = None

    def start(
        self,
        rpc: EnvdClient,
        command: str,
        *,
        user: str | None,
        env: dict[str, str],
        cwd: str | None,
        on_line: Callable[[str, str], None],
    ) -> None:
        async def follow() -> None:
            lines = LineSplitter(on_line)
            try:
                async for ev in rpc.process(
                    LOGIN_SHELL[0], [*LOGIN_SHELL[1:], command], user=user, envs=env, cwd=cwd
                ):
                    if ev.kind == "start":
                        self.pid = ev.pid
                        self.started.set()
                    elif ev.kind in ("stdout", "stderr"):
                        lines.feed(ev.kind, ev.data)
                    elif ev.kind == "end":
                        self.end = ev
            except Exception as e:  # noqa: BLE001 (reported through `error`)
                self.error = str(getattr(e, "message", e))
            finally:
                lines.flush()
                self.started.set()

        self._task = asyncio.create_task(follow())

    @property
    def ended(self) -> bool:
        return self.end is not None or self.error is not None

    async def detach(self) -> None:
        """Stops following (the process keeps running in the sandbox)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
