"""A whole orchestrator over the fake runtime, a fake envd and a clock the test moves: the
lifecycle state machine runs for real (catalog, layer store, uppers, seals) in a temp dir,
in milliseconds, with no processes."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

from aenv.config import Settings
from aenv.domain import TemplateKind, TemplateRecord
from aenv.images.layers import LayerStore
from aenv.orchestrator import Orchestrator
from aenv.orchestrator.catalog import Catalog
from aenv.orchestrator.envd_pool import EnvdPool
from aenv.orchestrator.storage import SandboxStorage
from aenv.runtime.bundle import EnvdBundle
from aenv.runtime.fake import FakeHost, FakeRuntime


class FakeClock:
    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


class _FakeEnvdAt:
    """The fake's answers for the envd at one address (what `EnvdPool.at` gives)."""

    def __init__(self, envd: FakeEnvd, host: str, token: str | None) -> None:
        self.envd, self.host, self.token = envd, host, token

    async def run(self, cmd: str, args: list[str], **kw: Any) -> Any:
        self.envd.runs.append((self.host, cmd, args))
        return None

    async def logs(self, after: int) -> dict[str, Any]:
        self.envd.journal_reads.append((self.host, after))
        entries = [e for e in self.envd.journal.get(self.host, []) if e["seq"] > after]
        return {"seq": self.envd.journal_seq.get(self.host, 0), "entries": entries}

    async def wait_ready(self, timeout: float = 20.0) -> None:
        return None

    async def healthy(self, timeout: float = 2.0) -> bool:
        return self.host not in self.envd.unhealthy

    async def init(self, **kw: Any) -> None:
        if self.envd.fail_inits > 0:
            self.envd.fail_inits -= 1
            raise RuntimeError("envd refused /init")
        self.envd.inits.append((self.host, {**kw, "current_token": self.token}))


@dataclass
class FakeEnvd:
    """Stands in for the node's envd pool: every sandbox's envd answers at once."""

    inits: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    runs: list[tuple[str, str, list[str]]] = field(default_factory=list)
    # Makes `init` fail for the next N calls (a broken sandbox).
    fail_inits: int = 0
    # Addresses whose envd does not answer its health check (a hung guest).
    unhealthy: set[str] = field(default_factory=set)
    # envd's journal per sandbox address (`envd/journal.py`'s entries); `journal_seq`
    # its last sequence number.
    journal: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    journal_seq: dict[str, int] = field(default_factory=dict)
    # Every read of a journal: (address, after).
    journal_reads: list[tuple[str, int]] = field(default_factory=list)

    def log(self, host: str, message: str, level: str = "info", **fields: str) -> None:
        """What envd records: one journal entry, now."""
        seq = self.journal_seq.get(host, 0) + 1
        self.journal_seq[host] = seq
        entry = {"seq": seq, "ts": time.time(), "level": level, "message": message}
        self.journal.setdefault(host, []).append({**entry, "fields": fields})

    def at(self, host: str, token: str | None = None) -> _FakeEnvdAt:
        return _FakeEnvdAt(self, host, token)

    async def close(self) -> None:
        return None


@dataclass
class Harness:
    home: Path
    host: FakeHost
    clock: FakeClock
    envd: FakeEnvd
    settings: Settings
    orch: Orchestrator
    runtime: FakeRuntime
    catalog: Catalog

    async def restart(self, **overrides: Any) -> Harness:
        """A new node process over the same home and host (containers that were left
        running are still there, as after `kill -9` of the server)."""
        await self.orch.context.join()
        self.catalog.close()
        return build(self.home, host=self.host, clock=self.clock, **overrides)


def add_base_template(home: Path, settings: Settings) -> None:
    """Registers template `base` over one real layer in the layer store."""
    layers = LayerStore(settings)
    src = home / "base-layer"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "hostname").write_text("sandbox\n")
    digest = layers.add_dir(src, mode="move")
    catalog = Catalog(settings.catalog_path)
    catalog.put_template(
        TemplateRecord(
            template_id="base",
            kind=TemplateKind.IMAGE,
            layers=[digest],
            names=["base"],
            env={"LANG": "C.UTF-8"},
            user="user",
            workdir="/home/user",
            cpu_count=2,
            memory_mb=512,
        )
    )
    catalog.close()


def build(
    home: Path,
    *,
    host: FakeHost | None = None,
    clock: FakeClock | None = None,
    **overrides: Any,
) -> Harness:
    values: dict[str, Any] = {
        "home": home,
        "sandbox_pool_size": 0,
        "boot_snapshots": False,
        "hibernate_after": 60.0,
        "max_memory_mb": 4096,
        # Disk images are loop mounts (tests/unit/test_disks.py); uppers here are plain dirs.
        "disk_limits": False,
        **overrides,
    }
    settings = Settings(**values)
    if not settings.catalog_path.exists():
        add_base_template(home, settings)
    host = host or FakeHost()
    clock = clock or FakeClock()
    envd = FakeEnvd()
    runtime = FakeRuntime(host)
    catalog = Catalog(settings.catalog_path)
    storage = SandboxStorage(settings, LayerStore(settings))
    bundle_dir = home / "bundle"
    bundle_dir.mkdir(exist_ok=True)
    orch = Orchestrator(
        settings,
        catalog,
        runtime,
        storage=storage,
        bundle=EnvdBundle(host_path=bundle_dir, digest="test"),
        envd=cast(EnvdPool, envd),  # the fake has the pool's surface
        clock=clock,
    )
    return Harness(home, host, clock, envd, settings, orch, runtime, catalog)


async def started(home: Path, **overrides: Any) -> AsyncIterator[Harness]:
    h = build(home, **overrides)
    await h.orch.start(timers=False)
    try:
        yield h
    finally:
        await h.orch.close()
        h.catalog.close()


Factory = Callable[..., AsyncIterator[Harness]]
