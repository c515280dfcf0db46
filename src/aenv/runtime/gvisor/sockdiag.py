"""Aborting the host's TCP connections to one address through the kernel's sock_diag
netlink interface (what `ss -K dst ADDR` does), without starting a process: a dump of the
connected TCP sockets whose destination is the address (filtered in the kernel by an
inet_diag bytecode condition), then SOCK_DESTROY for each. Needs CAP_NET_ADMIN and a
kernel built with CONFIG_INET_DIAG_DESTROY; `SockDiagError` otherwise.

Message layouts (linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h):
nlmsghdr        u32 len, u16 type, u16 flags, u32 seq, u32 pid
inet_diag_req_v2 u8 family, u8 protocol, u8 ext, u8 pad, u32 states, inet_diag_sockid
inet_diag_sockid be16 sport, be16 dport, be32 src[4], be32 dst[4], u32 if, u32 cookie[2]
inet_diag_msg   u8 family, u8 state, u8 timer, u8 retrans, inet_diag_sockid, u32 × 5
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
SOCK_DESTROY = 21
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
INET_DIAG_REQ_BYTECODE = 1
INET_DIAG_BC_D_COND = 8

# The states `ss` calls connected: all but LISTEN, CLOSE, TIME_WAIT and SYN_RECV.
_CONNECTED = sum(1 << s for s in (1, 2, 4, 5, 8, 9, 11))

_NLMSGHDR = struct.Struct("=IHHII")
_REQ_HEAD = struct.Struct("=BBBBI")
_SOCKID_LEN = 48
_DIAG_MSG_LEN = 4 + _SOCKID_LEN + 20
_NLMSGERR = struct.Struct("=i")


class SockDiagError(OSError):
    pass


def _align4(n: int) -> int:
    return (n + 3) & ~3


def _message(kind: int, flags: int, seq: int, body: bytes) -> bytes:
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), kind, flags, seq, 0) + body


def _dst_filter(addr: ipaddress.IPv4Address | ipaddress.IPv6Address, family: int) -> bytes:
    """An INET_DIAG_REQ_BYTECODE attribute: one D_COND op, true when the destination is
    `addr` (any port); false jumps past the end, which rejects the socket."""
    raw = addr.packed
    cond = struct.pack("=BBxxi", family, len(raw) * 8, -1) + raw  # hostcond: int port aligned
    op_len = 4 + len(cond)
    program = struct.pack("=BBH", INET_DIAG_BC_D_COND, op_len, op_len + 4) + cond
    attr_len = 4 + len(program)
    return struct.pack("=HH", attr_len, INET_DIAG_REQ_BYTECODE) + program


def _replies(sock: socket.socket, seq: int) -> list[tuple[int, bytes]]:
    """Every (type, payload) answering `seq`, up to NLMSG_DONE or an error/ack."""
    out: list[tuple[int, bytes]] = []
    while True:
        data = sock.recv(1 << 16)
        off = 0
        while off + _NLMSGHDR.size <= len(data):
            length, kind, _flags, got_seq, _pid = _NLMSGHDR.unpack_from(data, off)
            if length < _NLMSGHDR.size:
                raise SockDiagError(errno.EPROTO, "sock_diag: malformed netlink message")
            payload = data[off + _NLMSGHDR.size : off + length]
            off += _align4(length)
            if got_seq != seq:
                continue
            if kind == NLMSG_DONE:
                return out
            if kind == NLMSG_ERROR:
                (code,) = _NLMSGERR.unpack_from(payload)
                if code:
                    raise SockDiagError(-code, f"sock_diag: {os.strerror(-code)}")
                return out  # an ack
            out.append((kind, payload))


def destroy_tcp_to(address: str) -> int:
    """Aborts every connected TCP socket of this network namespace whose peer is `address`
    (either side sees a reset, the local one ECONNABORTED); how many were aborted."""
    addr = ipaddress.ip_address(address)
    family = socket.AF_INET if addr.version == 4 else socket.AF_INET6
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
    except OSError as e:
        raise SockDiagError(e.errno, f"sock_diag: {e.strerror}") from None
    with sock:
        head = _REQ_HEAD.pack(family, socket.IPPROTO_TCP, 0, 0, _CONNECTED)
        dump = head + bytes(_SOCKID_LEN) + _dst_filter(addr, family)
        sock.send(_message(SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, dump))
        found = [p for kind, p in _replies(sock, 1) if kind == SOCK_DIAG_BY_FAMILY]
        destroyed = 0
        for seq, msg in enumerate(found, start=2):
            if len(msg) < _DIAG_MSG_LEN:
                continue
            state = msg[1]
            sockid = msg[4 : 4 + _SOCKID_LEN]
            body = _REQ_HEAD.pack(family, socket.IPPROTO_TCP, 0, 0, 1 << state) + sockid
            sock.send(_message(SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK, seq, body))
            try:
                _replies(sock, seq)
            except SockDiagError as e:
                if e.errno != errno.ENOENT:  # closed meanwhile: nothing to abort
                    raise
                continue
            destroyed += 1
        return destroyed
