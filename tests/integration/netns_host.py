"""A host of the tests' own on the far side of a veth: a network namespace (named per run),
a Python program serving in it, and everything removed afterwards, even on failure. What the
fake internet (fake_internet.py) and the secrets' echo host stand on."""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence

from tests import netplan


def names(prefix: str) -> tuple[str, str]:
    """A fresh (namespace, host-side veth) pair of names for `prefix` (netplan's)."""
    tok = secrets.token_hex(3)
    return f"{netplan.name(prefix)}-{tok}", f"{netplan.name(prefix)}{tok}"


@contextlib.contextmanager
def serving(
    ns: str,
    veth: str,
    setup: str,
    program: str,
    args: Sequence[str],
    ready: Callable[[], bool],
    what: str,
    undo: Sequence[Sequence[str]] = (),
) -> Iterator[None]:
    """`setup` (a shell script making `ns` and `veth`) run, then `program` (python -c) with
    `args` inside `ns` until `ready()` (10 s at most); afterwards the program killed, the
    `undo` commands run, the veth and the namespace deleted."""
    proc = None
    try:
        subprocess.run(["sh", "-c", setup], check=True)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", program, *args],
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not ready():
            assert time.monotonic() < deadline, f"{what} does not answer"
            time.sleep(0.05)
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        for cmd in undo:
            subprocess.run(list(cmd), capture_output=True)
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
