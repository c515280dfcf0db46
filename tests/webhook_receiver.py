"""A real webhook receiver on loopback for the events tests: it checks each delivery's
`e2b-signature` the way E2B's docs tell a receiver to (their Python verification code:
SHA-256 of the secret followed by the raw body, base64 with `+/` → `-_`, no padding), keeps
what it got, and can refuse (503) or be slow on demand."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.helpers import http_server_thread


def verify_webhook_signature(secret: str, payload: str, payload_signature: str) -> bool:
    """E2B's verification, as their "Sandbox lifecycle webhooks" page gives it."""
    hash_bytes = hashlib.sha256((secret + payload).encode("utf-8")).digest()
    expected_signature = base64.b64encode(hash_bytes).decode("utf-8")
    expected_signature = expected_signature.replace("+", "-").replace("/", "_").rstrip("=")
    return expected_signature == payload_signature


@dataclass
class Received:
    headers: dict[str, str]
    body: str
    signed: bool

    @property
    def event(self) -> dict[str, Any]:
        return dict(json.loads(self.body))


@dataclass
class Receiver:
    secret: str = "s3cret-for-tests"
    # Requests answered 503 before the receiver accepts (-1: refuse until told otherwise).
    refuse: int = 0
    # Seconds each request waits before it is answered (a slow receiver).
    delay: float = 0.0
    url: str = ""
    accepted: list[Received] = field(default_factory=list)
    refused: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def handle(self, headers: dict[str, str], body: str) -> int:
        if self.delay:
            time.sleep(self.delay)
        with self._lock:
            if self.refuse != 0:
                self.refuse -= 1 if self.refuse > 0 else 0
                self.refused += 1
                return 503
            sig = headers.get("e2b-signature", "")
            self.accepted.append(
                Received(headers, body, verify_webhook_signature(self.secret, body, sig))
            )
            return 200

    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return [r.event for r in self.accepted]

    def wait_for(self, n: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.events()
            if len(got) >= n:
                return got
            time.sleep(0.02)
        raise AssertionError(f"the receiver got {len(self.events())} events, not {n}")


@contextlib.contextmanager
def receiving(receiver: Receiver | None = None) -> Iterator[Receiver]:
    rcv = receiver or Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
            n = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(n).decode()
            status = rcv.handle({k.lower(): v for k, v in self.headers.items()}, body)
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            return None

    with http_server_thread(Handler) as url:
        rcv.url = url + "/hook"
        yield rcv
