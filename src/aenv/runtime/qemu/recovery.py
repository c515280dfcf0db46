"""After a restart: the VMs a node still knows (`keep`) are taken back when their QEMU still
runs or they were stopped with their slot kept; every other trace of this home and prefix
(QEMU processes, VM dirs, RAM files, cgroups, network slots) is removed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
from pathlib import Path

from aenv.runtime import _proc
from aenv.runtime.net.network import Network
from aenv.runtime.qemu import vmproc
from aenv.runtime.qemu.machine import MACHINE_FILE, Machine

log = logging.getLogger("aenv.runtime")


def _records(vms_dir: Path) -> tuple[list[Machine], list[Path]]:
    """The machines recorded under `vms_dir`, and the dirs holding none that can be read."""
    found: list[Machine] = []
    unreadable: list[Path] = []
    if not vms_dir.is_dir():
        return found, unreadable
    for d in vms_dir.iterdir():
        try:
            found.append(Machine.from_json(json.loads((d / MACHINE_FILE).read_text())))
        except (OSError, ValueError, KeyError, TypeError):
            unreadable.append(d)
    return found, unreadable


async def recover(
    vms_dir: Path, ram_dir: Path, network: Network, prefix: str, keep: set[str]
) -> dict[str, Machine]:
    machines, unreadable = await asyncio.to_thread(_records, vms_dir)
    kept: dict[str, Machine] = {}
    for m in machines:
        up = await asyncio.to_thread(vmproc.running, m)
        if m.id in keep and (m.stopped or (up and not m.checkpointed)):
            kept[m.id] = m
            continue
        pid = await asyncio.to_thread(vmproc.kill, m)
        if pid:
            await _proc.wait_exited([pid], 10.0)
        await asyncio.to_thread(shutil.rmtree, m.dir, True)
        await asyncio.to_thread(vmproc.remove_cgroup, m.cgroup)
        if m.ram_shared:
            await asyncio.to_thread(m.ram.unlink, missing_ok=True)
    for d in unreadable:
        await asyncio.to_thread(shutil.rmtree, d, True)
    # RAM files no kept VM maps (a crash between a VM's file and its record).
    if await asyncio.to_thread(ram_dir.is_dir):
        wanted = {m.ram for m in kept.values()}
        for f in await asyncio.to_thread(lambda: list(ram_dir.iterdir())):
            if f not in wanted:
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(f.unlink)
    for cg in await asyncio.to_thread(vmproc.stale_cgroups, prefix, set(kept)):
        await asyncio.to_thread(vmproc.remove_cgroup, cg)
    removed = await network.cleanup(keep={m.slot for m in kept.values()})
    if removed or len(kept) != len(machines):
        log.info(
            "qemu recovery: kept %d VMs, removed %d, %d slots",
            len(kept),
            len(machines) - len(kept),
            len(removed),
        )
    return kept
