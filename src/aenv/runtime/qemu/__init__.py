"""The QEMU microVM backend (`AENV_RUNTIME=qemu`): each sandbox a `qemu-system-x86_64 -M
microvm` guest running Debian's cloud kernel, accelerated by KVM where it boots a standard
guest (probed once per host boot, `guest.choose_accel`) and emulated by TCG elsewhere.

What a sandbox is made of, on the host:

* a **network slot** of `net/` like gVisor's: in the slot's inner namespace `eth0` is bridged
  to the VM's `tap0`, and the guest holds the address `eth0` had, so `Instance.address`,
  the proxy, ports, egress rules and traffic tokens are the same as on gVisor;
* **disks** (`disks.py`, made or copied before QEMU starts by `provision.py`): the layer stack merged into one read-only ext4 image, shared by every
  sandbox of that stack; the same for each read-only mount (the envd bundle); a disk of its
  own for the guest overlay's upper; a small config disk (`machine.config_script`);
* **RAM** in a file (`memory-backend-file`): the VM's own under /dev/shm, shared, so a
  checkpoint saves only device state and copies the file (a reflink where it can); a child
  restored from an image maps the image's `memory` privately, copy-on-write, so N children
  start without a memory copy;
* a **QEMU process** (`vmproc.py`) in the sandbox's cgroup, driven over QMP (`qmp.py`), and a
  control channel to the guest's init (`machine.Control`, `guestinit.py`) for `sync` and the
  clock and entropy of a restored child.

The guest (`guest.py`, `guestinit.py`): an initramfs loads the virtio modules, mounts the
overlay, and execs the spec's first process (envd) chrooted into it as PID 1. The guest's own
OOM killer ends a process that exhausts the guest's memory; the sandbox lives on.

With an `upper` the host dir holds the guest's files whenever the orchestrator reads it: at a
freeze, a held checkpoint and a stop the guest syncs and the upper is copied out of its disk.
"""

from aenv.runtime.qemu.backend import QemuRuntime

__all__ = ["QemuRuntime"]
