"""What the QEMU backend knows of one VM, and how it travels: in `Instance.data` (opaque to
the orchestrator) and in `<vms>/<id>/machine.json` (what `start` recovers after a crash);
the VM's QEMU command line and its config disk; the control channel to the guest."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import os
import re
import secrets
import select
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aenv.domain import Instance
from aenv.errors import RuntimeFailure
from aenv.runtime.base import SandboxSpec
from aenv.runtime.net.network import LINK_PREFIXLEN, SANDBOX_IP

ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
MACHINE_FILE = "machine.json"
# Memory QEMU itself needs beyond the guest's RAM (TCG's translation cache, device state):
# part of the cgroup limit, so the host kills a runaway QEMU, never its neighbours.
QEMU_OVERHEAD_MB = 320
_PATHS = ("dir", "base", "disk", "ram", "upper")


@dataclass
class Drive:
    """A read-only image attached under a serial the guest finds it by."""

    serial: str
    path: Path
    # Where the guest mounts it ("" for the base: the root overlay's lower layer).
    destination: str = ""


@dataclass
class Machine:
    sandbox_id: str
    id: str
    address: str
    slot: int
    # `<vms>/<id>`: machine.json, qmp.sock, ctl.in/.out, config.img, console.log, qemu.pid.
    dir: Path
    base: Path
    disk: Path
    # The guest's RAM: a file of its own mapped shared (a fork saves device state only), or a
    # checkpoint image's `memory` mapped privately (copy-on-write: children share its pages).
    ram: Path
    ram_shared: bool = True
    mounts: list[Drive] = field(default_factory=list)
    cpu_count: int = 1
    memory_mb: int = 256
    accel: str = "tcg"
    cgroup: str = ""
    upper: Path | None = None
    pid: int = 0
    started_at: float = 0.0
    restored_from: str | None = None
    stopped: bool = False
    # After `checkpoint(leave_running=False)`: QEMU has exited.
    checkpointed: bool = False

    @property
    def qmp(self) -> Path:
        return self.dir / "qmp.sock"

    @property
    def ctl(self) -> Path:
        return self.dir / "ctl"

    @property
    def config_disk(self) -> Path:
        return self.dir / "config.img"

    @property
    def console(self) -> Path:
        return self.dir / "console.log"

    def handle(self) -> Instance:
        return Instance(
            sandbox_id=self.sandbox_id, id=self.id, address=self.address, data=self.to_json()
        )

    def write_to(self, inst: Instance) -> None:
        inst.data = self.to_json()

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in _PATHS:
            d[k] = str(d[k]) if d[k] is not None else None
        d["mounts"] = [{**m, "path": str(m["path"])} for m in d["mounts"]]
        d["backend"] = "qemu"
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Machine:
        if d.get("backend") != "qemu":
            raise ValueError("not a qemu machine")
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        for k in _PATHS:
            if kw.get(k) is not None:
                kw[k] = Path(kw[k])
        kw["mounts"] = [
            Drive(m["serial"], Path(m["path"]), m["destination"]) for m in kw.get("mounts") or []
        ]
        return cls(**kw)

    @classmethod
    def of(cls, inst: Instance) -> Machine:
        return cls.from_json(dict(inst.data or {}))

    def save(self) -> None:
        tmp = self.dir / f".{MACHINE_FILE}.tmp"
        tmp.write_text(json.dumps(self.to_json()))
        tmp.rename(self.dir / MACHINE_FILE)


def new_machine_id(sandbox_id: str) -> str:
    if not ID_RE.fullmatch(sandbox_id):
        raise RuntimeFailure(f"invalid sandbox id {sandbox_id!r}")
    return f"{sandbox_id}-{secrets.token_hex(4)}"


def config_script(spec: SandboxSpec, mounts: list[Drive]) -> bytes:
    """The guest's config (`guestinit.INIT` sources it): the address, hostname, mounts and
    the first process behind the initramfs's `env -i` and `chroot`."""
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOSTNAME": spec.hostname,
        **spec.env,
    }
    argv = [
        "/bin/busybox",
        "env",
        "-i",
        *(f"{k}={v}" for k, v in env.items()),
        "/bin/busybox",
        "chroot",
        "/newroot",
        *spec.args,
    ]
    lines = [
        f"AENV_ADDRESS={shlex.quote(f'{SANDBOX_IP}/{LINK_PREFIXLEN}')}",
        f"AENV_GATEWAY={shlex.quote(_gateway())}",
        f"AENV_HOSTNAME={shlex.quote(spec.hostname)}",
        "AENV_MOUNTS=" + shlex.quote(" ".join(f"{m.serial}:{m.destination}" for m in mounts)),
        "set -- " + " ".join(shlex.quote(a) for a in argv),
    ]
    data = ("\n".join(lines) + "\n").encode()
    return data + b"\0" * (-len(data) % 512)


def _gateway() -> str:
    net = ipaddress.ip_network(f"{SANDBOX_IP}/{LINK_PREFIXLEN}", strict=False)
    return str(next(h for h in net.hosts() if str(h) != SANDBOX_IP))


def argv(
    qemu: str, m: Machine, kernel: Path, initrd: Path, cmdline: str, incoming: bool
) -> list[str]:
    """The VM's QEMU command line. A restore must describe the same machine (devices in the
    same order) as the one checkpointed: only the files behind them change."""
    cpu = "host" if m.accel == "kvm" else "max"
    mem = f"{m.memory_mb}M"
    out = [
        qemu,
        "-name",
        f"aenv-{m.id}",
        "-accel",
        m.accel,
        "-cpu",
        cpu,
        "-M",
        "microvm,x-option-roms=off,isa-serial=on,rtc=on,memory-backend=ram",
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
        "-daemonize",
        "-pidfile",
        str(m.dir / "qemu.pid"),
        "-serial",
        f"file:{m.console}",
        "-m",
        mem,
        "-smp",
        str(m.cpu_count),
        "-object",
        f"memory-backend-file,id=ram,size={mem},mem-path={m.ram},"
        f"share={'on' if m.ram_shared else 'off'}",
        "-kernel",
        str(kernel),
        "-initrd",
        str(initrd),
        "-append",
        cmdline,
    ]
    drives = [("base", m.base, True), ("disk", m.disk, False), ("config", m.config_disk, True)]
    drives += [(d.serial.removeprefix("aenv-"), d.path, True) for d in m.mounts]
    for name, path, ro in drives:
        out += [
            "-drive",
            f"id={name},file={path},format=raw,if=none,readonly={'on' if ro else 'off'}",
            "-device",
            f"virtio-blk-device,drive={name},serial=aenv-{name}",
        ]
    out += [
        "-netdev",
        "tap,id=net0,ifname=tap0,script=no,downscript=no",
        "-device",
        "virtio-net-device,netdev=net0,mac=52:54:00:ae:00:01",
        "-object",
        "rng-random,id=rng0,filename=/dev/urandom",
        "-device",
        "virtio-rng-device,rng=rng0",
        "-device",
        "virtio-serial-device",
        "-chardev",
        f"pipe,id=ctl,path={m.ctl}",
        "-device",
        "virtserialport,chardev=ctl,name=aenv.ctl",
        "-qmp",
        f"unix:{m.qmp},server=on,wait=off",
    ]
    if incoming:
        out += ["-incoming", "defer"]
    return out


def make_pipes(m: Machine) -> None:
    for end in ("in", "out"):
        p = Path(f"{m.ctl}.{end}")
        if not p.exists():
            os.mkfifo(p, 0o600)


class Control:
    """Requests to the guest's control loop (`guestinit`), one at a time per VM."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}

    def forget(self, vm_id: str) -> None:
        self._locks.pop(vm_id, None)

    async def ask(self, m: Machine, request: str, timeout: float = 30.0) -> None:
        async with self._locks.setdefault(m.id, asyncio.Lock()):
            # Random, not counted: an answer left in the pipe by an earlier server process
            # must not pass for this request's.
            n = secrets.randbelow(1 << 30)
            word, *args = request.split()
            asked = asyncio.ensure_future(
                asyncio.to_thread(_exchange, m.ctl, " ".join([word, str(n), *args]), n, timeout)
            )
            try:
                await asyncio.shield(asked)
            except asyncio.CancelledError:
                # The thread reads on: the next request waits until it stopped, or it could
                # take that request's answer for one of its own to skip.
                with contextlib.suppress(Exception):
                    await asked
                raise
            except OSError as e:
                raise RuntimeFailure(f"guest of {m.id}: {e}") from e


def _exchange(ctl: Path, line: str, n: int, timeout: float) -> None:
    """Writes one request and reads answers until its own (older ones may be queued)."""
    end = time.monotonic() + timeout
    # Non-blocking opens: QEMU holds both ends open, so neither waits for a peer.
    fd_out = os.open(f"{ctl}.out", os.O_RDONLY | os.O_NONBLOCK)
    try:
        fd_in = os.open(f"{ctl}.in", os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(fd_in, line.strip().encode() + b"\n")
        finally:
            os.close(fd_in)
        buf = b""
        while True:
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd_out], [], [], left)[0]:
                raise OSError(f"no answer to {line.split()[0]} in {timeout:.0f}s")
            chunk = os.read(fd_out, 4096)
            if not chunk:
                raise OSError("control channel closed")
            buf += chunk
            for answer in buf.split(b"\n"):
                if answer.strip() == f"ok {n}".encode():
                    return
                with contextlib.suppress(ValueError):
                    if answer.startswith(b"unknown") and int(answer.split()[1]) == n:
                        raise OSError(f"guest refused {line.split()[0]}")
            buf = buf.rsplit(b"\n", 1)[-1]
    finally:
        os.close(fd_out)
