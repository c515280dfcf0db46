"""The one lifespan of a process's parts (`aenv.serving.Parts`): started in order,
closed in reverse, and a start that fails leaves nothing of the others running."""

from __future__ import annotations

import pytest

from aenv.serving import Parts


class Part:
    def __init__(self, name: str, journal: list[str], *, fail: bool = False) -> None:
        self.name, self.journal, self.fail = name, journal, fail

    async def start(self) -> None:
        if self.fail:
            raise RuntimeError(f"{self.name} cannot start")
        self.journal.append(f"start {self.name}")

    async def close(self) -> None:
        self.journal.append(f"close {self.name}")


async def test_parts_start_in_order_and_close_in_reverse() -> None:
    journal: list[str] = []
    lifespan = Parts(*(Part(n, journal) for n in ("keys", "orchestrator", "builder")))
    async with lifespan(None):
        assert journal == ["start keys", "start orchestrator", "start builder"]
    assert journal[3:] == ["close builder", "close orchestrator", "close keys"]


async def test_a_failed_start_closes_what_had_started() -> None:
    journal: list[str] = []
    parts = (Part("orchestrator", journal), Part("agent", journal, fail=True), Part("x", journal))
    with pytest.raises(RuntimeError, match="agent cannot start"):
        async with Parts(*parts)(None):
            pass
    assert journal == ["start orchestrator", "close orchestrator"]


async def test_parts_close_even_when_serving_fails() -> None:
    journal: list[str] = []
    with pytest.raises(ValueError):
        async with Parts(Part("orchestrator", journal))(None):
            raise ValueError("the server stopped on an error")
    assert journal == ["start orchestrator", "close orchestrator"]
