"""Boot snapshots (orchestrator/bootsnaps.py) over the fake runtime: a failed attempt (a boot
that timed out on a busy host) does not leave every later create booting: the next create of
that shape tries again."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aenv.domain import CreateRequest
from aenv.errors import RuntimeFailure
from tests.node_harness import Harness, build


async def boot_snapshots(h: Harness) -> list[str]:
    return [t.template_id for t in await h.orch.templates.all() if t.boot_of]


async def test_a_failed_boot_snapshot_is_tried_again(tmp_path: Path) -> None:
    h = build(tmp_path, boot_snapshots=True)
    h.runtime.fail_next("checkpoint", RuntimeFailure("envd did not become ready"))
    await h.orch.start(timers=False)
    try:
        # Creates go on booting while the one tried at start fails; a later one asks again.
        for _ in range(5):
            await h.orch.sandboxes.create(CreateRequest())
            for _ in range(50):
                if await boot_snapshots(h):
                    break
                await asyncio.sleep(0.02)
        assert len(await boot_snapshots(h)) == 1
    finally:
        await h.orch.close()
        h.catalog.close()
