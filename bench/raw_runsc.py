"""The baseline's raw `runsc` sandboxes: the same operations the server does, done directly
with the `runsc` CLI on this machine, with the same rootfs (the `base` template's layer in the
bench's AENV_HOME) and an equivalent sandbox: envd from the runtime bundle as the first process
(read-only bind mount at /opt/aenv), the rootfs a host overlay of that layer and an upper dir of
the container's own with `--overlay2=none` (the shape of the server's sandboxes, whose files
live on the host: a checkpoint holds no file data, a restore re-opens files through the gofer),
`--network=sandbox` in a network slot built like the server's (router + inner netns, the
project's `Network` class, prefix `aebase`), the same memory/CPU limits, the same global runsc
flags (the project's `Runsc` wrapper, which also applies the /proc/sys/net fix to
`run`/`restore`). Launch, exec, checkpoint and destroy each return their wall-clock time;
the rows that time them are in baseline.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aenv.errors import AenvError
from aenv.images.layers import copy_tree
from aenv.runtime import rootfs
from aenv.runtime.base import Mount, SandboxSpec
from aenv.runtime.gvisor import oci
from aenv.runtime.gvisor.runsc import Runsc
from aenv.runtime.net.network import Network, Slot, SlotAddressing

from . import hostproc
from .client import BenchError
from .plan import Plan, Progress
from .scenarios_common import wait_until
from .stats import Results

NET_PREFIX = "aebase"
NET_CIDR = "10.207.0.0/16"
CGROUP_ROOT = Path("/sys/fs/cgroup")
DEFAULT_MEMORY_MB = 512
CONCURRENT_MEMORY_MB = 256


@dataclass
class Ctr:
    cid: str
    bundle: Path
    slot: Slot
    memory_mb: int
    upper: Path

    @property
    def mount(self) -> Path:
        return self.bundle / "rootfs"

    @property
    def work(self) -> Path:
        return self.upper.parent / f"work-{self.cid}"


def find_rootfs(home: Path) -> Path:
    """The `base` template's layer (`layers/*/rootfs`); the catalog decides if several."""
    candidates = sorted(p for p in (home / "layers").glob("*/rootfs") if p.is_dir())
    if len(candidates) == 1:
        return candidates[0]
    with contextlib.suppress(Exception):
        from aenv.images.layers import LayerStore
        from aenv.orchestrator.catalog import Catalog

        catalog = Catalog(home / "catalog.db")
        try:
            found = catalog.template("base")
        finally:
            catalog.close()
        if found:
            layers = list(found.layers)
            if len(layers) == 1:
                return LayerStore(home / "layers").path(layers[0])
    raise BenchError(f"no single base layer under {home / 'layers'}")


def oci_spec(
    *,
    rootfs: Path,
    runtime_dir: Path,
    init_args: list[str],
    init_env: dict[str, str],
    netns_path: str,
    cgroups_path: str,
    memory_mb: int,
    cpus: int = 2,
    upper: Path | None = None,
) -> dict[str, Any]:
    """The OCI config of a baseline sandbox: the server's own (`runtime.oci.config`), so the
    baseline measures exactly the shape our sandboxes run in."""
    spec = SandboxSpec(
        sandbox_id="baseline",
        layers=[rootfs],
        args=list(init_args),
        env=dict(init_env),
        mounts=[Mount(runtime_dir, "/opt/aenv", readonly=True)],
        cpu_count=cpus,
        memory_mb=memory_mb,
        upper=upper,
    )
    return oci.config(spec, rootfs=rootfs, netns_path=netns_path, cgroups_path=cgroups_path)


def elapsed_ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


class RunscSandboxes:
    """Containers, slots, cgroups and files of the raw `runsc` baseline; `close()` removes every
    one of them."""

    def __init__(
        self,
        home: Path,
        results: Results,
        plan: Plan,
        progress: Progress,
        *,
        want: Callable[[str], bool],
    ) -> None:
        self.home = home
        self.root = home / "baseline"
        self.results = results
        self.plan = plan
        self.progress = progress
        self.want = want
        self.runsc = Runsc("runsc", self.root / "state", overlay="none")
        self.net = Network(SlotAddressing(NET_PREFIX, NET_CIDR))
        self._next_slot = 0
        self.skip: set[str] = set()
        self.live: dict[str, Ctr] = {}
        self._bg: set[asyncio.Task[None]] = set()
        self._delete_slots = asyncio.Semaphore(4)
        self.rootfs: Path | None = None
        self.runtime_dir: Path | None = None
        self.init_args: list[str] = []
        self.init_env: dict[str, str] = {}

    # -- plumbing -----------------------------------------------------------------------------

    async def setup(self) -> None:
        from aenv.config import Settings
        from aenv.runtime.bundle_build import ensure_bundle

        for d in (
            self.root / "state",
            self.root / "bundles",
            self.root / "images",
            self.root / "rw",
        ):
            await asyncio.to_thread(d.mkdir, parents=True, exist_ok=True)
        # Slots and cgroups a killed earlier run may have left (the prefix is the bench's own,
        # and the host lock says no other bench runs).
        with contextlib.suppress(Exception):
            await self.net.cleanup(keep=set())
        await asyncio.to_thread(_remove_cgroups, NET_PREFIX)
        await self.runsc.probe()
        self.rootfs = await asyncio.to_thread(find_rootfs, self.home)
        bundle = await asyncio.to_thread(ensure_bundle, Settings(home=self.home))
        self.runtime_dir = bundle.host_path
        self.init_args = bundle.init_args()
        self.init_env = bundle.init_env()

    async def slot(self) -> Slot:
        n = self._next_slot
        self._next_slot += 1
        try:
            return await self.net.build(n)
        except AenvError as exc:
            raise BenchError(f"baseline slot: {exc}") from None

    async def slots(self, n: int) -> list[Slot]:
        sem = asyncio.Semaphore(8)

        async def one() -> Slot:
            async with sem:
                return await self.slot()

        return list(await asyncio.gather(*(one() for _ in range(n))))

    def _bundle(self, slot: Slot, memory_mb: int, upper: Path | None) -> Ctr:
        assert self.rootfs is not None and self.runtime_dir is not None
        cid = f"{NET_PREFIX}{secrets.token_hex(6)}"
        bundle = self.root / "bundles" / cid
        bundle.mkdir(parents=True)
        if upper is None:
            upper = self.root / "rw" / cid / "upper"
            upper.mkdir(parents=True)
        return Ctr(cid, bundle, slot, memory_mb, upper)

    def copy_upper(self, upper: Path) -> Path:
        """A copy of a container's upper dir (whiteouts and xattrs kept), for another."""
        dest = self.root / "rw" / f"copy-{secrets.token_hex(6)}" / "upper"
        dest.parent.mkdir(parents=True)
        copy_tree(upper, dest, link=False)
        return dest

    def _config(self, ctr: Ctr) -> None:
        assert self.runtime_dir is not None
        cfg = oci_spec(
            rootfs=ctr.mount,
            runtime_dir=self.runtime_dir,
            init_args=self.init_args,
            init_env=self.init_env,
            netns_path=ctr.slot.netns_path,
            cgroups_path=f"/{NET_PREFIX}/{ctr.cid}",
            memory_mb=ctr.memory_mb,
            upper=ctr.upper,
        )
        (ctr.bundle / "config.json").write_text(json.dumps(cfg, indent=1))

    async def launch(
        self,
        slot: Slot,
        memory_mb: int = DEFAULT_MEMORY_MB,
        image: Path | None = None,
        upper: Path | None = None,
    ) -> tuple[Ctr, float]:
        """`runsc run --detach` (or `restore --detach` from `image`) on a host overlay of the
        base layer and `upper` (a new one if None); the time of that call."""
        assert self.rootfs is not None
        ctr = await asyncio.to_thread(self._bundle, slot, memory_mb, upper)
        self.live[ctr.cid] = ctr
        await rootfs.mount_writable([self.rootfs], ctr.upper, ctr.work, ctr.mount)
        await asyncio.to_thread(self._config, ctr)
        args = ["run", "--detach", f"--bundle={ctr.bundle}"]
        if image is not None:
            args = ["restore", "--detach", f"--bundle={ctr.bundle}", f"--image-path={image}"]
        t0 = time.perf_counter()
        try:
            await self.runsc.detached(
                *args, ctr.cid, output=ctr.bundle / "console.log", log_dir=ctr.bundle
            )
        except AenvError as exc:
            await self.destroy(ctr)
            raise BenchError(f"runsc {args[0]}: {exc}") from None
        return ctr, elapsed_ms(t0)

    async def exec(self, ctr: Ctr, cmd: str = "true", time_limit: float = 120.0) -> float:
        t0 = time.perf_counter()
        try:
            await self.runsc("exec", ctr.cid, "/bin/bash", "-l", "-c", cmd, time_limit=time_limit)
        except AenvError as exc:
            raise BenchError(f"runsc exec: {exc}") from None
        return elapsed_ms(t0)

    async def _op(self, what: str, fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        try:
            await fn()
        except AenvError as exc:
            raise BenchError(f"runsc {what}: {exc}") from None
        return elapsed_ms(t0)

    def image(self) -> Path:
        path = self.root / "images" / secrets.token_hex(6)
        path.mkdir(parents=True)
        return path

    async def destroy(self, ctr: Ctr) -> None:
        """SIGKILL the sentry and wait until its processes are gone (as the server does);
        `runsc delete --force` (~1.4 s even then), the slot and the bundle go in the
        background, awaited by `close()`."""
        if self.live.pop(ctr.cid, None) is None:
            return
        pid, gofer = self.runsc.read_pids(ctr.cid)
        if pid > 0 and hostproc.alive(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        pids = [p for p in (pid, gofer) if p > 0]
        await wait_until(lambda: not hostproc.any_alive(pids), 10.0, 0.005)
        task = asyncio.create_task(self._finish(ctr))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _finish(self, ctr: Ctr) -> None:
        async with self._delete_slots:
            with contextlib.suppress(AenvError):
                await self.runsc.delete(ctr.cid)
            with contextlib.suppress(AenvError):
                await self.net.teardown(ctr.slot.index)
            if await rootfs.unmount(ctr.mount):  # never rmtree through a mounted overlay
                await asyncio.to_thread(shutil.rmtree, ctr.bundle, True)
                await asyncio.to_thread(shutil.rmtree, ctr.work, True)

    async def destroy_all(self, ctrs: list[Ctr]) -> None:
        sem = asyncio.Semaphore(8)

        async def one(c: Ctr) -> None:
            async with sem:
                await self.destroy(c)

        await asyncio.gather(*(one(c) for c in ctrs), return_exceptions=True)

    async def close(self) -> None:
        await self.destroy_all(list(self.live.values()))
        while self._bg:
            await asyncio.gather(*list(self._bg), return_exceptions=True)
        with contextlib.suppress(Exception):
            for c in await self.runsc.list():
                cid = str(c.get("id"))
                pid, _ = self.runsc.read_pids(cid)
                if pid > 0 and hostproc.alive(pid):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(AenvError):
                    await self.runsc.delete(cid)
        with contextlib.suppress(Exception):
            await self.net.cleanup(keep=set())
        await asyncio.to_thread(_remove_cgroups, NET_PREFIX)
        for mp in await asyncio.to_thread(rootfs.mount_points, self.root):
            await rootfs.unmount(mp)
        await asyncio.to_thread(shutil.rmtree, self.root, True)

    async def fresh(self, memory_mb: int = DEFAULT_MEMORY_MB) -> Ctr:
        """A running container that has answered one exec (untimed)."""
        ctr, _ = await self.launch(await self.slot(), memory_mb)
        await self.exec(ctr)
        return ctr

    async def checkpoint(self, ctr: Ctr, image: Path, *, leave_running: bool) -> float:
        return await self._op(
            "checkpoint",
            lambda: self.runsc.checkpoint(
                ctr.cid, image, leave_running=leave_running, log_dir=ctr.bundle
            ),
        )


def _remove_cgroups(prefix: str) -> None:
    """Empty cgroups runsc left under `<controller>/<prefix>/` (and the prefix dirs)."""
    for parent in [*CGROUP_ROOT.glob(f"*/{prefix}"), CGROUP_ROOT / prefix]:
        if not parent.is_dir():
            continue
        for child in parent.iterdir():
            if child.is_dir():
                with contextlib.suppress(OSError):
                    child.rmdir()
        with contextlib.suppress(OSError):
            parent.rmdir()
