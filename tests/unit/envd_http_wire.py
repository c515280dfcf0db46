"""Talking to envd over raw HTTP (httpx) for its unit tests: Connect-RPC envelopes and headers,
an incremental reader of a server stream, unary calls, a process run to its end and its
output, a bash command's request, Basic auth for a user.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from typing import Any

import httpx

STREAM = {"content-type": "application/connect+json", "connect-protocol-version": "1"}
UNARY = {"content-type": "application/json", "connect-protocol-version": "1"}


def envelope(msg: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(msg).encode()
    return struct.pack(">BI", flags, len(data)) + data


def parse_envelopes(data: bytes) -> list[tuple[int, dict[str, Any]]]:
    out = []
    while data:
        flags, n = struct.unpack(">BI", data[:5])
        out.append((flags, json.loads(data[5 : 5 + n])))
        data = data[5 + n :]
    return out


def basic(user: str) -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}


class Stream:
    """Incremental reader of a Connect server stream."""

    def __init__(self, resp: httpx.Response) -> None:
        self.resp = resp
        self.it = resp.iter_raw()
        self.buf = b""

    def next(self) -> tuple[int, dict[str, Any]]:
        while True:
            if len(self.buf) >= 5:
                flags, n = struct.unpack(">BI", self.buf[:5])
                if len(self.buf) >= 5 + n:
                    msg = json.loads(self.buf[5 : 5 + n])
                    self.buf = self.buf[5 + n :]
                    return flags, msg
            self.buf += next(self.it)

    def events(self) -> Iterator[dict[str, Any]]:
        while True:
            flags, msg = self.next()
            if flags & 2:
                if msg:
                    yield {"_eos": msg}
                return
            yield msg


def rpc(client: httpx.Client, method: str, msg: dict[str, Any], **headers: str) -> httpx.Response:
    return client.post("/" + method, json=msg, headers={**UNARY, **headers})


def run(
    client: httpx.Client, msg: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Start a process, collect the whole stream: (events, end-of-stream message)."""
    r = client.post(
        "/process.Process/Start", content=envelope(msg), headers={**STREAM, **(headers or {})}
    )
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/connect+json"
    msgs = parse_envelopes(r.content)
    assert msgs[-1][0] == 2
    return [m["event"] for _, m in msgs[:-1]], msgs[-1][1]


def output(events: list[dict[str, Any]], kind: str) -> bytes:
    return b"".join(
        base64.b64decode(e["data"][kind]) for e in events if "data" in e and kind in e["data"]
    )


def bash(cmd: str, tag: str | None = None, **extra: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {
        "process": {"cmd": "/bin/bash", "args": ["-c", cmd], **extra},
        "stdin": False,
    }
    if tag is not None:
        msg["tag"] = tag
    return msg
