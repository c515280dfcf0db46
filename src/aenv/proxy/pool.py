"""Keep-alive connections to sandbox ports, shared by every forwarded HTTP request.

Keyed by (sandbox id, host, port), so a recycled sandbox address never inherits a
connection opened for another sandbox. Idle connections live `idle_timeout` seconds, below
the usual server keep-alive (uvicorn's is 5 s), and are swept as the pool is used.
"""

from __future__ import annotations

import asyncio
import time
import weakref

PoolKey = tuple[str, str, int]

HEAD_LIMIT = 1 << 17  # max bytes of a response head (status line + headers)


class Connection:
    """One upstream connection; `reused` once it has come back out of the pool."""

    __slots__ = ("key", "reader", "writer", "reused", "idle_since", "dropped", "__weakref__")

    def __init__(
        self, key: PoolKey, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.key = key
        self.reader = reader
        self.writer = writer
        self.reused = False
        self.idle_since = 0.0
        self.dropped = False  # broken off by `ConnectionPool.drop`: its sandbox is gone

    def usable(self) -> bool:
        # Bytes arriving on an idle connection (a 408, garbage) make it unusable too.
        pending = getattr(self.reader, "_buffer", None)
        return not (self.reader.at_eof() or self.writer.transport.is_closing() or pending)

    def close(self) -> None:
        self.writer.transport.close()

    def abort(self) -> None:
        self.writer.transport.abort()


class ConnectionPool:
    """Keep-alive connections to sandbox ports."""

    def __init__(
        self,
        *,
        connect_timeout: float = 5.0,
        idle_timeout: float = 4.0,
        max_idle_per_key: int = 32,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.max_idle_per_key = max_idle_per_key
        self._idle: dict[PoolKey, list[Connection]] = {}
        # Every open connection, idle or in use, by sandbox: `drop` breaks them all off.
        self._open: dict[str, weakref.WeakSet[Connection]] = {}
        self._last_sweep = time.monotonic()

    async def acquire(
        self, key: PoolKey, host: str, port: int, *, fresh: bool = False
    ) -> Connection:
        if not fresh:
            idle = self._idle.get(key)
            if idle:
                now = time.monotonic()
                while idle:
                    conn = idle.pop()
                    if now - conn.idle_since < self.idle_timeout and conn.usable():
                        conn.reused = True
                        return conn
                    conn.close()
        async with asyncio.timeout(self.connect_timeout):
            reader, writer = await asyncio.open_connection(host, port, limit=HEAD_LIMIT)
        conn = Connection(key, reader, writer)
        self._open.setdefault(key[0], weakref.WeakSet()).add(conn)
        return conn

    def release(self, conn: Connection) -> None:
        if not conn.usable():
            conn.close()
            return
        now = time.monotonic()
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= self.max_idle_per_key:
            conn.close()
        else:
            conn.idle_since = now
            idle.append(conn)
        if now - self._last_sweep > self.idle_timeout:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        self._last_sweep = now
        for key in list(self._idle):
            keep = []
            for conn in self._idle[key]:
                if now - conn.idle_since < self.idle_timeout and conn.usable():
                    keep.append(conn)
                else:
                    conn.close()
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]
        for sandbox_id in [s for s, conns in self._open.items() if not conns]:
            del self._open[sandbox_id]

    def drop(self, sandbox_id: str) -> None:
        """Breaks off every connection to one sandbox, idle or carrying a request (its
        processes ended: a reply in flight would never come, the peer sends no reset)."""
        for key in [k for k in self._idle if k[0] == sandbox_id]:
            self._idle.pop(key)
        for conn in list(self._open.pop(sandbox_id, ())):
            conn.dropped = True
            conn.abort()

    def idle_count(self, sandbox_id: str | None = None) -> int:
        return sum(len(v) for k, v in self._idle.items() if sandbox_id in (None, k[0]))

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
        await asyncio.sleep(0)
