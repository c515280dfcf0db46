"""The wire of envd's sudo service, shared by the client (``sudo.py``) and the service
(``sudo_service.py``): where the socket is, and frames of a 4-byte big-endian length and a
UTF-8 JSON object.

Standard library only, relative imports only: it is imported on every ``sudo``.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any

SCM_CREDENTIALS = getattr(socket, "SCM_CREDENTIALS", 2)
SO_PASSCRED = getattr(socket, "SO_PASSCRED", 16)
SOCKET_ENV = "AENV_ENVD_SUDO_SOCKET"
DEFAULT_SOCKET = "/run/aenv/sudo.sock"
PROTOCOL = 1
MAX_FRAME = 16 * 1024 * 1024
SUDO_GROUPS = ("sudo", "wheel", "admin")
SECURE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def encode_frame(msg: dict[str, Any]) -> bytes:
    """A 4-byte big-endian length, then the UTF-8 JSON object."""
    data = json.dumps(msg, separators=(",", ":")).encode()
    return struct.pack(">I", len(data)) + data


class FrameError(Exception):
    pass


def take_frames(buf: bytearray) -> list[dict[str, Any]]:
    """Removes every complete frame from `buf` and returns them decoded."""
    out: list[dict[str, Any]] = []
    while len(buf) >= 4:
        (n,) = struct.unpack(">I", buf[:4])
        if n > MAX_FRAME:
            raise FrameError(f"frame too large ({n} bytes)")
        if len(buf) < 4 + n:
            break
        try:
            msg = json.loads(bytes(buf[4 : 4 + n]))
        except ValueError as e:
            raise FrameError(f"bad frame: {e}") from None
        del buf[: 4 + n]
        if not isinstance(msg, dict):
            raise FrameError("frame is not a JSON object")
        out.append(msg)
    return out


def socket_path() -> str:
    return os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET
