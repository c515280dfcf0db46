"""`make soak [MINUTES=30] [AT_ONCE=8]`: agent-RL rollouts (the `rollouts` episode: create
from a task snapshot, 10 commands, a fork into 2 children with 3 commands each, kill) kept
running `AT_ONCE` at a time for `MINUTES` on a server of its own, then a check that nothing
was lost or left behind: every episode passed; no sandbox listed; as many runsc processes,
mounts, network namespaces, btrfs subvolumes (and their quota groups), catalog rows and
bytes of disk as before the first episode (the warm pool's and the task snapshot's
included); and the server's RSS flat (its last sample within 25% + 32 MiB of its first).
Prints a line a minute, writes `bench/results/soak-<date>.json`, exits 1 on any failure."""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from .client import Api, BenchError
from .cpu import CpuMeter
from .plan import NullProgress, Plan
from .rollouts import Level, ServerRollouts
from .server import NET_PREFIX, BenchServer, build_base, remove_home
from .stats import Results

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Footprint:
    """What a node holds on the host, counted by name."""

    runsc_processes: int
    mounts: int
    netns: int
    subvolumes: int
    qgroups: int
    catalog_sandboxes: int
    disk_mib: int

    @classmethod
    def of(cls, home: Path) -> Footprint:
        def lines(cmd: list[str]) -> list[str]:
            r = subprocess.run(cmd, capture_output=True, text=True, check=False)
            return r.stdout.splitlines()

        mounts = sum(
            1
            for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if f" {home}/" in line
        )
        rw = home / "rw"
        subvols = lines(["btrfs", "subvolume", "list", "-o", str(rw)]) if rw.is_dir() else []
        qgroups = lines(["btrfs", "qgroup", "show", "--raw", str(rw)]) if rw.is_dir() else []
        with sqlite3.connect(f"file:{home / 'catalog.db'}?mode=ro", uri=True) as db:
            rows = db.execute("SELECT COUNT(*) FROM sandboxes").fetchone()[0]
        du = lines(["du", "-sxm", str(home)])
        return cls(
            runsc_processes=len(lines(["pgrep", "-f", f"runsc.*{home}"])),
            mounts=mounts,
            netns=sum(1 for n in lines(["ip", "netns", "list"]) if n.startswith(NET_PREFIX)),
            subvolumes=len(subvols),
            qgroups=sum(1 for q in qgroups if q.startswith("0/")),
            catalog_sandboxes=int(rows),
            disk_mib=int(du[0].split()[0]) if du else 0,
        )

    def leaks_against(self, before: Footprint) -> list[str]:
        out = []
        for name, now in asdict(self).items():
            was = getattr(before, name)
            slack = 64 if name == "disk_mib" else 0  # logs, the catalog's own growth
            if now > was + slack:
                out.append(f"{name}: {was} before, {now} after")
        return out


@dataclass
class Soak:
    minutes: float
    at_once: int
    episodes: int = 0
    failed: list[str] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    listed_after: int = 0

    @property
    def ok(self) -> bool:
        return not self.failed and not self.leaks and not self.listed_after and self.rss_flat

    @property
    def rss_flat(self) -> bool:
        return len(self.rss_mib) < 2 or self.rss_mib[-1] <= self.rss_mib[0] * 1.25 + 32


def _du_by_dir(home: Path) -> str:
    r = subprocess.run(
        ["du", "-xm", "--max-depth=2", str(home)], capture_output=True, text=True, check=False
    )
    rows = sorted(
        (int(n), p.removeprefix(f"{home}/"))
        for n, _, p in (line.partition("\t") for line in r.stdout.splitlines())
        if n.isdigit()
    )
    return ", ".join(f"{p} {n} MiB" for n, p in rows[-8:])


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def soak(minutes: float, at_once: int) -> Soak:
    result = Soak(minutes, at_once)
    home = Path(tempfile.mkdtemp(prefix="aenv-soak-"))
    key = "e2b_" + secrets.token_hex(20)
    server = BenchServer(home, key, name="soak", extra_env={})
    api: Api | None = None
    try:
        print(f"soak: {at_once} at once for {minutes:g} min; home {home}", flush=True)
        await asyncio.to_thread(build_base, home)
        await server.start()
        assert server.proc is not None
        pid = server.proc.pid
        api = Api(server.url, key, metadata={"aenv-soak": home.name})
        runner = ServerRollouts(
            api, server.url, Results(), Plan(), NullProgress(), CpuMeter(NET_PREFIX, pid)
        )
        await runner.make_task()
        await asyncio.sleep(5)  # the warm pool filled
        before = Footprint.of(home)
        result.rss_mib.append(_rss_mib(pid))
        lv = Level(at_once)
        deadline = time.monotonic() + minutes * 60
        next_report = time.monotonic() + 60

        async def worker() -> None:
            while time.monotonic() < deadline:
                try:
                    await runner.episode(lv)
                    result.episodes += 1
                except BenchError as exc:
                    result.failed.append(str(exc))

        async def reporter() -> None:
            nonlocal next_report
            while time.monotonic() < deadline:
                await asyncio.sleep(max(0.0, next_report - time.monotonic()))
                next_report += 60
                result.rss_mib.append(_rss_mib(pid))
                print(
                    f"soak: {result.episodes} episodes, {len(result.failed)} failed, "
                    f"server RSS {result.rss_mib[-1]:.0f} MiB",
                    flush=True,
                )

        await asyncio.gather(reporter(), *(worker() for _ in range(at_once)))
        await runner.drop_task()
        # Kills finish in the background, the pool refills, freed disk is trimmed (30 s).
        await asyncio.sleep(45)
        result.listed_after = len(await api.list_ids())
        result.rss_mib.append(_rss_mib(pid))
        result.leaks = Footprint.of(home).leaks_against(before)
        if any(leak.startswith("disk_mib") for leak in result.leaks):
            result.leaks.append("where: " + _du_by_dir(home))
        print(f"soak: {lv.ops_note()}", flush=True)
    finally:
        if api is not None:
            await api.cleanup()
            await api.aclose()
        await server.stop()
        await asyncio.to_thread(remove_home, home)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--at-once", type=int, default=8)
    args = ap.parse_args()
    result = asyncio.run(soak(args.minutes, args.at_once))
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H-%M-%S")
    doc = {**asdict(result), "failed": result.failed[:20], "ok": result.ok}
    (RESULTS / f"soak-{stamp}.json").write_text(json.dumps(doc, indent=1))
    print(
        f"soak: {result.episodes} episodes, {len(result.failed)} failed, "
        f"{result.listed_after} sandboxes listed after, leaks: {result.leaks or 'none'}, "
        f"server RSS {result.rss_mib[0]:.0f} -> {result.rss_mib[-1]:.0f} MiB"
        f" ({'flat' if result.rss_flat else 'GREW'}): {'PASS' if result.ok else 'FAIL'}",
        flush=True,
    )
    sys.exit(0 if result.ok else 1)


if __name__ == "__main__":
    main()
