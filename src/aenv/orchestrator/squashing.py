"""Keeping sandboxes' layer stacks short.

Every snapshot and fork seals the sandbox's upper into a new layer on top of its stack, and
one overlay mount takes only about 45 lower layers (its options fit one page). When a stack
grows past `Settings.squash_layers`, its top layers are merged into one in the background
(`images.squash`: hard links, whiteouts kept, same content) and the sandbox's record switches
to the shorter stack; the running container keeps the layers it mounted until its next boot
(re-stack, resume), when their references are dropped. A stack that is still too long when
a sandbox boots is squashed right there.

The merged layer's digest is a function of its inputs, so fork children squashing the same
inherited stack share one merge (and one layer).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from ..images.layers import LayerStore
from ..images.squash import squash_into_store

log = logging.getLogger("aenv.orchestrator")

# Lower layers one overlay mount surely takes (relative paths of ~79 bytes in 3800).
MOUNT_LIMIT = 40


def run_to_squash(layers: Sequence[str], limit: int) -> list[str] | None:
    """The top layers to merge so the stack gets back to half of `limit` (or of the mount
    limit when squashing is off), or None while the stack is short enough."""
    trigger = limit if limit > 0 else MOUNT_LIMIT
    trigger = min(trigger, MOUNT_LIMIT)
    if len(layers) <= trigger:
        return None
    keep = max(1, trigger // 2)  # layers left after the merged one, bottom of the stack
    run = list(layers[: len(layers) - keep])
    return run if len(run) >= 2 else None


def replace_run(layers: Sequence[str], run: Sequence[str], merged: str) -> list[str] | None:
    """`layers` with the contiguous `run` replaced by `merged`; None if it is not there any
    more (the stack changed meanwhile in a way that does not keep it)."""
    n = len(run)
    for i in range(len(layers) - n + 1):
        if list(layers[i : i + n]) == list(run):
            return [*layers[:i], merged, *layers[i + n :]]
    return None


class Squasher:
    def __init__(self, store: LayerStore) -> None:
        self.store = store
        self._running: dict[tuple[str, ...], asyncio.Future[str]] = {}

    async def squash(self, run: Sequence[str], label: str) -> str:
        """The digest of the layer merging `run` (topmost first), made once per run."""
        key = tuple(run)
        fut = self._running.get(key)
        if fut is None:
            fut = asyncio.ensure_future(
                asyncio.to_thread(
                    squash_into_store, self.store, list(run), f"squash of {len(run)} layers"
                )
            )
            self._running[key] = fut
            fut.add_done_callback(lambda _f: self._running.pop(key, None))
            log.info("squashing %d layers of %s", len(run), label)
        return await asyncio.shield(fut)
