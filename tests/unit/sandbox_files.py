"""What a sandbox's files look like from the host, for the lifecycle tests on the fake runtime:
a file written as a process in the sandbox would leave it (in its upper), and a directory's
entries.
"""

from __future__ import annotations

from pathlib import Path

from tests.node_harness import Harness


def write_file(h: Harness, sandbox_id: str, name: str, text: str) -> None:
    """What a process in the sandbox writing a file leaves on the host: a file in its upper."""
    upper = h.orch.table.get(sandbox_id).upper
    assert upper is not None
    (Path(upper) / name).write_text(text)


def entries(path: str) -> list[str]:
    return [p.name for p in Path(path).iterdir()]
