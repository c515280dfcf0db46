"""What a guest boots: the kernel (Debian's cloud kernel, scripts/install-guest-kernel.sh),
an initramfs made here (busybox-static, the kernel's virtio modules, `guestinit.INIT`), its
command line, and the accelerator this host can run it with.

The cloud kernel builds every virtio driver as a module, hence the initramfs. Its command line
carries the TSC's frequency (`tsc_early_khz`, `lpj`): a TCG guest calibrating its TSC against
the PIT hangs when the host is busy (two boots at once on two cores did).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import io
import json
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from aenv.errors import RuntimeFailure
from aenv.runtime import _proc
from aenv.runtime.qemu.guestinit import INIT, reseed_program

log = logging.getLogger("aenv.runtime")

BUSYBOX = Path("/bin/busybox")
# One answer per host boot (/run is a tmpfs): KVM that boots a guest does not come and go.
ACCEL_CACHE = Path("/run/aenv-qemu-accel.json")
PROBE_SECONDS = 20.0
_HZ = 250  # Debian's CONFIG_HZ


@dataclass(frozen=True)
class GuestBoot:
    kernel: Path
    initrd: Path
    release: str

    def cmdline(self, extra: str = "") -> str:
        khz = tsc_khz()
        timing = f" tsc_early_khz={khz} lpj={khz * 1000 // _HZ}" if khz else ""
        return f"console=ttyS0 reboot=k panic=-1 quiet{timing} {extra}".strip()


def tsc_khz() -> int:
    """The host CPU's clock in kHz (what a TCG guest's TSC runs at), or 0 if unknown."""
    with contextlib.suppress(OSError, ValueError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    return 0


def _newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A cpio archive in the kernel's `newc` format: (path, mode, data) per entry."""
    out = io.BytesIO()

    def one(name: str, mode: int, data: bytes, ino: int) -> None:
        raw = name.encode() + b"\0"
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(raw), 0]
        out.write(b"070701" + "".join(f"{v:08x}" for v in fields).encode() + raw)
        out.write(b"\0" * (-(110 + len(raw)) % 4))
        out.write(data + b"\0" * (-len(data) % 4))

    for ino, (name, mode, data) in enumerate(entries, start=1):
        one(name, mode, data, ino)
    one("TRAILER!!!", 0, b"", 0)
    return out.getvalue()


def _initrd_entries(guest_dir: Path) -> list[tuple[str, int, bytes]]:
    d, f, ln = stat.S_IFDIR | 0o755, stat.S_IFREG, stat.S_IFLNK | 0o777
    entries: list[tuple[str, int, bytes]] = [
        (name, d, b"") for name in ("bin", "dev", "proc", "sys", "lib", "lib/modules")
    ]
    entries.append(("bin/busybox", f | 0o755, BUSYBOX.read_bytes()))
    for applet in (
        "sh",
        "mount",
        "insmod",
        "poweroff",
        "cat",
        "tr",
        "mkdir",
        "ip",
        "usleep",
        "grep",
        "hostname",
        "sync",
        "date",
        "head",
        "sleep",
        "env",
        "chroot",
    ):
        entries.append((f"bin/{applet}", ln, b"busybox"))
    entries.append(("bin/reseed", f | 0o755, reseed_program()))
    entries.append(("init", f | 0o755, INIT.encode()))
    modules = guest_dir / "modules"
    order = (modules / "order").read_text()
    entries.append(("lib/modules/order", f | 0o644, order.encode()))
    for m in order.split():
        entries.append((f"lib/modules/{m}.ko", f | 0o644, (modules / f"{m}.ko").read_bytes()))
    return entries


def _build_initrd(guest_dir: Path, cache: Path) -> Path:
    entries = _initrd_entries(guest_dir)
    h = hashlib.sha256()
    for name, mode, data in entries:
        h.update(f"{name}\0{mode}\0".encode() + hashlib.sha256(data).digest())
    target = cache / f"initrd-{h.hexdigest()[:16]}.cpio.gz"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(gzip.compress(_newc(entries), compresslevel=6, mtime=0))
        tmp.rename(target)
    return target


async def prepare(guest_dir: Path, cache: Path) -> GuestBoot:
    """The kernel and an initramfs (built once per content into `cache`)."""
    kernel, release = guest_dir / "vmlinuz", guest_dir / "release"
    missing = [
        p for p in (kernel, release, guest_dir / "modules" / "order", BUSYBOX) if not p.exists()
    ]
    if missing:
        raise RuntimeFailure(
            f"the qemu backend needs {', '.join(map(str, missing))}: run `make install` "
            "(scripts/install-guest-kernel.sh and busybox-static)"
        )
    initrd = await asyncio.to_thread(_build_initrd, guest_dir, cache)
    return GuestBoot(kernel, initrd, (await asyncio.to_thread(release.read_text)).strip())


async def choose_accel(qemu: str, boot: GuestBoot, wanted: str, work: Path) -> str:
    """ "kvm" or "tcg": as configured, or (auto) KVM if it boots this guest here, probed
    once per host boot; a KVM that cannot (this machine's PVM flavour) falls back to TCG."""
    if wanted != "auto":
        return wanted
    boot_id = await asyncio.to_thread(Path("/proc/sys/kernel/random/boot_id").read_text)
    with contextlib.suppress(OSError, ValueError):
        known = json.loads(await asyncio.to_thread(ACCEL_CACHE.read_text))
        if known.get("boot_id") == boot_id and known.get("kernel") == boot.release:
            return str(known["accel"])
    accel = "tcg"
    if os.access("/dev/kvm", os.R_OK | os.W_OK):
        t0 = time.perf_counter()
        if await _probe_kvm(qemu, boot, work):
            accel = "kvm"
        log.info("KVM probe: %s in %.1f s", accel, time.perf_counter() - t0)
    record = {"boot_id": boot_id, "kernel": boot.release, "accel": accel}
    with contextlib.suppress(OSError):
        await asyncio.to_thread(ACCEL_CACHE.write_text, json.dumps(record))
    return accel


async def _probe_kvm(qemu: str, boot: GuestBoot, work: Path) -> bool:
    """Boots the guest under KVM to its first userspace line and powers it off."""
    await asyncio.to_thread(work.mkdir, parents=True, exist_ok=True)
    argv = [
        qemu,
        "-accel",
        "kvm",
        "-cpu",
        "host",
        "-M",
        "microvm,x-option-roms=off,isa-serial=on",
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
        "-m",
        "256",
        "-serial",
        "stdio",
        "-kernel",
        str(boot.kernel),
        "-initrd",
        str(boot.initrd),
        "-append",
        boot.cmdline("aenv.probe"),
    ]
    try:
        done = await _proc.run(argv, time_limit=PROBE_SECONDS, check=False)
    except RuntimeFailure:
        return False
    return "AENV-PROBE-OK" in done.stdout
