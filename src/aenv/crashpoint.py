"""Named points where a test may kill the server as `kill -9` would (crash-safety tests).

`AENV_CRASH_AT=snapshot.sealed` (a comma-separated list) makes the server SIGKILL itself the
first time it reaches one of the named points; unset, `hit` is one set lookup. Read once at
import: a test sets it in the environment of the server it starts."""

from __future__ import annotations

import os
import signal

_AT = frozenset(p.strip() for p in os.environ.get("AENV_CRASH_AT", "").split(",") if p.strip())


def hit(point: str) -> None:
    if point in _AT:
        os.kill(os.getpid(), signal.SIGKILL)
