"""The baseline: the same operations done directly with the `runsc` CLI on this machine, in the
same run, with the same rootfs (the `base` template's layer in the bench's AENV_HOME) and an
equivalent sandbox: envd from the runtime bundle as the first process (read-only bind mount at
/opt/aenv), the rootfs a host overlay of that layer and an upper dir of the container's own
with `--overlay2=none` (the shape of the server's sandboxes, whose files live on the host:
a checkpoint holds no file data, a restore re-opens files through the gofer), `--network=sandbox` in a network slot built like the
server's (router + inner netns, the project's `Network` class, prefix `aebase`), the same
memory/CPU limits, the same global runsc flags (the project's `Runsc` wrapper, which also
applies the /proc/sys/net fix to `run`/`restore`).

Times are wall-clock around each runsc CLI call (so they include the CLI's own start-up, as
in reference/gvisor.md). A slot is built before the clock starts, except in the `_cold` row.
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
from .scenarios_common import SampleFn, sample_loop, wait_until
from .scenarios_lifecycle import DIRTY_MEMORY_MB, dirty_command
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


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


class RawRunsc:
    """Runs the baseline rows; `close()` removes every container, slot, cgroup and file."""

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

    async def loop(self, rows: list[str], n: int, fn: SampleFn) -> bool:
        return await sample_loop(
            self.results,
            rows,
            n,
            fn,
            self.progress,
            baseline=True,
            max_failures=self.plan.max_failures,
        )

    def wants(self, row: str) -> bool:
        return self.want(row) and row not in self.skip

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
        return ctr, _ms(t0)

    async def exec(self, ctr: Ctr, cmd: str = "true", time_limit: float = 120.0) -> float:
        t0 = time.perf_counter()
        try:
            await self.runsc("exec", ctr.cid, "/bin/bash", "-l", "-c", cmd, time_limit=time_limit)
        except AenvError as exc:
            raise BenchError(f"runsc exec: {exc}") from None
        return _ms(t0)

    async def _op(self, what: str, fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        try:
            await fn()
        except AenvError as exc:
            raise BenchError(f"runsc {what}: {exc}") from None
        return _ms(t0)

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

    # -- rows ---------------------------------------------------------------------------------

    async def run_all(self) -> None:
        p = self.plan
        if not p.baseline_heavy:
            heavy = ["snapshot_dirty_1gib", "fork_1", "fork_4", "fork_16", "concurrent_create_50"]
            self.results.missing(
                [r for r in heavy if self.want(r)], "not run in quick mode", baseline=True
            )
            self.skip.update(heavy)
        await self._warmup()
        if self.wants("create_to_first_exec"):
            await self._create_row("create_to_first_exec", p.create, cold=False)
        if self.wants("create_to_first_exec_cold"):
            await self._create_row("create_to_first_exec_cold", p.create_cold, cold=True)
        await self._running_rows()
        if self.wants("hibernate") or self.wants("resume_from_disk"):
            await self._hibernate_rows()
        if self.wants("snapshot_dirty_1gib"):
            await self._dirty_row()
        for n, count in ((1, p.fork_1), (4, p.fork_4), (16, p.fork_16)):
            if self.wants(f"fork_{n}"):
                await self._fork_row(n, count)
        await self._concurrent_rows()

    async def _warmup(self) -> None:
        self.progress.step("baseline warm-up", 1)
        try:
            ctr = await self.fresh()
            await self.destroy(ctr)
        finally:
            self.progress.advance()

    async def _create_row(self, row: str, n: int, *, cold: bool) -> None:
        self.progress.step(f"baseline {row}", n)

        async def one(_i: int) -> tuple[float, dict[str, float]]:
            stages: dict[str, float] = {}
            if cold:
                t0 = time.perf_counter()
                slot = await self.slot()
                stages["netns"] = _ms(t0)
            else:
                slot = await self.slot()
                t0 = time.perf_counter()
            ctr, stages["run"] = await self.launch(slot)
            try:
                stages["exec"] = await self.exec(ctr)
                total = _ms(t0)
            finally:
                await self.destroy(ctr)
            return total, stages

        await self.loop([row], n, one)

    async def _running_rows(self) -> None:
        rows = ["exec_roundtrip", "pause", "resume", "snapshot"]
        if not any(self.wants(r) for r in rows):
            return
        p = self.plan
        ctr = await self.fresh()
        try:
            if self.wants("exec_roundtrip"):
                self.progress.step("baseline exec_roundtrip", p.exec)
                await self.exec(ctr)

                async def run(_i: int) -> tuple[float, dict[str, float]]:
                    return await self.exec(ctr), {}

                await self.loop(["exec_roundtrip"], p.exec, run)
            if self.wants("pause") or self.wants("resume"):
                self.progress.step("baseline pause/resume", p.pause)

                async def pause(_i: int) -> None:
                    paused = await self._op("pause", lambda: self.runsc.pause(ctr.cid))
                    self.results.add("pause", paused, baseline=True)
                    resumed = await self._op("resume", lambda: self.runsc.resume(ctr.cid))
                    self.results.add("resume", resumed, baseline=True)
                    await self.exec(ctr)

                await self.loop(["pause", "resume"], p.pause, pause)
            if self.wants("snapshot"):
                self.progress.step("baseline snapshot", p.snapshot)

                async def snap(_i: int) -> tuple[float, dict[str, float]]:
                    image = await asyncio.to_thread(self.image)
                    try:
                        ms = await self.checkpoint(ctr, image, leave_running=True)
                    finally:
                        await asyncio.to_thread(shutil.rmtree, image, True)
                    await self.exec(ctr)
                    return ms, {}

                await self.loop(["snapshot"], p.snapshot, snap)
        finally:
            await self.destroy(ctr)

    async def checkpoint(self, ctr: Ctr, image: Path, *, leave_running: bool) -> float:
        return await self._op(
            "checkpoint",
            lambda: self.runsc.checkpoint(
                ctr.cid, image, leave_running=leave_running, log_dir=ctr.bundle
            ),
        )

    async def _hibernate_rows(self) -> None:
        """checkpoint (container stops) = hibernate; restore into a new container id, bundle
        and slot = resume_from_disk. The restored one is hibernated again next sample."""
        self.progress.step("baseline hibernate/resume_from_disk", self.plan.hibernate)
        state = {"ctr": await self.fresh()}

        async def one(_i: int) -> None:
            old = state["ctr"]
            image = await asyncio.to_thread(self.image)
            try:
                hibernated = await self.checkpoint(old, image, leave_running=False)
                self.results.add("hibernate", hibernated, baseline=True)
                await self.destroy(old)
                slot = await self.slot()
                # Its files, as the server's hibernated sandbox: the same upper.
                await wait_until(lambda: not rootfs.is_mount_point(old.mount), 10.0, 0.005)
                new, restored = await self.launch(slot, old.memory_mb, image=image, upper=old.upper)
                state["ctr"] = new
                self.results.add("resume_from_disk", restored, baseline=True)
                await self.exec(new)
            finally:
                await asyncio.to_thread(shutil.rmtree, image, True)

        try:
            await self.loop(["hibernate", "resume_from_disk"], self.plan.hibernate, one)
        finally:
            await self.destroy(state["ctr"])

    async def _dirty_row(self) -> None:
        row = "snapshot_dirty_1gib"
        self.progress.step(f"baseline {row}", self.plan.dirty)
        command = dirty_command(self.plan.dirty_mib)

        async def one(_i: int) -> tuple[float, dict[str, float]]:
            ctr = await self.fresh(DIRTY_MEMORY_MB)
            image = await asyncio.to_thread(self.image)
            try:
                wrote = await self.exec(ctr, command, time_limit=600)
                ms = await self.checkpoint(ctr, image, leave_running=True)
            finally:
                await self.destroy(ctr)
                await asyncio.to_thread(shutil.rmtree, image, True)
            return ms, {"write_in_sandbox": wrote}

        await self.loop([row], self.plan.dirty, one)

    async def _fork_row(self, n: int, count: int) -> None:
        """checkpoint --leave-running of the source, then N restores at once, each into its
        own new container, bundle and slot, and one exec in each: until every child answers."""
        row = f"fork_{n}"
        self.progress.step(f"baseline {row}", count)
        source = await self.fresh()

        async def one(_i: int) -> tuple[float, dict[str, float]]:
            slots = await self.slots(n)
            image = await asyncio.to_thread(self.image)
            children: list[Ctr] = []

            async def child(slot: Slot) -> None:
                # The source's files as they were (a restore reopens what was open, some of
                # it written since boot), as a fork's child gets them.
                upper = await asyncio.to_thread(self.copy_upper, source.upper)
                ctr, _ = await self.launch(slot, source.memory_mb, image=image, upper=upper)
                children.append(ctr)
                await self.exec(ctr)

            try:
                t0 = time.perf_counter()
                ckpt = await self.checkpoint(source, image, leave_running=True)
                got = await asyncio.gather(*(child(s) for s in slots), return_exceptions=True)
                total = _ms(t0)
            finally:
                made = {c.slot.index for c in children}
                for s in slots:
                    if s.index not in made:
                        with contextlib.suppress(AenvError):
                            await self.net.teardown(s.index)
                await self.destroy_all(children)
                await asyncio.to_thread(shutil.rmtree, image, True)
            bad = [g for g in got if isinstance(g, BaseException)]
            if bad:
                raise BenchError(f"{len(bad)}/{n} children failed: {bad[0]}")
            return total, {"checkpoint": ckpt}

        try:
            await self.loop([row], count, one)
        finally:
            await self.destroy(source)

    async def _concurrent_rows(self) -> None:
        p = self.plan
        for n, rounds in ((10, p.concurrent_10_rounds), (50, p.concurrent_50_rounds)):
            row = f"concurrent_create_{n}"
            idle = n == 10 and (
                self.wants("idle_sandbox_rss_mib") or self.wants("idle_sandbox_pss_mib")
            )
            if not self.wants(row) and not idle:
                continue
            self.progress.step(f"baseline {row}", rounds * n)
            for r in range(rounds):
                await self._concurrent_round(row, n, idle=idle and r == 0)

    async def _concurrent_round(self, row: str, n: int, *, idle: bool) -> None:
        slots = await self.slots(n)
        made: list[Ctr] = []

        async def one(slot: Slot) -> float:
            try:
                t0 = time.perf_counter()
                ctr, _ = await self.launch(slot, CONCURRENT_MEMORY_MB)
                made.append(ctr)
                await self.exec(ctr)
                return _ms(t0)
            finally:
                self.progress.advance()

        try:
            got = await asyncio.gather(*(one(s) for s in slots), return_exceptions=True)
            failed = [g for g in got if isinstance(g, BaseException)]
            for g in got:
                if not isinstance(g, BaseException):
                    self.results.add(row, g, baseline=True)
            if failed:
                self.results.note(row, f"{len(failed)} of {n} failed: {failed[0]}", baseline=True)
            if idle and made:
                await asyncio.sleep(self.plan.idle_wait)
                found = await asyncio.to_thread(hostproc.scan, [c.cid for c in made])
                for procs in found.values():
                    if procs:
                        self.results.add(
                            "idle_sandbox_rss_mib", hostproc.rss_mib(procs.main), baseline=True
                        )
                        self.results.add(
                            "idle_sandbox_pss_mib",
                            hostproc.pss_mib(procs.main + procs.stubs),
                            baseline=True,
                        )
        finally:
            made_slots = {c.slot.index for c in made}
            for s in slots:
                if s.index not in made_slots:
                    with contextlib.suppress(AenvError):
                        await self.net.teardown(s.index)
            await self.destroy_all(made)


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
