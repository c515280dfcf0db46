"""An in-memory `Runtime` for tests: no processes, no root, no network.

It keeps the contract of `base.Runtime` (the contract tests in tests/contract run against it
and against gVisor) and adds what a test of the layers above needs:

* `FakeHost`: what outlives one runtime object (the host's containers and slots). Build a
  second `FakeRuntime(host=first.host)` to play a server restart in which containers kept
  running; `host.kill(id)` plays a container that died meanwhile.
* `fail_next(op, exc, after=n)`: the call of `op` after the next `n` raises `exc` (default a
  `RuntimeFailure`) before it changes anything; `before(op, hook)` runs `hook(call)` (sync
  or async: it may raise, or wait on an event to hold the operation) before each call.
* `calls`: every async operation, in order, as a `Call` (`ops()` lists their names);
  `state(inst)`, `egress(inst)` and `instances()` show what the host holds.

Containers get addresses from the documentation ranges (RFC 5737); a checkpoint is a small
JSON file (`IMAGE_FILE`) that `image_complete` recognises and `restore` reads.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import ipaddress
import json
import re
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

from aenv.domain import EgressPolicy
from aenv.errors import RuntimeFailure
from aenv.runtime.base import Instance, Runtime, SandboxSpec, Stats

IMAGE_FILE = "fake-checkpoint.json"
_IMAGE_FORMAT = "aenv-fake-checkpoint-1"
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,100}")
_NETWORKS = [
    ipaddress.IPv4Network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24")
]
_PER_NETWORK = 254
OPS = frozenset(
    {"start", "close", "create", "restore", "stop", "destroy", "freeze", "thaw", "checkpoint"}
    | {"stats", "alive", "set_egress", "nap"}
)


class FakeState(enum.StrEnum):
    RUNNING = "running"
    FROZEN = "frozen"
    # Its processes ended (checkpointed without `leave_running`, or killed): the slot is
    # still held until `stop` or `destroy`.
    EXITED = "exited"
    STOPPED = "stopped"
    GONE = "gone"


@dataclass
class FakeContainer:
    sandbox_id: str
    id: str
    slot: int
    address: str
    state: FakeState
    cpu_count: int
    memory_mb: int
    layers: list[str]
    upper: str | None
    restored_from: str | None = None
    # The rules in force in its slot (None: never set, the node's fixed denies only).
    egress: EgressPolicy | None = None
    exit_cause: str | None = None
    # Its bind mounts: [source, destination, read-only].
    mounts: list[list[Any]] = field(default_factory=list)


@dataclass
class FakeHost:
    """The host's side: every container a `FakeRuntime` on it made, gone ones included."""

    containers: dict[str, FakeContainer] = field(default_factory=dict)
    capacity: int = _PER_NETWORK * len(_NETWORKS)

    def kill(self, instance_id: str, cause: str | None = None) -> None:
        """The container's processes die (as if OOM-killed): not alive, slot still held;
        `cause` is what `exit_cause` then reports."""
        c = self.containers.get(instance_id)
        if c is not None and c.state is not FakeState.GONE:
            c.state = FakeState.EXITED
            c.exit_cause = cause

    def slots(self) -> set[int]:
        return {c.slot for c in self.containers.values() if c.state is not FakeState.GONE}


@dataclass(frozen=True)
class Call:
    op: str
    instance_id: str | None = None
    sandbox_id: str | None = None
    image_dir: Path | None = None
    leave_running: bool | None = None
    reuse: str | None = None
    keep: frozenset[str] | None = None
    egress: EgressPolicy | None = None
    # Set in the log once the call ended with an exception.
    error: BaseException | None = None


Hook = Callable[[Call], Awaitable[None] | None]


class FakeRuntime(Runtime):
    name = "fake"

    def __init__(self, host: FakeHost | None = None, *, delay: float = 0.0) -> None:
        self.host = host if host is not None else FakeHost()
        # Seconds every async operation takes (0: it still yields to the loop once).
        self.delay = delay
        self.calls: list[Call] = []
        self._hooks: dict[str, list[Hook]] = {}
        self._started = False
        # Test controls: the instances napping now, and the CPU use (% of the sandbox's
        # CPUs) `stats` reports per sandbox id.
        self.napping: set[str] = set()
        self.cpu_pct: dict[str, float] = {}

    # Test controls -----------------------------------------------------------------------

    def fail_next(self, op: str, exc: BaseException | None = None, *, after: int = 0) -> None:
        """The call of `op` that follows the next `after` ones raises `exc`, with no effect."""
        _check_op(op)
        error = exc if exc is not None else RuntimeFailure(f"injected failure of {op}")
        left = after
        hooks = self._hooks.setdefault(op, [])

        def hook(_call: Call) -> None:
            nonlocal left
            if left > 0:
                left -= 1
                return
            hooks.remove(hook)
            raise error

        hooks.append(hook)

    def before(self, op: str, hook: Hook) -> None:
        """Runs `hook(call)` before each later call of `op` (in the order they were added)."""
        _check_op(op)
        self._hooks.setdefault(op, []).append(hook)

    def ops(self) -> list[str]:
        return [c.op for c in self.calls]

    def state(self, inst: Instance | str) -> FakeState:
        c = self.host.containers.get(inst if isinstance(inst, str) else inst.id)
        return FakeState.GONE if c is None else c.state

    def egress(self, inst: Instance | str) -> EgressPolicy | None:
        """The egress policy in force for a container (None: none given, or it is gone)."""
        c = self.host.containers.get(inst if isinstance(inst, str) else inst.id)
        return None if c is None or c.state is FakeState.GONE else c.egress

    def instances(self) -> list[Instance]:
        """Handles of every container the host holds (not gone)."""
        return [_handle(c) for c in self.host.containers.values() if c.state is not FakeState.GONE]

    # The Runtime -------------------------------------------------------------------------

    async def start(self, keep: set[str]) -> dict[str, Instance]:
        await self._enter(Call("start", keep=frozenset(keep)))
        recovered: dict[str, Instance] = {}
        for c in self.host.containers.values():
            if c.state is FakeState.GONE:
                continue
            if c.id in keep and c.state is not FakeState.EXITED:
                recovered[c.id] = _handle(c)
            else:
                c.state = FakeState.GONE
        self._started = True
        return recovered

    async def close(self) -> None:
        await self._enter(Call("close"))
        self._started = False

    async def create(self, spec: SandboxSpec, *, reuse: Instance | None = None) -> Instance:
        call = Call("create", sandbox_id=spec.sandbox_id, reuse=reuse.id if reuse else None)
        await self._enter(call)
        return self._launch(call, spec, None, reuse)

    async def restore(
        self, spec: SandboxSpec, image_dir: Path, *, reuse: Instance | None = None
    ) -> Instance:
        call = Call(
            "restore",
            sandbox_id=spec.sandbox_id,
            image_dir=image_dir,
            reuse=reuse.id if reuse else None,
        )
        await self._enter(call)
        image = await asyncio.to_thread(_read_image, image_dir)
        if image is None:
            self._failed(call, RuntimeFailure(f"no complete checkpoint image at {image_dir}"))
        if image["upper"] != (spec.upper is not None):
            self._failed(
                call, RuntimeFailure(f"{image_dir} was checkpointed with another rootfs mode")
            )
        # As with runsc: the restored sentry's mount tree is the checkpointed one.
        if image.get("mounts", _mounts(spec)) != _mounts(spec):
            self._failed(call, RuntimeFailure(f"{image_dir} was checkpointed with other mounts"))
        return self._launch(call, spec, image_dir, reuse)

    async def stop(self, inst: Instance) -> None:
        call = Call("stop", inst.id, inst.sandbox_id)
        await self._enter(call)
        c = self._own(inst, call)
        c.state = FakeState.STOPPED

    async def destroy(self, inst: Instance) -> None:
        await self._enter(Call("destroy", inst.id, inst.sandbox_id))
        c = self.host.containers.get(inst.id)
        if c is not None:
            c.state = FakeState.GONE

    async def freeze(self, inst: Instance) -> None:
        call = Call("freeze", inst.id, inst.sandbox_id)
        await self._enter(call)
        c = self._running(inst, call)
        c.state = FakeState.FROZEN

    async def thaw(self, inst: Instance) -> None:
        call = Call("thaw", inst.id, inst.sandbox_id)
        await self._enter(call)
        c = self._running(inst, call)
        c.state = FakeState.RUNNING

    async def checkpoint(
        self, inst: Instance, image_dir: Path, *, leave_running: bool, hold: bool = False
    ) -> None:
        call = Call("checkpoint", inst.id, inst.sandbox_id, image_dir, leave_running)
        if hold and not leave_running:
            self._failed(call, ValueError("hold needs leave_running"))
        await self._enter(call)
        c = self._running(inst, call)
        image = {
            "format": _IMAGE_FORMAT,
            "sandbox_id": c.sandbox_id,
            "instance_id": c.id,
            "upper": c.upper is not None,
            "layers": c.layers,
            "mounts": c.mounts,
        }
        await asyncio.to_thread(_write_image, image_dir, image)
        # As with runsc, a frozen sandbox is thawed to be checkpointed; a held one stays
        # stopped (frozen) until `thaw`.
        if hold:
            c.state = FakeState.FROZEN
        else:
            c.state = FakeState.RUNNING if leave_running else FakeState.EXITED

    async def stats(self, inst: Instance) -> Stats:
        call = Call("stats", inst.id, inst.sandbox_id)
        await self._enter(call)
        c = self._running(inst, call)
        total = c.memory_mb * 1024 * 1024
        return Stats(
            cpu_used_pct=self.cpu_pct.get(c.sandbox_id, 0.0),
            mem_used_bytes=total // 8,
            mem_total_bytes=total,
            rss_bytes=0,
        )

    async def alive(self, inst: Instance) -> bool:
        await self._enter(Call("alive", inst.id, inst.sandbox_id))
        return self.state(inst) in (FakeState.RUNNING, FakeState.FROZEN)

    async def exit_cause(self, inst: Instance) -> str | None:
        c = self.host.containers.get(inst.id)
        return None if c is None else c.exit_cause

    async def is_frozen(self, inst: Instance) -> bool:
        return self.state(inst) is FakeState.FROZEN

    async def nap(self, inst: Instance, on: bool) -> None:
        await self._enter(Call("nap", inst.id, inst.sandbox_id))
        if on and self.state(inst) in (FakeState.RUNNING, FakeState.FROZEN):
            self.napping.add(inst.id)
        else:
            self.napping.discard(inst.id)

    async def set_egress(self, inst: Instance, policy: EgressPolicy) -> None:
        call = Call("set_egress", inst.id, inst.sandbox_id, egress=policy)
        await self._enter(call)
        c = self._own(inst, call)
        try:
            policy.normalized()
        except ValueError as e:
            self._failed(call, e)
        c.egress = policy

    def is_stopped(self, inst: Instance) -> bool:
        return self.state(inst) is FakeState.STOPPED

    def image_complete(self, image_dir: Path) -> bool:
        return _read_image(image_dir) is not None

    # Inside ------------------------------------------------------------------------------

    async def _enter(self, call: Call) -> None:
        """Logs the call, waits `delay`, runs its hooks (which may raise)."""
        self.calls.append(call)
        await asyncio.sleep(self.delay)
        try:
            for hook in list(self._hooks.get(call.op, ())):
                result = hook(call)
                if inspect.isawaitable(result):
                    await result
        except BaseException as e:
            self._failed(call, e)

    def _failed(self, call: Call, exc: BaseException) -> NoReturn:
        """Marks `call` failed in the log and raises `exc`."""
        for i in range(len(self.calls) - 1, -1, -1):
            if self.calls[i] is call:
                self.calls[i] = replace(call, error=exc)
                break
        raise exc

    def _launch(
        self, call: Call, spec: SandboxSpec, image_dir: Path | None, reuse: Instance | None
    ) -> Instance:
        if not self._started:
            self._failed(call, RuntimeFailure("the fake runtime is not started"))
        if not _ID_RE.fullmatch(spec.sandbox_id):
            self._failed(call, RuntimeFailure(f"invalid sandbox id {spec.sandbox_id!r}"))
        if spec.upper is not None and not spec.upper.is_dir():
            self._failed(call, RuntimeFailure(f"upper dir {spec.upper} does not exist"))
        if spec.egress is not None:
            try:
                spec.egress.normalized()
            except ValueError as e:
                self._failed(call, e)
        if reuse is not None:
            held = self.host.containers.get(reuse.id)
            if held is None or held.state is not FakeState.STOPPED:
                self._failed(
                    call, RuntimeFailure(f"{reuse.id} is not a stopped sandbox of this runtime")
                )
            if held.sandbox_id != spec.sandbox_id:
                self._failed(
                    call,
                    RuntimeFailure(
                        f"{reuse.id} belongs to sandbox {held.sandbox_id}, not {spec.sandbox_id}"
                    ),
                )
            iid, slot = held.id, held.slot
        else:
            free = sorted(set(range(self.host.capacity)) - self.host.slots())
            if not free:
                self._failed(call, RuntimeFailure("no free network slot"))
            iid, slot = f"{spec.sandbox_id}-{secrets.token_hex(4)}", free[0]
        c = FakeContainer(
            sandbox_id=spec.sandbox_id,
            id=iid,
            slot=slot,
            address=_address(slot),
            state=FakeState.RUNNING,
            cpu_count=spec.cpu_count,
            memory_mb=spec.memory_mb,
            layers=[str(p) for p in spec.layers],
            upper=None if spec.upper is None else str(spec.upper),
            restored_from=None if image_dir is None else str(image_dir),
            egress=spec.egress,
            mounts=_mounts(spec),
        )
        self.host.containers[iid] = c
        return _handle(c)

    def _own(self, inst: Instance, call: Call) -> FakeContainer:
        c = self.host.containers.get(inst.id)
        if c is None or c.state is FakeState.GONE:
            self._failed(call, RuntimeFailure(f"{call.op}: {inst.id} does not exist"))
        return c

    def _running(self, inst: Instance, call: Call) -> FakeContainer:
        """The container, which must have processes (running or frozen)."""
        c = self._own(inst, call)
        if c.state not in (FakeState.RUNNING, FakeState.FROZEN):
            self._failed(call, RuntimeFailure(f"{call.op}: {inst.id} is {c.state}"))
        return c


def _write_image(image_dir: Path, image: dict[str, Any]) -> None:
    image_dir.mkdir(parents=True, exist_ok=True)
    (image_dir / IMAGE_FILE).write_text(json.dumps(image))


def _read_image(image_dir: Path) -> dict[str, Any] | None:
    try:
        image = json.loads((image_dir / IMAGE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(image, dict) or image.get("format") != _IMAGE_FORMAT:
        return None
    return image


def _mounts(spec: SandboxSpec) -> list[list[Any]]:
    return [[str(m.source), m.destination, m.readonly] for m in spec.mounts]


def _handle(c: FakeContainer) -> Instance:
    return Instance(c.sandbox_id, c.id, c.address, {"slot": c.slot})


def _address(slot: int) -> str:
    net = _NETWORKS[slot // _PER_NETWORK]
    return str(net.network_address + 1 + slot % _PER_NETWORK)


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown runtime operation {op!r} (one of {sorted(OPS)})")
