"""The OCI runtime spec (`config.json`) of a sandbox's bundle, generated in Python."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aenv.runtime.base import SandboxSpec

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# The set Docker/containerd give a container (and so runsc under Docker). runsc's bare
# `runsc spec` default (AUDIT_WRITE, KILL, NET_BIND_SERVICE) would stop root in the sandbox
# from switching users (envd runs commands as `user`), chown-ing files or running apt.
# These are capabilities inside gVisor's own kernel, not on the host.
CAPABILITIES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
]
# The first process (envd) also gets CAP_SYS_ADMIN, to mount /proc with gVisor's dentry
# cache off (see aenv/envd/procfs.py); it drops it from the bounding set before it starts
# anything, so no process of the sandbox ever holds it.
INIT_CAPABILITIES = [*CAPABILITIES, "CAP_SYS_ADMIN"]

CPU_PERIOD_US = 100_000
CPU_SHARES_PER_CPU = 1024


def process_limit(memory_mb: int) -> int:
    """Processes each user of a sandbox may have (RLIMIT_NPROC, which gVisor enforces:
    fork fails with EAGAIN). Every task costs the sentry memory outside what the sandbox
    allocates itself, so a fork bomb reaching the memory limit would have the host kill the
    whole sandbox; at one process per 2 MiB (a shell takes ~0.5 MiB) it runs out of
    processes first and the sandbox keeps answering."""
    return max(128, memory_mb // 2)


def host_task_limit(memory_mb: int) -> int:
    """The host `pids` cgroup limit of the sandbox and gofer processes: a backstop far above
    what the in-sandbox limit lets the sentry need (host threads per task are few)."""
    return 4 * process_limit(memory_mb) + 1024


def base_mounts() -> list[dict[str, Any]]:
    """The mounts every sandbox gets (proc, dev, devpts, shm, sys), before its own."""
    return [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
        },
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
        },
        {
            "destination": "/dev/shm",
            "type": "tmpfs",
            "source": "shm",
            "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        },
        {
            "destination": "/sys",
            "type": "sysfs",
            "source": "sysfs",
            "options": ["nosuid", "noexec", "nodev", "ro"],
        },
    ]


def config(
    spec: SandboxSpec,
    *,
    rootfs: Path,
    netns_path: str,
    cgroups_path: str,
    tmp_on_rootfs: bool = False,
) -> dict[str, Any]:
    """`tmp_on_rootfs`: bind the rootfs's own /tmp over /tmp. Without a mount there, runsc
    puts a tmpfs of its own on an empty /tmp: files there live in the sentry's memory (a
    /tmp fill has the host kill the sandbox at its memory limit), outside the disk limit,
    and are not part of the sandbox's files (lost by builds and files-only pauses)."""
    env = dict(spec.env)
    env.setdefault("PATH", DEFAULT_PATH)
    mounts = base_mounts() + [
        {
            "destination": m.destination,
            "type": "bind",
            "source": str(m.source),
            "options": ["rbind", "ro" if m.readonly else "rw"],
        }
        for m in spec.mounts
    ]
    if tmp_on_rootfs and not any(m.destination.rstrip("/") == "/tmp" for m in spec.mounts):
        mounts.append(
            {
                "destination": "/tmp",
                "type": "bind",
                "source": str(rootfs / "tmp"),
                "options": ["rbind", "rw", "nosuid", "nodev"],
            }
        )
    cpus = max(1, spec.cpu_count)
    memory_mb = max(16, spec.memory_mb)
    nproc = process_limit(memory_mb)
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": list(spec.args),
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": spec.cwd or "/",
            "capabilities": {
                "bounding": INIT_CAPABILITIES,
                "effective": INIT_CAPABILITIES,
                "permitted": INIT_CAPABILITIES,
            },
            "rlimits": [
                {"type": "RLIMIT_NOFILE", "hard": 65536, "soft": 65536},
                {"type": "RLIMIT_NPROC", "hard": nproc, "soft": nproc},
            ],
            "noNewPrivileges": False,
        },
        # Not read-only: with --overlay2=root:memory the sandbox writes into the sentry's
        # memory overlay (the directory itself is never written); with --overlay2=none
        # `rootfs` is the sandbox's own host overlay and writes land in its upper dir.
        "root": {"path": str(rootfs), "readonly": False},
        "hostname": spec.hostname,
        "mounts": mounts,
        "linux": {
            "namespaces": [
                {"type": "pid"},
                {"type": "ipc"},
                {"type": "uts"},
                {"type": "mount"},
                {"type": "network", "path": netns_path},
            ],
            "cgroupsPath": cgroups_path,
            # The quota caps a sandbox at its cpuCount; the shares split a busy node
            # between sandboxes in proportion to it.
            "resources": {
                "cpu": {
                    "quota": cpus * CPU_PERIOD_US,
                    "period": CPU_PERIOD_US,
                    "shares": cpus * CPU_SHARES_PER_CPU,
                },
                "memory": {"limit": memory_mb * 1024 * 1024},
                "pids": {"limit": host_task_limit(memory_mb)},
            },
        },
    }
