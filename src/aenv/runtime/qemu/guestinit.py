"""The guest's first program: a busybox shell script in the initramfs (`guest.py` packs it).

It loads the virtio modules, finds its disks by serial (`aenv-base`, `aenv-disk`,
`aenv-config`, `aenv-m<N>`), reads the sandbox's config (a shell fragment on `aenv-config`,
written by `machine.py`), mounts the root as an overlay of the read-only base image and the
sandbox's own disk (`/upper`, `/work` on it), mounts the read-only images (the envd bundle),
configures `eth0` with the slot's fixed address, starts the control loop, and then becomes the
sandbox's init: PID 1 is the spec's first process, chrooted into the overlay, as on gVisor.
The config's `set -- ...` names it, behind the initramfs's own `env -i` and `chroot` (the
image need not have either).

The control loop answers on the virtio-serial port `aenv.ctl` (a pipe chardev on the host,
always connected, so a read blocks instead of polling):
  `sync N`               flush the page cache to the disks      -> `ok N`
  `resume N EPOCH SEED`  after a restore: the wall clock set, fresh entropy mixed in
                         (the seed from the host and the virtio-rng device) and the
                         kernel's generator reseeded from it (`bin/reseed`) -> `ok N`

Mixing bytes into the pool is not enough on its own: Linux (5.18 on) draws `/dev/urandom` and
`getrandom(2)` from a generator it reseeds from the pool only every minute (every few seconds
just after boot), so fork children restored from one memory image gave the same random bytes
until then. The `RNDRESEEDCRNG` ioctl reseeds at once; busybox has no way to make it, so the
initramfs carries a program of its own for it (`reseed_program`).
"""

from __future__ import annotations

import struct

# ioctl(2) request _IO('R', 0x07) of <linux/random.h>: reseed the kernel's generator now.
RNDRESEEDCRNG = 0x5207
_LOAD_ADDRESS = 0x400000


def reseed_program() -> bytes:
    """A static x86-64 Linux program: `ioctl(open("/dev/urandom"), RNDRESEEDCRNG)`, whose
    exit status is 0 or the errno of what failed. A few machine instructions in a minimal
    ELF file, so the initramfs needs no compiler and no libc."""
    path = b"/dev/urandom\0"
    head = 64 + 56  # the ELF header and its one program header, then the code
    code = bytearray()
    code += b"\xb8" + struct.pack("<I", 2)  # mov eax, SYS_open
    lea_at = len(code)
    code += b"\x48\x8d\x3d\0\0\0\0"  # lea rdi, [rip + path] (patched below)
    code += b"\xbe" + struct.pack("<I", 0)  # mov esi, O_RDONLY
    code += b"\x31\xd2\x0f\x05"  # xor edx, edx; syscall
    code += b"\x89\xc7"  # mov edi, eax (the fd; a failed open makes ioctl say EBADF)
    code += b"\xb8" + struct.pack("<I", 16)  # mov eax, SYS_ioctl
    code += b"\xbe" + struct.pack("<I", RNDRESEEDCRNG)  # mov esi, RNDRESEEDCRNG
    code += b"\x31\xd2\x0f\x05"  # xor edx, edx; syscall
    code += b"\x89\xc7\xf7\xdf"  # mov edi, eax; neg edi (0, or -errno -> errno)
    code += b"\xb8" + struct.pack("<I", 231)  # mov eax, SYS_exit_group
    code += b"\x0f\x05"  # syscall
    code[lea_at + 3 : lea_at + 7] = struct.pack("<i", len(code) - (lea_at + 7))
    code += path
    size = head + len(code)
    ident = b"\x7fELF\x02\x01\x01" + b"\0" * 9  # 64-bit, little-endian, version 1
    elf = struct.pack(
        "<16sHHIQQQIHHHHHH",
        ident,
        2,  # ET_EXEC
        0x3E,  # EM_X86_64
        1,
        _LOAD_ADDRESS + head,  # entry: the first instruction
        64,  # program headers right after this header
        0,  # no section headers
        0,
        64,
        56,
        1,
        0,
        0,
        0,
    )
    # One PT_LOAD segment, readable and executable, mapping the whole file.
    phdr = struct.pack("<IIQQQQQQ", 1, 5, 0, _LOAD_ADDRESS, _LOAD_ADDRESS, size, size, 0x1000)
    return elf + phdr + bytes(code)


INIT = r"""#!/bin/busybox sh
export PATH=/bin
busybox mount -t devtmpfs dev /dev
busybox mount -t proc proc /proc
busybox mount -t sysfs sys /sys
for m in $(cat /lib/modules/order); do insmod /lib/modules/$m.ko 2>/dev/null || echo "aenv-init: insmod $m failed"; done
if grep -q aenv.probe /proc/cmdline; then echo AENV-PROBE-OK; poweroff -f; fi
disk_of() {
    for b in /sys/block/vd*; do
        [ "$(cat $b/serial 2>/dev/null)" = "$1" ] && { echo /dev/${b##*/}; return 0; }
    done
    return 1
}
fail() { echo "aenv-init: $*"; poweroff -f; }
i=0
until disk_of aenv-config >/dev/null; do
    i=$((i+1)); [ $i -gt 200 ] && fail "no config disk"; usleep 20000
done
tr -d '\000' < $(disk_of aenv-config) > /config.sh
. /config.sh
mkdir -p /base /rw /newroot
mount -t ext4 -o ro $(disk_of aenv-base) /base || fail "cannot mount the base image"
mount -t ext4 $(disk_of aenv-disk) /rw || fail "cannot mount the sandbox's disk"
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/base,upperdir=/rw/upper,workdir=/rw/work /newroot \
    || fail "cannot mount the root overlay"
for m in $AENV_MOUNTS; do
    mkdir -p /newroot${m#*:}
    mount -t ext4 -o ro $(disk_of ${m%%:*}) /newroot${m#*:} || fail "cannot mount $m"
done
for d in proc sys dev tmp; do mkdir -p /newroot/$d; done
mount -t proc proc /newroot/proc
mount -t sysfs sys /newroot/sys
mount -t devtmpfs dev /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /newroot/dev/pts
mount -t tmpfs -o mode=1777 shm /newroot/dev/shm
ip link set lo up
ip addr add $AENV_ADDRESS dev eth0
ip link set eth0 up
ip route add default via $AENV_GATEWAY
hostname "$AENV_HOSTNAME"
ctl() {
    port=""
    for p in /sys/class/virtio-ports/*; do
        [ "$(cat $p/name 2>/dev/null)" = aenv.ctl ] && port=/dev/${p##*/}
    done
    [ -n "$port" ] || return
    exec 3<>$port
    while :; do
        if read -r cmd n a b <&3; then
            case $cmd in
            sync) sync; echo "ok $n" >&3 ;;
            resume)
                date -s "@$a" >/dev/null 2>&1
                echo "$b" > /dev/urandom
                head -c 64 /dev/hwrng > /dev/urandom 2>/dev/null
                reseed || echo "aenv-init: reseeding the kernel's generator failed: $?" > /dev/console
                echo "ok $n" >&3 ;;
            *) echo "unknown $n" >&3 ;;
            esac
        else
            sleep 1
        fi
    done
}
ctl </dev/null >/dev/null 2>&1 &
cd /newroot
exec "$@"
"""
