"""A sandbox's own control socket: runsc's pause, resume and checkpoint without a runsc
process.

Each `runsc pause`, `resume` or `checkpoint` starts the runsc binary (~20-25 ms here) only to
send one JSON call over the sandbox's control socket (gVisor's urpc: `{"method", "arg"}` in,
`{"success", "err", "result"}` out, on a unix stream socket whose path runsc keeps in the
container's state file; a call's files ride along as SCM_RIGHTS). A live snapshot holds a
sandbox around its checkpoint, so it makes all three calls itself.

The sentry counts pauses, and an unmatched resume brings it down, so a hold is recorded in a
marker file in the container's bundle before the pause and removed after the resume: the
marker, not runsc's state file (which a direct call does not touch), says a sandbox is held,
also to the recovery after a crash.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path

from aenv.errors import RuntimeFailure

PAUSE = "containerManager.Pause"
RESUME = "containerManager.Resume"
CHECKPOINT = "containerManager.Checkpoint"
# The image's files in the order the sentry takes them (runsc/boot/restore.go), the same
# names `runsc checkpoint --compression=none` writes and `runsc restore` reads.
IMAGE_FILES = ("checkpoint.img", "pages_meta.img", "pages.img")
HELD_MARKER = "held"
_TIMEOUT = 30.0


def control_socket(state_file: Path | None) -> str:
    """The control socket's path from runsc's state file of the sandbox's root container."""
    if state_file is None:
        raise RuntimeFailure("no runsc state file for the sandbox")
    try:
        data = json.loads(state_file.read_text())
        return str(data["sandbox"]["controlSocketPath"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RuntimeFailure(f"no control socket in {state_file}: {e}") from None


def checkpoint(
    state_file: Path | None, image_dir: Path, *, leave_running: bool, timeout: float
) -> None:
    """`runsc checkpoint --compression=none [--leave-running]` as the sandbox's own call: the
    sentry writes its state and memory into three new files of `image_dir`. A held sandbox
    stays held (the sentry counts pauses). Blocking: run it off the event loop."""
    path = control_socket(state_file)
    fds: list[int] = []
    try:
        for name in IMAGE_FILES:
            flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC
            try:
                fds.append(os.open(image_dir / name, flags, 0o644))
            except OSError as e:
                raise RuntimeFailure(f"checkpoint image {image_dir / name}: {e}") from None
        opts = {
            "key": None,
            "metadata": {"compression": "none"},
            "MemoryFileSaveOpts": {"ExcludeCommittedZeroPages": False},
            "have_pages_file": True,
            "Resume": leave_running,
        }
        call(path, CHECKPOINT, opts, fds=fds, timeout=timeout)
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def call(
    path: str,
    method: str,
    arg: object = None,
    *,
    fds: list[int] | None = None,
    timeout: float = _TIMEOUT,
) -> object:
    """One urpc call; its result. Blocking: run it off the event loop."""
    data = json.dumps({"method": method, "arg": arg}).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
            # The files go with the message's first bytes, in one sendmsg.
            sent = socket.send_fds(s, [data], fds) if fds else 0
            if sent < len(data):
                s.sendall(data[sent:])
            answer = _read_json(s)
    except OSError as e:
        raise RuntimeFailure(f"{method} on {path}: {e}") from None
    if not isinstance(answer, dict) or not answer.get("success"):
        err = answer.get("err") if isinstance(answer, dict) else answer
        raise RuntimeFailure(f"{method} on {path} failed: {err}")
    return answer.get("result")


def _read_json(s: socket.socket) -> object:
    decoder = json.JSONDecoder()
    buf = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            raise OSError("the sandbox closed its control socket mid-answer")
        buf += chunk
        try:
            value, _ = decoder.raw_decode(buf.decode())
        except (ValueError, UnicodeDecodeError):
            continue  # not all there yet
        return value


def hold(state_file: Path | None, bundle_dir: Path) -> None:
    """Stops the sandbox's tasks (the sentry's own pause), marked in `bundle_dir`."""
    path = control_socket(state_file)
    marker = bundle_dir / HELD_MARKER
    marker.write_text(path)
    try:
        call(path, PAUSE)
    except BaseException:
        marker.unlink(missing_ok=True)
        raise


def is_held(bundle_dir: Path) -> bool:
    return (bundle_dir / HELD_MARKER).exists()


def let_go(bundle_dir: Path) -> None:
    """Ends a `hold` (no-op without one)."""
    marker = bundle_dir / HELD_MARKER
    try:
        path = marker.read_text()
    except FileNotFoundError:
        return
    call(path, RESUME)
    marker.unlink(missing_ok=True)
