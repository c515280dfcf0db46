"""Added latency of the data-plane proxy for a small unary request (an envd RPC round-trip).

Separate processes, as in production: an upstream (a uvicorn app answering like envd's
`filesystem.Filesystem/Stat`), the SandboxRouter on uvicorn + uvloop + httptools with our
forwarder, and for comparison the same router with an httpx.AsyncClient forwarder. A raw
keep-alive client sends sequential small POSTs to each; the overhead is proxied minus direct.
Then the same with several connections in parallel, for throughput.

    .venv/bin/python bench/proxy_overhead.py [--requests 3000] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import statistics
import time
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

from aenv.domain import ENVD_PORT, Upstream

BODY = b'{"path":"/home/user"}'
REPLY = (
    b'{"entry":{"name":"user","type":"FILE_TYPE_DIRECTORY","path":"/home/user",'
    b'"size":"4096","mode":493,"permissions":"drwxr-xr-x","owner":"user","group":"user",'
    b'"modifiedTime":"2025-01-01T00:00:00Z"}}'
)
REQUEST = (
    b"POST /filesystem.Filesystem/Stat HTTP/1.1\r\nhost: 127.0.0.1:8000\r\n"
    b"user-agent: connectrpc/0.12.1\r\ncontent-type: application/json\r\n"
    b"connect-protocol-version: 1\r\naccept-encoding: identity\r\n"
    b"content-encoding: identity\r\ne2b-sandbox-id: sbxbench\r\ne2b-sandbox-port: %d\r\n"
    b"x-access-token: 0123456789abcdef\r\ncontent-length: %d\r\n\r\n%b"
    % (ENVD_PORT, len(BODY), BODY)
)


# ------------------------------------------------------------------ servers (child processes)


async def upstream_app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(REPLY)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": REPLY})


async def control_app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


def make_httpx_forwarder() -> Any:
    """The alternative measured against: the same job with httpx.AsyncClient (streaming)."""
    import httpx

    from aenv.proxy._common import end_to_end, send_json
    from aenv.proxy.http import HttpForwarder

    class HttpxForwarder(HttpForwarder):
        def __init__(self) -> None:
            super().__init__()
            self.client = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=5.0),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                trust_env=False,
            )

        async def forward(self, scope: Any, receive: Any, send: Any, target: Any) -> None:
            first = await receive()
            content: Any = first.get("body", b"")
            if first.get("more_body"):
                head = content

                async def rest() -> AsyncIterator[bytes]:
                    yield head
                    while True:
                        message = await receive()
                        if message["type"] != "http.request":
                            return
                        yield message.get("body", b"")
                        if not message.get("more_body"):
                            return

                content = rest()
            headers = end_to_end(target.headers, frozenset({b"expect", b"content-length"}))
            url = f"http://{target.authority}{target.request_target.decode('latin-1')}"
            request = self.client.build_request(
                scope["method"], url, headers=headers, content=content
            )
            try:
                response = await self.client.send(request, stream=True)
            except httpx.TransportError as exc:
                await send_json(send, 502, target.unreachable(str(exc)))
                return
            try:
                out = end_to_end(response.headers.raw, frozenset())
                await send(
                    {"type": "http.response.start", "status": response.status_code, "headers": out}
                )
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await response.aclose()

    return HttpxForwarder()


def run_server(role: str, port: int, upstream_port: int) -> None:
    import uvicorn

    from aenv.proxy import SandboxRouter

    app: Any
    if role == "upstream":
        app = upstream_app
    else:

        async def resolver(sandbox_id: str, sandbox_port: int, token: str | None) -> Upstream:
            return Upstream("127.0.0.1", upstream_port)

        http = make_httpx_forwarder() if role == "httpx" else None
        app = SandboxRouter(control_app, resolver, ["localhost"], http=http)
    uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            loop="uvloop",
            http="httptools",
            lifespan="off" if role == "upstream" else "on",
            log_level="warning",
            access_log=False,
            server_header=False,
            date_header=False,
        )
    ).run()


# ------------------------------------------------------------------ client (this process)


class RawClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def request(self) -> None:
        self.writer.write(REQUEST)
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.decode("latin-1"))
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await self.reader.readexactly(length)


async def latency(port: int, n: int) -> list[float]:
    client = RawClient(*await asyncio.open_connection("127.0.0.1", port))
    for _ in range(200):
        await client.request()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await client.request()
        samples.append(time.perf_counter() - t0)
    client.writer.close()
    return samples


async def throughput(port: int, concurrency: int, seconds: float) -> float:
    clients = [
        RawClient(*await asyncio.open_connection("127.0.0.1", port)) for _ in range(concurrency)
    ]
    done = 0
    stop = time.perf_counter() + seconds

    async def loop(client: RawClient) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await client.request()
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(loop(c) for c in clients))
    elapsed = time.perf_counter() - t0
    for c in clients:
        c.writer.close()
    return done / elapsed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"server on port {port} did not start")


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e3


async def measure(ports: dict[str, int], n: int, concurrency: int, seconds: float) -> None:
    results = {name: await latency(port, n) for name, port in ports.items()}
    direct = statistics.median(results["direct"])
    print(f"sequential small POST (Connect unary), {n} requests each, ms:")
    print(f"  {'path':<22}{'p50':>8}{'p90':>8}{'p99':>8}{'added p50':>11}")
    for name, samples in results.items():
        med = statistics.median(samples)
        added = "" if name == "direct" else f"{(med - direct) * 1e3:>11.3f}"
        print(
            f"  {name:<22}{med * 1e3:>8.3f}{pct(samples, 0.9):>8.3f}{pct(samples, 0.99):>8.3f}{added}"
        )
    print(f"throughput with {concurrency} keep-alive connections, {seconds:.0f} s each, req/s:")
    for name, port in ports.items():
        rate = await throughput(port, concurrency, seconds)
        print(f"  {name:<22}{rate:>10.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()

    ctx = multiprocessing.get_context("spawn")
    upstream, ours, alt = free_port(), free_port(), free_port()
    procs = [
        ctx.Process(target=run_server, args=("upstream", upstream, 0), daemon=True),
        ctx.Process(target=run_server, args=("ours", ours, upstream), daemon=True),
        ctx.Process(target=run_server, args=("httpx", alt, upstream), daemon=True),
    ]
    for p in procs:
        p.start()
    try:
        for port in (upstream, ours, alt):
            wait_ready(port)
        ports = {"direct": upstream, "proxy (asyncio fwd)": ours, "proxy (httpx fwd)": alt}
        try:
            import uvloop

            uvloop.run(measure(ports, args.requests, args.concurrency, args.seconds))
        except ImportError:
            asyncio.run(measure(ports, args.requests, args.concurrency, args.seconds))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(5)


if __name__ == "__main__":
    main()
