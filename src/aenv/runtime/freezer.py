"""The cgroup freezer: stops every process of a sandbox (sentry, its stubs, the gofer) at once.

`runsc pause` asks the sentry over its control socket to stop its tasks; that is a whole
runsc start-up (~25 ms here) per pause and again per resume. Freezing the container's
cgroup is one write to a kernel file: the CPU is released, memory is kept, and thawing
continues every process exactly where it stopped.

While a sandbox is frozen its sentry cannot answer anything, so every runsc command that
talks to it (`state`, `list`, `kill`, `checkpoint`, `delete`) would hang: the runtime
thaws before any of those, and reads runsc's state files instead of `runsc list`. A frozen
process in a cgroup v1 hierarchy does not even die of SIGKILL until it is thawed.

Both hierarchies are handled: v1 (`freezer/<path>/freezer.state`: FROZEN / FREEZING /
THAWED) and v2 (`<path>/cgroup.freeze` and the `frozen` key of `cgroup.events`).
"""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import RuntimeFailure

CGROUP_ROOT = Path("/sys/fs/cgroup")
_V1 = "freezer"


class Freezer:
    def __init__(self, root: Path = CGROUP_ROOT) -> None:
        self.root = root

    def _dir(self, cgroup: str) -> tuple[Path, bool] | None:
        """(the cgroup's directory, True if v1), or None when no freezer controls it."""
        rel = cgroup.strip("/")
        v1 = self.root / _V1 / rel
        if (v1 / "freezer.state").exists():
            return v1, True
        v2 = self.root / rel
        if (v2 / "cgroup.freeze").exists():
            return v2, False
        return None

    def available(self, cgroup: str) -> bool:
        return self._dir(cgroup) is not None

    def is_frozen(self, cgroup: str) -> bool:
        """True while frozen or freezing; False when thawed or without a freezer."""
        found = self._dir(cgroup)
        if found is None:
            return False
        d, v1 = found
        try:
            if v1:
                return (d / "freezer.state").read_text().strip() != "THAWED"
            return (d / "cgroup.freeze").read_text().strip() == "1"
        except OSError:
            return False

    def freeze(self, cgroup: str, timeout: float = 5.0) -> None:
        """Freezes and waits until every task is frozen; thaws again if that never happens."""
        found = self._dir(cgroup)
        if found is None:
            raise RuntimeFailure(f"cgroup {cgroup} has no freezer")
        d, v1 = found
        control, value = (d / "freezer.state", "FROZEN") if v1 else (d / "cgroup.freeze", "1")
        control.write_text(value)
        deadline = time.monotonic() + timeout
        delay = 0.0002
        while not self._settled(d, v1):
            if time.monotonic() > deadline:
                self.thaw(cgroup)
                raise RuntimeFailure(f"cgroup {cgroup} did not freeze within {timeout:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
            if v1:  # v1 retries the freeze on each write while tasks are still running
                control.write_text(value)

    def thaw(self, cgroup: str) -> None:
        found = self._dir(cgroup)
        if found is None:
            return
        d, v1 = found
        if v1:
            (d / "freezer.state").write_text("THAWED")
        else:
            (d / "cgroup.freeze").write_text("0")

    @staticmethod
    def _settled(d: Path, v1: bool) -> bool:
        if v1:
            return (d / "freezer.state").read_text().strip() == "FROZEN"
        for line in (d / "cgroup.events").read_text().splitlines():
            key, _, val = line.partition(" ")
            if key == "frozen":
                return val.strip() == "1"
        return False
