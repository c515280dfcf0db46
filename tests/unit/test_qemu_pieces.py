"""The QEMU backend's pure parts: the initramfs archive, the guest's config script, the VM
record and the checkpoint image's record, the command line a restore must repeat."""

from __future__ import annotations

import errno
import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from aenv.domain import Instance
from aenv.errors import RuntimeFailure
from aenv.runtime import checkpoints
from aenv.runtime.base import SandboxSpec
from aenv.runtime.qemu import disks, image, vmproc
from aenv.runtime.qemu.guest import _newc
from aenv.runtime.qemu.guestinit import reseed_program
from aenv.runtime.qemu.machine import Drive, Machine, argv, config_script, new_machine_id


def machine(tmp_path: Path, **kw: object) -> Machine:
    m = Machine(
        sandbox_id="sbx",
        id="sbx-0011aabb",
        address="10.0.0.2",
        slot=3,
        dir=tmp_path / "vm",
        base=tmp_path / "base.ext4",
        disk=tmp_path / "vm" / "disk.img",
        ram=tmp_path / "ram",
        mounts=[Drive("aenv-m0", tmp_path / "bundle.ext4", "/opt/aenv")],
        cpu_count=2,
        memory_mb=384,
    )
    for k, v in kw.items():
        setattr(m, k, v)
    return m


def _read_newc(data: bytes) -> list[tuple[str, int, bytes]]:
    """The kernel's reading of a newc archive: 110-byte hex headers, names and data padded
    to 4 bytes, up to the trailer."""
    out: list[tuple[str, int, bytes]] = []
    at = 0
    while True:
        assert data[at : at + 6] == b"070701"
        fields = [int(data[at + 6 + 8 * i : at + 14 + 8 * i], 16) for i in range(13)]
        mode, size, namesize = fields[1], fields[6], fields[11]
        name = data[at + 110 : at + 110 + namesize - 1].decode()
        at += 110 + namesize
        at += -at % 4
        body = data[at : at + size]
        at += size + (-size % 4)
        if name == "TRAILER!!!":
            assert at == len(data)
            return out
        out.append((name, mode, body))


def test_the_initramfs_is_a_newc_archive(tmp_path: Path) -> None:
    entries = [("bin", 0o40755, b""), ("bin/x", 0o100755, b"abcde"), ("l", 0o120777, b"x")]
    data = _newc(entries)
    assert len(data) % 4 == 0
    assert _read_newc(data) == entries
    if shutil.which("cpio"):
        out = tmp_path / "x"
        out.mkdir()
        subprocess.run(["cpio", "-id"], input=data, cwd=out, capture_output=True, check=True)
        assert (out / "bin" / "x").read_bytes() == b"abcde"
        assert (out / "l").is_symlink()


@pytest.mark.skipif(
    platform.machine() != "x86_64" or os.geteuid() != 0 or not shutil.which("setpriv"),
    reason="runs the guest's x86-64 program here, as root and as nobody",
)
def test_the_guests_reseed_program_makes_the_reseed_ioctl(tmp_path: Path) -> None:
    """The program a restored guest runs to reseed its kernel's generator (fork children
    must not share random bytes): on this host's kernel it is a valid program whose ioctl
    root may make and nobody else (EPERM is that ioctl's own refusal; a wrong request number
    would be ENOTTY, a broken program no exit status at all)."""
    prog = tmp_path / "reseed"
    prog.write_bytes(reseed_program())
    prog.chmod(0o755)
    assert subprocess.run([str(prog)], timeout=10).returncode == 0
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(prog)]
    assert subprocess.run(nobody, timeout=10).returncode == errno.EPERM


@pytest.mark.skipif(not Path("/bin/sh").exists(), reason="needs a shell")
def test_the_config_script_gives_the_first_process_its_argv_and_env(tmp_path: Path) -> None:
    spec = SandboxSpec(
        sandbox_id="s",
        layers=[],
        args=["/bin/sh", "-c", 'echo "it\'s $HOME" `x` \\ ;'],
        env={"A": "one two", "B": "$(nope)"},
        hostname="box",
    )
    script = config_script(spec, [Drive("aenv-m0", Path("/x"), "/opt/aenv")])
    assert len(script) % 512 == 0
    cfg = tmp_path / "config.sh"
    cfg.write_bytes(script.rstrip(b"\0"))
    out = subprocess.run(
        ["/bin/sh", "-c", f'. {cfg}; printf "%s\\n" "$AENV_MOUNTS" "$AENV_HOSTNAME" "$@"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out[0] == "aenv-m0:/opt/aenv" and out[1] == "box"
    argv_ = out[2:]
    assert argv_[:3] == ["/bin/busybox", "env", "-i"]
    assert "A=one two" in argv_ and "B=$(nope)" in argv_ and "HOSTNAME=box" in argv_
    assert argv_[-6:] == ["/bin/busybox", "chroot", "/newroot", *spec.args]


def test_a_vm_record_travels_through_json_and_refuses_other_backends(tmp_path: Path) -> None:
    m = machine(tmp_path, upper=tmp_path / "upper", pid=42)
    back = Machine.of(Instance(**{**m.handle().__dict__}))
    assert back == m
    with pytest.raises(ValueError):
        Machine.from_json({"sandbox_id": "x", "id": "x-1", "backend": "gvisor"})
    with pytest.raises(RuntimeFailure):
        new_machine_id("../bad")
    assert new_machine_id("good").startswith("good-")


def test_a_restore_describes_the_same_machine(tmp_path: Path) -> None:
    m = machine(tmp_path)
    boot = argv("qemu", m, Path("/k"), Path("/i"), "quiet", incoming=False)
    again = argv("qemu", m, Path("/k"), Path("/i"), "quiet", incoming=True)
    assert again == [*boot, "-incoming", "defer"]
    serials = [a.rsplit("serial=", 1)[1] for a in boot if a.startswith("virtio-blk-device")]
    assert serials == ["aenv-base", "aenv-disk", "aenv-config", "aenv-m0"]
    assert "share=on" in " ".join(boot)
    m.ram_shared = False  # a child mapping an image's memory: private, copy-on-write
    assert "share=off" in " ".join(argv("qemu", m, Path("/k"), Path("/i"), "", incoming=True))
    assert boot[boot.index("-smp") + 1] == "2" and boot[boot.index("-m") + 1] == "384M"


def test_an_image_record_is_checked_before_a_restore(tmp_path: Path) -> None:
    m = machine(tmp_path)
    d = tmp_path / "img"
    d.mkdir()
    assert not image.complete(d)
    (d / image.RECORD).write_text(image.ImageRecord.of(m).to_json())
    for f in (image.STATE, image.DISK, image.CONFIG, image.MEMORY):
        assert not image.complete(d)  # every file the record implies, or it is not whole
        (d / f).write_bytes(b"x")
    assert image.complete(d)
    rec = image.ImageRecord.from_json((d / image.RECORD).read_text())
    assert rec == image.ImageRecord.of(m) and rec.memory_file
    with pytest.raises(RuntimeFailure, match="kvm"):
        image.read(d, "kvm")
    with pytest.raises(RuntimeFailure, match="lacks"):  # the base image is not on this node
        image.read(d, "tcg")
    m.base.write_bytes(b"")
    m.mounts[0].path.write_bytes(b"")
    assert image.read(d, "tcg") == rec
    gvisor = tmp_path / "other"
    gvisor.mkdir()
    (gvisor / "checkpoint.img").write_bytes(b"x")
    with pytest.raises(RuntimeFailure, match="made by the gvisor backend"):
        image.read(gvisor, "tcg")
    with pytest.raises(RuntimeFailure, match="made by the qemu backend; this node runs gvisor"):
        checkpoints.refuse_foreign(d, "gvisor")


def test_a_dead_vms_console_says_why_and_is_kept(tmp_path: Path) -> None:
    m = machine(tmp_path)
    m.dir.mkdir()
    assert vmproc.exit_cause(m) is None  # no console yet
    m.console.write_text(
        "[    0.000000] Linux version 6.1\n"
        "aenv-init: cannot mount the base image\n"
        "[    2.100000] reboot: Power down\n"
    )
    assert vmproc.exit_cause(m) == "the guest: aenv-init: cannot mount the base image"
    kept = tmp_path / "consoles"
    for i in range(vmproc.KEPT_CONSOLES + 2):
        m.id = f"sbx-{i:08x}"
        m.console.write_text(f"boot {i}\n")
        vmproc.keep_console(m, kept)
    logs = sorted(p.name for p in kept.iterdir())
    assert len(logs) == vmproc.KEPT_CONSOLES and f"sbx-{1:08x}.log" not in logs
    assert (kept / f"sbx-{vmproc.KEPT_CONSOLES + 1:08x}.log").read_text().startswith("boot")


def test_a_packed_disk_holds_its_written_extents_only(tmp_path: Path) -> None:
    disk = tmp_path / "disk.img"
    with open(disk, "wb") as f:
        f.truncate(1 << 30)  # 1 GiB, sparse
        for at, data in ((0, b"head"), (300 << 20, b"x" * 70_000), ((1 << 30) - 5, b"tail!")):
            f.seek(at)
            f.write(data)
    packed, back = tmp_path / "disk.packed", tmp_path / "back.img"
    disks.pack(disk, packed)
    assert packed.stat().st_size < 1 << 20  # what was written, not the disk's size
    disks.unpack(packed, back)
    assert back.stat().st_size == 1 << 30
    assert back.stat().st_blocks * 512 < 4 << 20  # still sparse
    with open(disk, "rb") as a, open(back, "rb") as b:
        for at, n in ((0, 4096), (300 << 20, 70_000), ((1 << 30) - 4096, 4096), (5 << 20, 4096)):
            a.seek(at)
            b.seek(at)
            assert a.read(n) == b.read(n)
    (tmp_path / "junk").write_bytes(b"not a disk")
    with pytest.raises(RuntimeFailure):
        disks.unpack(tmp_path / "junk", back)


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mkfs.ext4") is None, reason="needs root and mkfs.ext4"
)
async def test_files_go_out_of_a_guest_disk_whole_or_not_at_all(tmp_path: Path) -> None:
    """A stopped guest's files reach the host's upper dir through its disk; a disk that
    cannot be read leaves the last good copy there (not an emptied dir)."""
    upper = tmp_path / "upper"
    (upper / "etc").mkdir(parents=True)
    (upper / "etc" / "motd").write_text("made in the guest\n")
    (upper / "root").mkdir(mode=0o700)
    os.symlink("etc/motd", upper / "link")
    disk = tmp_path / "disk.img"
    await disks.disk_from_upper(upper, disk, 64)

    host = tmp_path / "host-upper"
    (host / "stale").mkdir(parents=True)
    await disks.copy_upper_out(disk, host)
    assert (host / "etc" / "motd").read_text() == "made in the guest\n"
    assert os.readlink(host / "link") == "etc/motd"
    assert (host / "root").stat().st_mode & 0o777 == 0o700
    assert not (host / "stale").exists()

    broken = tmp_path / "broken.img"
    broken.write_bytes(b"\0" * 1024 * 1024)
    with pytest.raises(RuntimeFailure):
        await disks.copy_upper_out(broken, host)
    assert (host / "etc" / "motd").read_text() == "made in the guest\n"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]
