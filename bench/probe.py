"""`python -m bench.probe URL [INTERVAL]`: GET URL/health every INTERVAL seconds (0.1) and
print each round trip in ms, one a line, until killed. A process of its own, started at a
high priority by `HealthProbe`, so what it measures is the server's answer under load and not
the bench's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def main(url: str, interval: float) -> None:
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as c:
        while True:
            t0 = time.perf_counter()
            try:
                c.get("/health")
                ms = (time.perf_counter() - t0) * 1000
            except httpx.HTTPError:
                ms = -1.0
            print(f"{ms:.2f}", flush=True)
            time.sleep(max(0.0, interval - (time.perf_counter() - t0)))


def _raise_priority() -> None:
    with contextlib.suppress(OSError):
        os.nice(-10)


class HealthProbe:
    """`async with HealthProbe(url) as probe:` ... `probe.latencies` (ms; -1 a failure)."""

    def __init__(self, url: str, interval: float = 0.1) -> None:
        self.url, self.interval = url, interval
        self.latencies: list[float] = []

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[HealthProbe]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.probe",
            self.url,
            str(self.interval),
            stdout=subprocess.PIPE,
            preexec_fn=_raise_priority,
            cwd=REPO,
        )
        assert proc.stdout is not None
        stdout = proc.stdout

        async def read() -> None:
            while line := await stdout.readline():
                with contextlib.suppress(ValueError):
                    self.latencies.append(float(line))

        reader = asyncio.create_task(read())
        try:
            yield self
        finally:
            proc.kill()
            await proc.wait()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(reader, 5)

    def quantile(self, q: float) -> float | None:
        ok = sorted(x for x in self.latencies if x >= 0)
        if len(ok) < 2:
            return ok[0] if ok else None
        return statistics.quantiles(ok, n=100, method="inclusive")[int(q * 100) - 1]

    @property
    def failures(self) -> int:
        return sum(1 for x in self.latencies if x < 0)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.1)
