"""Housekeeping rounds (`aenv.background.Periodic`): a round that fails does not end the
rounds that follow, and `stop` ends them."""

from __future__ import annotations

import asyncio
import logging

from aenv.background import Periodic


async def test_a_failed_round_is_logged_and_the_next_one_runs() -> None:
    rounds: list[int] = []
    third = asyncio.Event()

    async def work() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            raise RuntimeError("the first round fails")
        if len(rounds) == 3:
            third.set()

    p = Periodic("test rounds", 0.001, work, logging.getLogger("test"))
    p.start()
    try:
        await asyncio.wait_for(third.wait(), 10)
    finally:
        await p.stop()
    assert not p.running and rounds[:3] == [0, 1, 2]
