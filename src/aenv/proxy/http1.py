"""The upstream side's HTTP/1.x as the forwarder reads it: a response head parsed strictly
(a sandbox may answer anything), and what went wrong said in a few words."""

from __future__ import annotations

import asyncio

from ._common import Headers


class UpstreamProtocolError(Exception):
    """The sandbox answered with something that is not HTTP/1.x."""


def describe(exc: BaseException) -> str:
    """An upstream failure in a few words, for a log line or an error answer."""
    if isinstance(exc, TimeoutError):
        return "connect timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, asyncio.IncompleteReadError):
        return "connection closed early"
    return str(exc) or type(exc).__name__


def parse_head(data: bytes) -> tuple[bytes, int, Headers]:
    """An HTTP/1.x response head (without its blank line): version, status, headers with
    lower-case names. UpstreamProtocolError for anything else."""
    lines = data.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    if not version.startswith(b"HTTP/1.") or len(rest) < 3 or not rest[:3].isdigit():
        raise UpstreamProtocolError(f"bad status line {lines[0][:80]!r}")
    headers: Headers = []
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise UpstreamProtocolError(f"bad header line {line[:80]!r}")
        headers.append((name.lower(), value.strip()))
    return version, int(rest[:3]), headers
