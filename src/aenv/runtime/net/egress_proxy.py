"""Domain egress rules and header transforms: a small TCP proxy in the router netns of each
sandbox whose policy names domains or has `rules` with transforms (`EgressPolicy.proxied`).

The router netns redirects the sandbox's new TCP connections to ports 80 and 443
(`network.egress_rules`) to a listener this module opens inside that netns, on the gateway
address the sandbox already routes through. Per connection it reads the original
destination (SO_ORIGINAL_DST), peeks the first bytes for the HTTP Host header (port 80) or
the TLS server name (443, `sniff`; nothing is decrypted), decides with
`EgressPolicy.allows(address, name)` and then either closes the connection or opens one to
the original destination from the router netns and copies bytes both ways, the peeked
ones first. As in E2B, a refused connection was accepted first: the sandbox sees it close,
not a reset before the handshake. A connection to a host with header `rules`
(`EgressPolicy.headers_for`) is not spliced but opened (`egress_intercept`): TLS
terminated with the node's egress CA (`egress_ca`), each request given its headers with
the owner's secrets resolved, re-encrypted to the real host. Every other connection is
spliced untouched, as before.

Addresses no rule can open (`fixed_denies`) are refused here before any rule is looked at;
the proxy's own connections also leave through the host's veth, so the host's fixed denies
(`network.Network._host_rules`) hold for them as for the sandbox's own packets.

Sockets of a router netns are made by one dedicated thread that enters the netns with
setns(2) and comes back (`NetnsSockets`); a socket keeps its netns for life, so the event
loop serves them as any other."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import logging
import os
import socket
import ssl
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from aenv.domain import EgressPolicy
from aenv.egress import SecretLookup, UnknownSecret, placeholder_names, resolve_placeholders
from aenv.runtime.net import egress_intercept as intercept
from aenv.runtime.net import sniff
from aenv.runtime.net.egress_ca import EgressCA

log = logging.getLogger("aenv.runtime")

PROXY_PORT = 3129  # in every router netns, on its gateway address
REDIRECTED_PORTS = (80, 443)
# Linux: getsockopt(SOL_IP, SO_ORIGINAL_DST) of a redirected connection (netfilter).
SO_ORIGINAL_DST = 80
CLONE_NEWNET = 0x40000000
PEEK_LIMIT = 16384  # a ClientHello fits one 16 KiB record; an HTTP head as much
PEEK_TIMEOUT = 10.0
CONNECT_TIMEOUT = 10.0
MAX_CONNECTIONS = 256  # open at once per sandbox; more are refused
CHUNK = 65536

# Never reachable through the proxy, whatever the rules: "this network", loopback,
# link-local (metadata), multicast and the reserved rest. The node's own networks and the
# sandboxes' range are added by the caller.
STATIC_DENIES = tuple(
    ipaddress.IPv4Network(n) for n in ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/3")
)

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


class NetnsSockets:
    """TCP sockets created inside a named network namespace, by one thread of its own (so
    no other work ever runs in a foreign netns)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def _make(self, ns_path: str, bind: tuple[str, int] | None) -> socket.socket:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            target = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(target)
            finally:
                os.close(target)
            try:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            finally:
                _setns(home)
        finally:
            os.close(home)
        try:
            s.setblocking(False)
            if bind is not None:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(bind)
                s.listen(128)
        except BaseException:
            s.close()
            raise
        return s

    async def socket(self, ns_path: str, bind: tuple[str, int] | None = None) -> socket.socket:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aenv-netns")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._make, ns_path, bind)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where a redirected connection was going (struct sockaddr_in)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, addr = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(addr), port


def peek_name(port: int, data: bytes) -> sniff.Sniffed:
    return sniff.tls_sni(data) if port == 443 else sniff.http_host(data)


@dataclass
class _SlotProxy:
    ns_path: str
    policy: EgressPolicy
    server: asyncio.Server | None = None
    conns: set[asyncio.Task[None]] = field(default_factory=set)


class EgressProxies:
    """The proxies of every slot whose policy has domain rules, keyed by slot index."""

    def __init__(
        self, gateway_ip: str, fixed_denies: Callable[[], Sequence[ipaddress.IPv4Network]]
    ) -> None:
        self.gateway_ip = gateway_ip
        self.fixed_denies = fixed_denies
        self.sockets = NetnsSockets()
        self._slots: dict[int, _SlotProxy] = {}
        # For header transforms: the CA that signs the hosts' certificates (None: HTTPS to
        # a host with rules is spliced untouched) and the owners' secrets.
        self.ca: EgressCA | None = None
        self.secrets: SecretLookup | None = None

    def active(self, n: int) -> bool:
        return n in self._slots

    async def apply(self, n: int, ns_path: str, policy: EgressPolicy) -> None:
        """Serves slot `n` with `policy` (normalized, with domains); a running proxy takes
        the new policy for its next connections."""
        proxy = self._slots.get(n)
        if proxy is not None and proxy.ns_path == ns_path:
            proxy.policy = policy
            return
        if proxy is not None:
            await self.stop(n)
        proxy = _SlotProxy(ns_path, policy)
        listener = await self.sockets.socket(ns_path, (self.gateway_ip, PROXY_PORT))
        try:
            proxy.server = await asyncio.start_server(
                lambda r, w: self._accept(proxy, r, w), sock=listener
            )
        except BaseException:
            listener.close()
            raise
        self._slots[n] = proxy

    async def stop(self, n: int) -> None:
        """Closes slot `n`'s listener and the connections it carries (they hold the netns)."""
        proxy = self._slots.pop(n, None)
        if proxy is None:
            return
        if proxy.server is not None:
            proxy.server.close()
        for task in list(proxy.conns):
            task.cancel()
        await asyncio.gather(*proxy.conns, return_exceptions=True)
        if proxy.server is not None:
            with contextlib.suppress(Exception):
                await proxy.server.wait_closed()

    async def close(self) -> None:
        for n in list(self._slots):
            await self.stop(n)
        self.sockets.close()

    # Connections ---------------------------------------------------------------------------

    def _accept(
        self, proxy: _SlotProxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if len(proxy.conns) >= MAX_CONNECTIONS:
            writer.close()
            return
        task = asyncio.create_task(self._serve(proxy, reader, writer))
        proxy.conns.add(task)
        task.add_done_callback(proxy.conns.discard)

    def _denied_always(self, ip: str) -> bool:
        addr = ipaddress.IPv4Address(ip)
        return any(addr in net for net in (*STATIC_DENIES, *self.fixed_denies()))

    async def _serve(
        self, proxy: _SlotProxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        upstream: asyncio.StreamWriter | None = None
        try:
            sock = writer.get_extra_info("socket")
            ip, port = original_destination(sock)
            if port not in REDIRECTED_PORTS or self._denied_always(ip):
                log.debug("egress proxy: %s:%d is never reachable", ip, port)
                return
            head, name = await self._peek(reader, port)
            policy = proxy.policy
            if not policy.allows(ip, name):
                log.debug("egress proxy: %s:%d (%s) refused", ip, port, name)
                return
            if policy.headers_for(name) is not None and (port == 80 or self.ca is not None):
                await self._intercept(proxy, policy, reader, writer, (ip, port), name, head)
                return
            out = await self._connect(proxy, ip, port)
            up_reader, upstream = await asyncio.open_connection(sock=out)
            upstream.write(head)
            await asyncio.gather(_pipe(reader, upstream), _pipe(up_reader, writer))
        except (OSError, TimeoutError) as e:
            log.debug("egress proxy connection ended: %s", e)
        except Exception:  # never leave a task with an unretrieved exception
            log.exception("egress proxy connection failed")
        finally:
            for w in (writer, upstream):
                if w is not None:
                    w.close()

    async def _connect(self, proxy: _SlotProxy, ip: str, port: int) -> socket.socket:
        out = await self.sockets.socket(proxy.ns_path)
        try:
            await asyncio.wait_for(
                asyncio.get_running_loop().sock_connect(out, (ip, port)), CONNECT_TIMEOUT
            )
        except BaseException:
            out.close()
            raise
        return out

    async def _intercept(
        self,
        proxy: _SlotProxy,
        policy: EgressPolicy,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        dest: tuple[str, int],
        name: str | None,
        head: bytes,
    ) -> None:
        """A connection to a host with header rules: opened, its requests rewritten."""
        assert name is not None
        ip, port = dest

        def resolve(value: str) -> str:
            if self.secrets is None:
                names = placeholder_names(value)
                if names:
                    raise UnknownSecret(names[0])
                return value
            return resolve_placeholders(value, policy.owner, self.secrets)

        client: intercept.Stream
        headers_for: intercept.HeadersFor = policy.headers_for
        if port == 80:
            client = intercept.PlainStream(reader, writer, head)
        else:
            assert self.ca is not None
            ca = self.ca
            ctx = ca.cached_context(name)
            if ctx is None:
                ctx = await asyncio.to_thread(ca.server_context, name)
            tls = intercept.TlsServerStream(reader, writer, ctx, head)
            await asyncio.wait_for(tls.handshake(), intercept.HANDSHAKE_TIMEOUT)
            client = tls
            fixed = policy.headers_for(name)  # the name the client verified our certificate for
            headers_for = lambda _host: fixed  # noqa: E731

        try:
            out = await self._connect(proxy, ip, port)
            if port == 80:
                up_reader, up_writer = await asyncio.open_connection(sock=out)
            else:
                assert self.ca is not None
                up_ctx = await asyncio.to_thread(self.ca.upstream_context)
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(
                        sock=out,
                        ssl=up_ctx,
                        server_hostname=name,
                        ssl_handshake_timeout=intercept.HANDSHAKE_TIMEOUT,
                    ),
                    CONNECT_TIMEOUT + intercept.HANDSHAKE_TIMEOUT,
                )
        except ssl.SSLCertVerificationError as e:
            log.info("egress to %s: its certificate did not verify: %s", name, e.verify_message)
            await intercept.refuse(client, f"the certificate of {name} did not verify")
            return
        except (OSError, TimeoutError) as e:
            log.debug("egress to %s failed: %s", name, e)
            await intercept.refuse(client, f"could not reach {name}")
            return
        upstream = intercept.PlainStream(up_reader, up_writer)
        try:
            await intercept.serve(client, upstream, headers_for, resolve, name)
        finally:
            upstream.close()
            client.close()

    async def _peek(self, reader: asyncio.StreamReader, port: int) -> tuple[bytes, str | None]:
        """The first bytes (to be sent on) and the name in them, if any."""
        head = b""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PEEK_TIMEOUT
        while len(head) < PEEK_LIMIT:
            try:
                chunk = await asyncio.wait_for(
                    reader.read(PEEK_LIMIT - len(head)), max(0.0, deadline - loop.time())
                )
            except TimeoutError:
                break
            if not chunk:
                break
            head += chunk
            found = peek_name(port, head)
            if found != sniff.MORE:
                return head, found
        return head, None


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copies until EOF, then half-closes the other side (the other direction goes on)."""
    try:
        while chunk := await reader.read(CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.close()
