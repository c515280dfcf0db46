"""A small async wrapper around the `runsc` CLI (gVisor 20240729).

Every call gets the same global flags (`--root`, `--platform`, `--network=sandbox`,
`--net-disconnect-ok`, `--cpu-num-from-quota`) and the rootfs overlay mode of the container it
acts on (`--overlay2=root:memory` for a sandbox without an upper dir, `none` for one on a
per-container host overlay): runsc reads its config from the flags of each invocation, and
run/checkpoint/restore of one sandbox need consistent ones.

On kernels where `/proc/sys/net/core/rmem_default` exists in every network namespace (6.x),
runsc 20240729 thinks any netns is the root one and refuses `--network=sandbox`. Commands that
set up a sandbox's network (`run`, `restore`) then run inside a private mount namespace that
hides `/proc/sys/net` (see reference/gvisor.md, "Fix 1"). `probe()` decides once whether the
fix is needed.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import logging
import stat
from pathlib import Path
from typing import Any

from aenv.errors import RuntimeFailure
from aenv.runtime import _proc

log = logging.getLogger("aenv.runtime")

# `unshare` runs this with argv[0] = the runsc binary and the rest = runsc's arguments.
_NETNS_FIX = (
    'mount -t tmpfs -o size=4k,mode=555,nosuid,nodev,noexec gvfix /proc/sys/net && exec "$0" "$@"'
)
_NETNS_FIX_WRAPPER = ["unshare", "-m", "--propagation", "slave", "/bin/sh", "-c", _NETNS_FIX]

# Commands that create a sandbox and so configure its network from the netns.
_SETUP_COMMANDS = {"run", "restore", "create"}

RUNNING_STATES = frozenset({"running", "paused"})

# What `runsc checkpoint` writes: the state file always, the memory pages beside it (as a
# pair) when runsc keeps them apart.
_IMAGE_STATE = "checkpoint.img"
_IMAGE_PAGES = ("pages_meta.img", "pages.img")


def image_complete(image_dir: Path) -> bool:
    """Whether `image_dir` holds all a `runsc checkpoint` wrote (blocking: a few stats)."""
    try:
        state = (image_dir / _IMAGE_STATE).stat()
    except OSError:
        return False
    pages = [(image_dir / name).is_file() for name in _IMAGE_PAGES]
    return stat.S_ISREG(state.st_mode) and state.st_size > 0 and all(pages) == any(pages)


def is_missing(err: RuntimeFailure) -> bool:
    """True when runsc failed because the container does not exist."""
    text = str(err)
    return "does not exist" in text or "not found" in text


class Runsc:
    def __init__(
        self,
        binary: str,
        root: Path,
        *,
        platform: str = "systrap",
        overlay: str = "root:memory",
        debug: bool = False,
        extra_flags: tuple[str, ...] = (),
    ) -> None:
        self.binary = binary
        self.root = root
        self.platform = platform
        self.overlay = overlay
        self.debug = debug
        self.extra_flags = extra_flags
        # None until probe(): then whether run/restore need the /proc/sys/net mount fix.
        self.netns_fix: bool | None = None

    async def probe(self) -> bool:
        """Checks once whether `/proc/sys/net/core/rmem_default` is visible in a fresh netns."""
        if self.netns_fix is None:
            res = await _proc.run(
                ["unshare", "-n", "/bin/sh", "-c", "test -e /proc/sys/net/core/rmem_default"],
                check=False,
                time_limit=10,
            )
            if res.returncode not in (0, 1):
                raise RuntimeFailure(f"cannot probe network namespaces: {res.stderr.strip()}")
            self.netns_fix = res.returncode == 0
            log.info("runsc netns fix %s", "needed" if self.netns_fix else "not needed")
        return self.netns_fix

    def global_flags(self, *, log_dir: Path | None = None, overlay: str | None = None) -> list[str]:
        flags = [
            f"--root={self.root}",
            f"--platform={self.platform}",
            "--network=sandbox",
            "--net-disconnect-ok",
            f"--overlay2={overlay or self.overlay}",
            "--cpu-num-from-quota",
            *self.extra_flags,
        ]
        if log_dir is not None:
            # runsc's own log (errors and warnings) for this sandbox; with debug, every
            # process (CLI, sentry, gofer) writes a full debug log beside it.
            flags.append(f"--log={log_dir / 'runsc.log'}")
            if self.debug:
                flags += ["--debug", f"--debug-log={log_dir / 'debug'}/"]
        return flags

    def argv(
        self, *args: str, log_dir: Path | None = None, overlay: str | None = None
    ) -> list[str]:
        cmd = [self.binary, *self.global_flags(log_dir=log_dir, overlay=overlay), *args]
        if args and args[0] in _SETUP_COMMANDS and self.netns_fix:
            return [*_NETNS_FIX_WRAPPER, *cmd]
        return cmd

    async def __call__(
        self,
        *args: str,
        log_dir: Path | None = None,
        time_limit: float | None = 60.0,
        overlay: str | None = None,
    ) -> str:
        """Runs a runsc command that exits on its own; returns stdout."""
        res = await _proc.run(
            self.argv(*args, log_dir=log_dir, overlay=overlay),
            time_limit=time_limit,
            what=_what(args),
        )
        return res.stdout

    async def detached(
        self,
        *args: str,
        output: Path,
        log_dir: Path | None = None,
        time_limit: float = 120.0,
        overlay: str | None = None,
    ) -> float:
        """`run`/`restore` with `--detach`: stdio to `output`. Returns the seconds taken."""
        if self.netns_fix is None:
            await self.probe()
        res = await _proc.run_detached(
            self.argv(*args, log_dir=log_dir, overlay=overlay),
            output=output,
            time_limit=time_limit,
            what=_what(args),
        )
        return res.seconds

    # Typed helpers -----------------------------------------------------------------------

    async def state(self, cid: str) -> dict[str, Any] | None:
        """`runsc state`, or None when the container does not exist."""
        try:
            out = await self("state", cid, time_limit=30)
        except RuntimeFailure as e:
            if is_missing(e):
                return None
            raise
        return dict(json.loads(out))

    async def list(self) -> list[dict[str, Any]]:
        """`runsc list`; when that fails (an unreadable state file), the ids from the state
        file names, without status or bundle."""
        if not self.root.is_dir():
            return []
        try:
            out = await self("list", "--format=json", time_limit=60)
            return list(json.loads(out or "null") or [])
        except (RuntimeFailure, ValueError) as e:
            log.warning("runsc list failed (%s); falling back to state file names", e)
        names = await asyncio.to_thread(lambda: [p.name for p in self.root.glob("*.state")])
        found = []
        for cid in sorted({n.split("_sandbox:", 1)[0] for n in names if "_sandbox:" in n}):
            try:
                found.append(await self.state(cid) or {"id": cid})
            except (RuntimeFailure, ValueError):
                found.append({"id": cid})
        return found

    async def delete(self, cid: str, *, time_limit: float = 60.0) -> None:
        """`delete --force`; a container that does not exist is not an error."""
        try:
            await self("delete", "--force", cid, time_limit=time_limit)
        except RuntimeFailure as e:
            if not is_missing(e):
                raise

    async def kill(self, cid: str, signal: str = "KILL", *, all_processes: bool = False) -> None:
        args = ["kill", *(["--all"] if all_processes else []), cid, signal]
        await self(*args, time_limit=30)

    async def pause(self, cid: str) -> None:
        await self("pause", cid, time_limit=60)

    async def resume(self, cid: str) -> None:
        await self("resume", cid, time_limit=60)

    async def checkpoint(
        self,
        cid: str,
        image_dir: Path,
        *,
        leave_running: bool,
        log_dir: Path | None = None,
        time_limit: float = 600.0,
        overlay: str | None = None,
    ) -> None:
        args = ["checkpoint", f"--image-path={image_dir}", "--compression=none"]
        if leave_running:
            args.append("--leave-running")
        await self(*args, cid, log_dir=log_dir, time_limit=time_limit, overlay=overlay)

    async def events_stats(self, cid: str) -> dict[str, Any]:
        out = await self("events", "--stats", cid, time_limit=30)
        return dict(json.loads(out.strip().splitlines()[-1]))

    async def list_states(self) -> builtins.list[dict[str, Any]]:
        """Like `list`, read from runsc's state files without asking any sandbox (a frozen
        one would never answer): `id`, `status` as runsc last recorded it, `bundle`.
        Falls back to `runsc list` when a state file does not read as expected."""

        def read() -> builtins.list[dict[str, Any]] | None:
            out = []
            for path in sorted(self.root.glob("*_sandbox:*.state")):
                try:
                    data = json.loads(path.read_text())
                    out.append(
                        {
                            "id": str(data["id"]),
                            "status": str(data["status"]),
                            "bundle": str(data["bundleDir"]),
                        }
                    )
                except FileNotFoundError:
                    continue  # deleted meanwhile
                except (OSError, ValueError, KeyError, TypeError):
                    return None
            return out

        if not self.root.is_dir():
            return []
        found = await asyncio.to_thread(read)
        return found if found is not None else await self.list()

    def sandbox_state_file(self, cid: str) -> Path | None:
        """runsc's own state file of a root container (holds the sandbox and gofer pids)."""
        matches = sorted(self.root.glob(f"{cid}_sandbox:*.state"))
        return matches[0] if matches else None

    def read_pids(self, cid: str) -> tuple[int, int]:
        """(sandbox pid, gofer pid) from runsc's state file; 0 when unknown. Sync (small file)."""
        path = self.sandbox_state_file(cid)
        if path is None:
            return 0, 0
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return 0, 0
        sandbox = data.get("sandbox") or {}
        return int(sandbox.get("pid") or 0), int(data.get("goferPid") or 0)


def _what(args: tuple[str, ...]) -> str:
    """`runsc <command> <container id>` for error messages (the full argv is in debug logs)."""
    words = [a for a in args if not a.startswith("-")]
    return "runsc " + " ".join(words[:1] + words[-1:] if len(words) > 1 else words)


async def gather_quiet(*aws: Any) -> None:
    """Awaits all, logging (not raising) failures: for best-effort cleanup."""
    for res in await asyncio.gather(*aws, return_exceptions=True):
        if isinstance(res, BaseException):
            log.warning("cleanup step failed: %s", res)
