"""QEMU's machine protocol (QMP) over the VM's unix socket: one connection per call, so a
server restart or a concurrent caller never finds a half-read stream; each call is a
capabilities handshake and one command (a few ms)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from aenv.errors import RuntimeFailure


async def call(socket: Path, command: str, timeout: float = 30.0, **arguments: Any) -> Any:
    """Runs `command` and returns its `return` value; QEMU's error becomes `RuntimeFailure`."""
    try:
        return await asyncio.wait_for(_call(socket, command, arguments), timeout)
    except TimeoutError:
        raise RuntimeFailure(f"qemu {command}: no answer in {timeout:.0f}s") from None
    except (OSError, ValueError, asyncio.IncompleteReadError) as e:
        raise RuntimeFailure(f"qemu {command}: {e}") from e


async def _call(socket: Path, command: str, arguments: dict[str, Any]) -> Any:
    reader, writer = await asyncio.open_unix_connection(str(socket), limit=1 << 20)
    try:
        await _answer(reader)  # the greeting
        writer.write(b'{"execute": "qmp_capabilities"}\n')
        await _answer(reader)
        msg: dict[str, Any] = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        writer.write(json.dumps(msg).encode() + b"\n")
        await writer.drain()
        reply = await _answer(reader)
    finally:
        writer.close()
    if "error" in reply:
        raise RuntimeFailure(f"qemu {command}: {reply['error'].get('desc', reply['error'])}")
    return reply.get("return")


async def _answer(reader: asyncio.StreamReader) -> dict[str, Any]:
    """The next line that is not an asynchronous event."""
    while True:
        line = await reader.readline()
        if not line:
            raise ValueError("QMP connection closed")
        msg = json.loads(line)
        if "event" not in msg:
            return dict(msg)


async def wait_migration(socket: Path, timeout: float = 600.0) -> None:
    """Until an outgoing or incoming migration completed; its error otherwise."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    delay = 0.002
    while True:
        info = await call(socket, "query-migrate") or {}
        status = info.get("status")
        if status == "completed":
            return
        if status in ("failed", "cancelled"):
            raise RuntimeFailure(f"qemu migration {status}: {info.get('error-desc', '')}")
        if loop.time() > end:
            raise RuntimeFailure(f"qemu migration not done after {timeout:.0f}s ({status})")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)


async def status(socket: Path) -> str:
    """The VM's run state: "running", "paused", "postmigrate", "inmigrate", ..."""
    info = await call(socket, "query-status", timeout=10.0) or {}
    return str(info.get("status", ""))
