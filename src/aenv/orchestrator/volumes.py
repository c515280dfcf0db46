"""The node's volumes as the API sees them: the volume store's work off the event loop, and
the node's one rule about them, that a volume a sandbox here mounts is not deleted."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..domain import SandboxState
from ..errors import Conflict
from ..volumes import VolumeFiles, VolumeRecord, VolumeStore
from .table import SandboxTable

_ENDED = (SandboxState.KILLED, SandboxState.LOST)


@dataclass
class Volumes:
    store: VolumeStore
    table: SandboxTable

    async def create(self, name: str) -> VolumeRecord:
        return await asyncio.to_thread(self.store.create, name)

    async def all(self) -> list[VolumeRecord]:
        return await asyncio.to_thread(self.store.all)

    async def get(self, volume_id: str) -> VolumeRecord:
        return await asyncio.to_thread(self.store.get, volume_id)

    async def delete(self, volume_id: str) -> None:
        """Refused (409) while a sandbox of this node that is not gone mounts it (paused
        ones remount it at resume); snapshots only name it, and fail to start once it is
        gone."""
        rec = await self.get(volume_id)
        users = sorted(
            r.sandbox_id
            for r in self.table.all()
            if r.state not in _ENDED and any(m.volume_id == rec.volume_id for m in r.volume_mounts)
        )
        if users:
            raise Conflict(
                f"volume {rec.name!r} is mounted by sandbox(es) {', '.join(users)}: kill them first"
            )
        await asyncio.to_thread(self.store.delete, volume_id)

    async def files(self, volume_id: str, token: str) -> VolumeFiles:
        """The files of a volume, for the holder of its token."""
        rec = await asyncio.to_thread(self.store.authorize, volume_id, token)
        return VolumeFiles(await asyncio.to_thread(self.store.data_dir, rec.volume_id))
