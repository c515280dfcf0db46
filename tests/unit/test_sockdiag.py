"""Aborting the host's TCP connections to one address (sock_diag SOCK_DESTROY), on loopback
addresses of the test's own listeners."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Iterator

import pytest

from aenv.runtime.gvisor.sockdiag import destroy_tcp_to

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="SOCK_DESTROY needs CAP_NET_ADMIN")


@contextlib.contextmanager
def _connections(address: str, n: int) -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    """`n` connections to a listener of ours on `address`: (client, accepted) pairs."""
    with contextlib.ExitStack() as stack:
        listener = stack.enter_context(socket.socket())
        listener.bind((address, 0))
        listener.listen()
        pairs = []
        for _ in range(n):
            client = stack.enter_context(socket.create_connection(listener.getsockname()))
            accepted = stack.enter_context(listener.accept()[0])
            pairs.append((client, accepted))
        yield pairs


def _aborted(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        sock.sendall(b"x")
        sock.recv(1)
    except OSError as e:
        return e.errno in (errno.ECONNABORTED, errno.ECONNRESET, errno.EPIPE)
    return False


def test_connections_to_the_address_are_aborted_and_others_kept() -> None:
    with _connections("127.77.0.1", 3) as target, _connections("127.77.0.2", 1) as other:
        assert destroy_tcp_to("127.77.0.1") == 3
        assert all(_aborted(client) for client, _ in target)
        client, accepted = other[0]
        client.sendall(b"still here")
        assert accepted.recv(64) == b"still here"


def test_no_connection_to_the_address_is_nothing_to_do() -> None:
    with _connections("127.77.0.3", 1) as other:
        assert destroy_tcp_to("127.77.0.4") == 0
        client, accepted = other[0]
        client.sendall(b"ok")
        assert accepted.recv(8) == b"ok"


def test_not_an_address_is_refused() -> None:
    with pytest.raises(ValueError):
        destroy_tcp_to("sandbox-1")
