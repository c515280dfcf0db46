"""The benchmark run: servers (started here, or `--url`), the rows, the runsc baseline, the
result files. `aenv bench` calls `run()`; see bench/README.md for what each row measures."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .baseline import RawRunsc
from .client import Api, BenchError
from .cpu import CpuMeter
from .machine import machine_info
from .plan import NullProgress, Plan, Progress
from .report import REQUIRED
from .rollouts import ServerRollouts
from .rollouts_raw import RawRollouts
from .scenarios import ServerRows
from .scenarios_forktree import FORKTREE_ROWS
from .scenarios_lifecycle import RUNNING_ROWS
from .scenarios_qemu import QEMU_ENV, QEMU_ROWS, QemuRows
from .server import BenchServer, build_base, remove_home
from .stats import Results
from .thousand import ENV as THOUSAND_ENV
from .thousand import ROWS as THOUSAND_ROWS
from .thousand import Thousand

RESULTS_DIR = Path(__file__).resolve().parent / "results"
LOCK_PATH = Path("/run/lock/aenv-bench.lock")

CMDS_ROWS = ["snapshot_after_1000_cmds", "snapshot_after_1000_cmds_mib"]
FORK_ROWS = ["fork_1", "fork_4", "fork_16"]
CONCURRENT_ROWS = [
    "concurrent_create_10",
    "concurrent_create_50",
    "exec_concurrent_10",
    "exec_concurrent_50",
    "idle_sandbox_rss_mib",
    "idle_sandbox_pss_mib",
]
POPULATED_ROWS = [
    "create_to_first_exec_with_100",
    "exec_roundtrip_with_100",
    "list_1000",
    "idle_node_mc",
    "idle_sandbox_mc",
]
ROLLOUT_ROWS = [
    f"rollout_{kind}_{n}" for n in (1, 8, 32) for kind in ("cpu_s", "rate", "health_p99")
]
MAIN_ROWS = [
    "create_to_first_exec",
    *RUNNING_ROWS,
    "snapshot_dirty_1gib",
    *CMDS_ROWS,
    *FORK_ROWS,
    *FORKTREE_ROWS,
    *CONCURRENT_ROWS,
    *ROLLOUT_ROWS,
    *POPULATED_ROWS,
]
COLD_ROWS = ["create_to_first_exec_cold", "hibernate", "resume_from_disk"]
# A row whose target is relative to another row of the run brings that row along.
IMPLIED = {"rollback": "resume_from_disk"}
COLD_ENV = {"AENV_NET_POOL_SIZE": "0", "AENV_SANDBOX_POOL_SIZE": "0", "AENV_HIBERNATE_AFTER": "0"}
CLIENT = (
    "httpx.AsyncClient (HTTP/1.1 keep-alive) speaking the E2B REST shapes and envd's Connect "
    "protocol (JSON) directly, not the e2b SDK: its sync client adds its own per-call overhead"
)


@dataclass
class Options:
    quick: bool = False
    url: str | None = None
    api_key: str | None = None
    cold_url: str | None = None
    cold_api_key: str | None = None
    baseline: bool = True
    only: set[str] | None = None
    results_dir: Path = RESULTS_DIR
    write: bool = True
    # Where to copy the started servers' logs before their home is removed (None: nowhere).
    logs_dir: Path | None = None


@dataclass
class Run:
    opts: Options
    plan: Plan
    progress: Progress
    results: Results = field(default_factory=Results)
    run_id: str = field(default_factory=lambda: secrets.token_hex(4))
    home: Path | None = None
    servers: list[BenchServer] = field(default_factory=list)
    apis: list[Api] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    # Seconds of the set-up steps and phases (where a run's time went).
    phases: dict[str, float] = field(default_factory=dict)

    async def timed(self, name: str, phase: Callable[[], Awaitable[None]]) -> None:
        t0 = time.perf_counter()
        try:
            await phase()
        finally:
            self.phases[name] = round(time.perf_counter() - t0, 1)

    def want(self, row: str) -> bool:
        only = self.opts.only
        return only is None or row in only or any(IMPLIED.get(r) == row for r in only)

    def api(self, url: str, key: str) -> Api:
        api = Api(url, key, op_timeout=self.plan.op_timeout, metadata={"aenv-bench": self.run_id})
        self.apis.append(api)
        return api

    async def guard(self, rows: list[str], what: str, step: Callable[[], Awaitable[None]]) -> None:
        """Runs a step (its seconds go to `phases` as `step: <what>`); if it fails as a
        whole, its rows without samples become missing."""
        t0 = time.perf_counter()
        try:
            await step()
        except BenchError as exc:
            self.progress.log(f"{what}: {exc}")
            self.results.missing(
                [r for r in rows if self.want(r) and not self.results.has_samples(r)],
                f"{what} failed: {exc}",
            )
        finally:
            key = f"step: {what}"
            self.phases[key] = round(self.phases.get(key, 0.0) + time.perf_counter() - t0, 1)

    async def ensure_home(self) -> Path:
        if self.home is None:
            self.home = Path(tempfile.mkdtemp(prefix="aenv-bench-"))
            self.progress.step("template build-base (cached)", 1)
            t0 = time.perf_counter()
            await asyncio.to_thread(build_base, self.home)
            self.phases["build_base"] = round(time.perf_counter() - t0, 1)
            self.progress.advance()
        return self.home

    async def start_server(self, name: str, extra_env: dict[str, str]) -> BenchServer:
        home = await self.ensure_home()
        key = "e2b_bench_" + secrets.token_hex(16)
        server = BenchServer(home, key, name=name, extra_env=extra_env)
        self.servers.append(server)
        self.progress.step(f"start server ({name})", 1)
        t0 = time.perf_counter()
        try:
            await server.start()
        finally:
            self.phases[f"start_server_{name}"] = round(time.perf_counter() - t0, 1)
            self.progress.advance()
        return server

    async def stop_server(self, server: BenchServer, api: Api) -> None:
        await self.finish_api(api)
        self.progress.step(f"stop server ({server.name})", 1)
        await server.stop()
        self.servers.remove(server)
        self.progress.advance()

    async def finish_api(self, api: Api) -> None:
        for msg in await api.cleanup():
            self.progress.log(f"cleanup: {msg}")
        await api.aclose()
        if api in self.apis:
            self.apis.remove(api)

    # -- phases -----------------------------------------------------------------------------

    async def main_phase(self) -> None:
        rows = [r for r in MAIN_ROWS if self.want(r)]
        if not rows:
            return
        server: BenchServer | None = None
        if self.opts.url:
            api = self.api(self.opts.url, self.opts.api_key or "")
            local = _is_local(self.opts.url)
            self.config["main_server"] = {"url": self.opts.url}
            if not await api.health():
                self.results.missing(rows, f"no server answers at {self.opts.url}/health")
                await self.finish_api(api)
                return
        else:
            try:
                server = await self.start_server("main", {})
            except RuntimeError as exc:
                self.results.missing(rows, f"the server did not start: {_first_line(exc)}")
                return
            api = self.api(server.url, server.api_key)
            local = True
            self.config["main_server"] = {"env": "server defaults (warm network-slot pool on)"}
        meter = CpuMeter(
            server.env["AENV_NET_PREFIX"] if server is not None else "aenv",
            server.proc.pid if server is not None and server.proc else None,
        )
        sr = ServerRows(
            api,
            self.results,
            self.plan,
            self.progress,
            want=self.want,
            local=local,
            home=server.home if server is not None else None,
            meter=meter if server is not None else None,
        )
        try:
            await self.guard(rows, "warm-up", sr.warmup)
            await self.guard(
                ["create_to_first_exec"],
                "create_to_first_exec",
                lambda: sr.create_rows("create_to_first_exec", self.plan.create),
            )
            await self.guard(RUNNING_ROWS, "running-sandbox rows", sr.running_sandbox_rows)
            await self.guard(["snapshot_dirty_1gib"], "snapshot_dirty_1gib", sr.dirty_snapshot)
            await self.guard(CMDS_ROWS, "snapshot_after_1000_cmds", sr.cmds_snapshot)
            await self.guard(FORK_ROWS, "fork", sr.fork_rows)
            await self.guard(FORKTREE_ROWS[:2], "diff/apply", sr.diff_apply_rows)
            await self.guard(["rollback"], "rollback", sr.rollback_row)
            await self.guard(CONCURRENT_ROWS, "concurrent create", sr.concurrent_rows)
            if any(self.want(r) for r in ROLLOUT_ROWS):
                url = server.url if server is not None else self.opts.url or ""
                rollouts = ServerRollouts(api, url, self.results, self.plan, self.progress, meter)
                await self.guard(ROLLOUT_ROWS, "rollouts", rollouts.run)
            await self.guard(POPULATED_ROWS, "populated node", sr.populated_rows)
        finally:
            await sr.drain()
            if server is not None:
                await self.stop_server(server, api)
            else:
                await self.finish_api(api)

    async def cold_phase(self) -> None:
        rows = [r for r in COLD_ROWS if self.want(r)]
        if not rows:
            return
        server: BenchServer | None = None
        if self.opts.url and not self.opts.cold_url:
            self.results.missing(
                rows,
                "needs a second server with AENV_NET_POOL_SIZE=0 AENV_SANDBOX_POOL_SIZE=0 AENV_HIBERNATE_AFTER=0: pass "
                "--cold-url (without --url the bench starts one itself)",
            )
            return
        if self.opts.cold_url:
            api = self.api(self.opts.cold_url, self.opts.cold_api_key or self.opts.api_key or "")
            local = _is_local(self.opts.cold_url)
            self.config["cold_server"] = {"url": self.opts.cold_url}
            if not await api.health():
                self.results.missing(rows, f"no server answers at {self.opts.cold_url}/health")
                await self.finish_api(api)
                return
        else:
            try:
                server = await self.start_server("cold", COLD_ENV)
            except RuntimeError as exc:
                self.results.missing(rows, f"the server did not start: {_first_line(exc)}")
                return
            api = self.api(server.url, server.api_key)
            local = True
            self.config["cold_server"] = {"env": COLD_ENV}
        if self.want("create_to_first_exec_cold"):
            self.results.note(
                "create_to_first_exec_cold",
                "no per-request pool toggle on the server: measured on a second server started "
                "with AENV_NET_POOL_SIZE=0 AENV_SANDBOX_POOL_SIZE=0",
            )
        sr = ServerRows(api, self.results, self.plan, self.progress, want=self.want, local=local)
        try:
            await self.guard(rows, "warm-up (cold server)", sr.warmup)
            await self.guard(
                ["create_to_first_exec_cold"],
                "create_to_first_exec_cold",
                lambda: sr.create_rows("create_to_first_exec_cold", self.plan.create_cold),
            )
            await self.guard(["hibernate", "resume_from_disk"], "hibernate", sr.hibernate_rows)
        finally:
            await sr.drain()
            if server is not None:
                await self.stop_server(server, api)
            else:
                await self.finish_api(api)

    async def thousand_phase(self) -> None:
        """1,000 sandboxes on a server of its own (bench/thousand.py)."""
        rows = [r for r in THOUSAND_ROWS if self.want(r)]
        if not rows:
            return
        if self.opts.url:
            self.results.missing(rows, "needs a server the bench starts (its own settings)")
            return
        try:
            server = await self.start_server("thousand", THOUSAND_ENV)
        except RuntimeError as exc:
            self.results.missing(rows, f"the server did not start: {_first_line(exc)}")
            return
        self.config["thousand_server"] = {"env": THOUSAND_ENV}
        api = self.api(server.url, server.api_key)
        pid = server.proc.pid if server.proc else None
        try:
            step = Thousand(api, pid, self.results, self.plan, self.progress)
            await self.guard(rows, "thousand", step.run)
        finally:
            await self.stop_server(server, api)

    async def qemu_phase(self) -> None:
        """The QEMU backend's rows, on a server of its own (bench/scenarios_qemu.py)."""
        rows = [r for r in QEMU_ROWS if self.want(r)]
        if not rows:
            return
        if self.opts.url:
            self.results.missing(rows, "needs a server the bench starts (AENV_RUNTIME=qemu)")
            return
        try:
            server = await self.start_server("qemu", QEMU_ENV)
        except RuntimeError as exc:
            self.results.missing(rows, f"the server did not start: {_first_line(exc)}")
            return
        self.config["qemu_server"] = {"env": QEMU_ENV}
        api = self.api(server.url, server.api_key)
        meter = CpuMeter(server.env["AENV_NET_PREFIX"], server.proc.pid if server.proc else None)
        qr = QemuRows(
            api,
            self.results,
            self.plan,
            self.progress,
            want=self.want,
            home=server.home,
            meter=meter,
        )
        try:
            await self.guard(rows, "warm-up (qemu server)", qr.warmup)
            await self.guard(rows, "qemu", qr.qemu_rows)
        finally:
            await qr.drain()
            await self.stop_server(server, api)

    async def baseline_phase(self) -> None:
        if not self.opts.baseline:
            return
        home = await self.ensure_home()
        raw = RawRunsc(home, self.results, self.plan, self.progress, want=self.want)
        self.progress.step("baseline set-up", 1)
        try:
            await raw.setup()
            self.progress.advance()
            await raw.run_all()
            if any(self.want(r) for r in ROLLOUT_ROWS):
                await RawRollouts(raw).run()
        except BenchError as exc:
            self.progress.log(f"baseline: {exc}")
            self.results.missing(
                [r for r in REQUIRED if not self.results.has_samples(r, baseline=True)],
                f"baseline failed: {exc}",
                baseline=True,
            )
        finally:
            self.progress.step("baseline clean-up", 1)
            await raw.close()
            self.progress.advance()

    async def cleanup(self) -> None:
        for api in list(self.apis):
            try:
                await self.finish_api(api)
            except Exception as exc:  # never let one failure keep the rest
                self.progress.log(f"cleanup: {exc}")
        for server in list(self.servers):
            try:
                await server.stop()
            except Exception as exc:
                self.progress.log(f"stopping server {server.name}: {exc}")
        self.servers.clear()
        if self.home is not None:
            if self.opts.logs_dir is not None:
                await asyncio.to_thread(_copy_logs, self.home, self.opts.logs_dir)
            await asyncio.to_thread(remove_home, self.home)
            self.home = None


def _copy_logs(home: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for log in home.glob("server-*.log"):
        shutil.copyfile(log, dest / log.name)


def _is_local(url: str) -> bool:
    return (urlsplit(url).hostname or "") in ("127.0.0.1", "localhost", "::1", "0.0.0.0")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


@contextlib.contextmanager
def host_lock(path: Path = LOCK_PATH) -> Iterator[None]:
    """One bench at a time per host: they would share the network prefixes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BenchError(
                f"another aenv bench is running on this host ({path} is locked)"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


async def run(opts: Options, progress: Progress | None = None) -> dict[str, Any]:
    """Runs the whole benchmark and returns the result document (written to the results dir
    unless `opts.write` is false). Everything it started is removed, also on Ctrl-C (asyncio
    cancels the run) and on SIGTERM/SIGHUP (cancel it the same way here)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    handled: list[signal.Signals] = []
    if task is not None:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                loop.add_signal_handler(sig, task.cancel)
                handled.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass
    try:
        if opts.url and not opts.baseline:
            return await _run(opts, progress)
        with host_lock():
            return await _run(opts, progress)
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)


async def _run(opts: Options, progress: Progress | None) -> dict[str, Any]:
    plan = Plan.quick() if opts.quick else Plan()
    r = Run(opts, plan, progress or NullProgress())
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    try:
        await r.timed("main_phase", r.main_phase)
        await r.timed("cold_phase", r.cold_phase)
        await r.timed("thousand_phase", r.thousand_phase)
        await r.timed("qemu_phase", r.qemu_phase)
        await r.timed("baseline_phase", r.baseline_phase)
    finally:
        await asyncio.shield(r.cleanup())
    duration = time.perf_counter() - t0
    extra = {
        "config": {
            "mode": plan.mode,
            "client": CLIENT,
            "baseline": "runsc CLI directly (see bench/baseline.py)" if opts.baseline else None,
            **r.config,
        },
        "started_at": started.isoformat(timespec="seconds"),
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "duration_s": round(duration, 1),
        "phases_s": r.phases,
    }
    doc = r.results.document(machine_info(), extra)
    if opts.write:
        # A partial run (--only) must not replace the full table the README shows.
        latest, _ = write_results(doc, opts.results_dir, started, latest=opts.only is None)
        if latest is not None:
            r.progress.log(await asyncio.to_thread(write_chart, doc, latest.with_suffix(".png")))
    return doc


def write_chart(doc: dict[str, Any], out: Path) -> str:
    """Renders the chart (bench/chart.py) next to latest.json; what happened, as a line."""
    try:
        from .chart import render

        render(doc, out)
    except ImportError as exc:
        return f"chart: not drawn, matplotlib is missing ({exc}): pip install matplotlib"
    except Exception as exc:  # a chart must never cost the results
        return f"chart: not drawn: {type(exc).__name__}: {exc}"
    return f"chart: {out} (again from a results file: python -m bench.chart FILE.json OUT.png)"


def write_results(
    doc: dict[str, Any], results_dir: Path, when: datetime, *, latest: bool = True
) -> tuple[Path | None, Path]:
    """A dated copy `YYYY-MM-DDTHH-MM-SS.json` (UTC) and, for a full run, `latest.json`."""
    results_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, indent=2) + "\n"
    dated = results_dir / f"{when.strftime('%Y-%m-%dT%H-%M-%S')}.json"
    dated.write_text(text)
    if not latest:
        return None, dated
    latest_path = results_dir / "latest.json"
    tmp = latest_path.with_suffix(".json.tmp")
    tmp.write_text(text)
    tmp.replace(latest_path)
    return latest_path, dated
