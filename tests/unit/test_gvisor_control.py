"""The sandbox control-socket client (runtime/gvisor/control.py) against a stand-in urpc
server on a unix socket: the calls it sends, how answers and failures come back, and the
hold marker that recovery reads."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.errors import RuntimeFailure
from aenv.runtime.gvisor import control


class Sentry:
    """Answers urpc calls like runsc's sandbox: counts pauses, fails an unmatched resume."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.calls: list[str] = []
        self.args: list[object] = []
        self.paused = 0
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(4)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data, fds, _, _ = socket.recv_fds(conn, 65536, 8)
                msg = json.loads(data.decode())
                self.calls.append(msg["method"])
                self.args.append(msg["arg"])
                ok, err = True, ""
                if msg["method"] == control.CHECKPOINT:
                    for i, fd in enumerate(fds):  # what the sentry saves, file by file
                        os.write(fd, f"part {i}".encode())
                for fd in fds:
                    os.close(fd)
                if msg["method"] == control.PAUSE:
                    self.paused += 1
                elif msg["method"] == control.RESUME:
                    if self.paused == 0:
                        ok, err = False, "Invalid stopCount: -1"
                    else:
                        self.paused -= 1
                answer = json.dumps({"success": ok, "err": err, "result": {}}).encode()
                conn.sendall(answer[:5])  # in two pieces, as a stream may deliver it
                conn.sendall(answer[5:])

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def sentry(tmp_path: Path) -> Iterator[tuple[Sentry, Path, Path]]:
    s = Sentry(tmp_path / "runsc-c1.sock")
    state = tmp_path / "c1_sandbox:c1.state"
    state.write_text(json.dumps({"sandbox": {"controlSocketPath": str(s.path)}}))
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    yield s, state, bundle
    s.close()


def test_hold_and_let_go(sentry: tuple[Sentry, Path, Path]) -> None:
    s, state, bundle = sentry
    assert not control.is_held(bundle)
    control.hold(state, bundle)
    assert control.is_held(bundle) and s.paused == 1
    control.let_go(bundle)
    assert not control.is_held(bundle) and s.paused == 0
    control.let_go(bundle)  # nothing held: no call, so never an unmatched resume
    assert s.calls == [control.PAUSE, control.RESUME]


def test_a_refused_call_is_a_runtime_failure(sentry: tuple[Sentry, Path, Path]) -> None:
    s, _, _ = sentry
    with pytest.raises(RuntimeFailure, match="stopCount"):
        control.call(str(s.path), control.RESUME)


def test_no_socket_means_no_hold(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.write_text(json.dumps({"sandbox": {"controlSocketPath": str(tmp_path / "gone")}}))
    with pytest.raises(RuntimeFailure):
        control.hold(state, tmp_path)
    assert not control.is_held(tmp_path)
    state.write_text("{}")
    with pytest.raises(RuntimeFailure, match="no control socket"):
        control.control_socket(state)


def test_a_checkpoint_hands_the_sentry_its_image_files(
    sentry: tuple[Sentry, Path, Path], tmp_path: Path
) -> None:
    s, state, _ = sentry
    image = tmp_path / "image"
    image.mkdir()
    control.checkpoint(state, image, leave_running=True, timeout=5)
    assert s.calls == [control.CHECKPOINT]
    arg = s.args[0]
    assert isinstance(arg, dict)
    assert arg["Resume"] is True and arg["have_pages_file"] is True
    assert arg["metadata"] == {"compression": "none"}
    # The files `runsc restore` reads, in the sentry's order, written through the fds.
    assert [(image / n).read_text() for n in control.IMAGE_FILES] == ["part 0", "part 1", "part 2"]
    # An image is never written over: a second checkpoint into it fails before any call.
    with pytest.raises(RuntimeFailure, match="checkpoint.img"):
        control.checkpoint(state, image, leave_running=False, timeout=5)
    assert s.calls == [control.CHECKPOINT]
