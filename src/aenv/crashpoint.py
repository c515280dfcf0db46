"""Named points where a test may kill the server as `kill -9` would (crash-safety tests).

`AENV_CRASH_AT=snapshot.sealed` (a comma-separated list) makes the server SIGKILL itself the
first time it reaches one of the named points. `AENV_CRASH_FILE=PATH` names a file holding
such names, read at each point (a test arms a point while the server runs, so one server
serves many crashes). With neither set, `hit` costs one set lookup and one None check."""

from __future__ import annotations

import os
import signal

_AT = frozenset(p.strip() for p in os.environ.get("AENV_CRASH_AT", "").split(",") if p.strip())
_FILE = os.environ.get("AENV_CRASH_FILE") or None


def hit(point: str) -> None:
    if point in _AT or (_FILE is not None and point in _armed(_FILE)):
        os.kill(os.getpid(), signal.SIGKILL)


def _armed(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().replace(",", " ").split()
    except OSError:
        return []
