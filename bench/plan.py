"""How many samples each row takes, in full and quick mode, and the progress interface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Plan:
    create: int = 20
    create_cold: int = 15
    exec: int = 30
    files: int = 20
    pause: int = 20
    hibernate: int = 10
    snapshot: int = 15
    dirty: int = 3
    fork_1: int = 10
    # diff_10_of_1gib / apply_10_of_1gib: samples (each: a fork of a parent holding
    # `tree_files` files of 1 MiB, the child rewriting `tree_changed`, its snapshot, diff and
    # apply); rollback: samples (rollbacks to one memory snapshot).
    forktree: int = 5
    tree_files: int = 1024
    tree_changed: int = 10
    rollback: int = 5
    fork_4: int = 5
    fork_16: int = 3
    concurrent_10_rounds: int = 3
    concurrent_50_rounds: int = 1
    # Rounds of "every sandbox of a concurrent round runs one command at once"
    # (exec_concurrent_10/50); each sandbox's exec is one sample.
    exec_concurrent_rounds: int = 5
    # snapshot_after_1000_cmds: samples (each: a snapshot of a fresh sandbox, the baseline,
    # and one of a sandbox that ran `cmds` processes plus `cmds_envd` envd commands).
    cmds_snapshot: int = 3
    cmds: int = 1000
    cmds_envd: int = 50
    # How the processes are made (scenarios_lifecycle.cmds_command): `exec` (programs) or
    # `fork` (subshells, ~3× faster in gVisor).
    cmds_form: str = "exec"
    # The node-population rows: `idle_sandboxes` running idle sandboxes on the node for
    # *_with_100 (`create`/`exec` samples each, with one and with them), then
    # `list_sandboxes` on the node (the idle ones paused files-only, the rest created and
    # paused files-only) for list_1000 (`list` samples); `populate_concurrency` creates at once.
    idle_sandboxes: int = 100
    list_sandboxes: int = 1000
    populated_create: int = 10
    populated_exec: int = 30
    list: int = 20
    populate_concurrency: int = 8
    # Seconds an idle sandbox sits before its memory is read; how long to wait for a
    # paused sandbox to report it is hibernated.
    idle_wait: float = 3.0
    # idle_node_mc / idle_sandbox_mc: the window the machine's busy CPU is averaged over,
    # and how long the filled node settles first (sandboxes nap after 10 s without a
    # request, noticed by the next 5-s metrics round).
    idle_cpu_window: float = 60.0
    idle_cpu_settle: float = 20.0
    hibernate_wait: float = 20.0
    dirty_mib: int = 1024
    # The baseline of the heavy rows (snapshot_dirty_1gib, fork_*, concurrent_create_50):
    # their targets are absolute, and together they take ~45 s of a quick run.
    baseline_heavy: bool = True
    # A row stops after this many failed samples in a row (quick: at the first).
    max_failures: int = 3
    # Seconds a pause, resume, snapshot or fork call may take (None: the client's 180 s),
    # and a fork child to answer its first command.
    op_timeout: float | None = None
    child_timeout: float = 30.0
    mode: str = "full"
    # The QEMU rows (bench/scenarios_qemu.py): samples of each, idle VMs and their window.
    qemu: int = 5
    qemu_idle: int = 4
    qemu_idle_window: float = 30.0

    @classmethod
    def quick(cls) -> Plan:
        return cls(
            create=3,
            create_cold=3,
            qemu=2,
            qemu_idle=2,
            qemu_idle_window=10.0,
            exec=8,
            files=4,
            pause=4,
            hibernate=2,
            snapshot=3,
            dirty=1,
            fork_1=2,
            forktree=2,
            rollback=2,
            fork_4=1,
            fork_16=1,
            concurrent_10_rounds=1,
            concurrent_50_rounds=1,
            exec_concurrent_rounds=1,
            cmds_snapshot=1,
            cmds_envd=10,
            cmds_form="fork",
            idle_sandboxes=15,
            list_sandboxes=40,
            populated_create=3,
            populated_exec=8,
            list=5,
            idle_wait=1.0,
            idle_cpu_window=20.0,
            hibernate_wait=5.0,
            baseline_heavy=False,
            max_failures=1,
            op_timeout=10.0,
            child_timeout=10.0,
            mode="quick",
        )


class Progress(Protocol):
    def step(self, label: str, total: int) -> None:
        """A new step with `total` units of work (the previous one is finished)."""

    def advance(self, n: int = 1) -> None: ...

    def log(self, message: str) -> None: ...


class NullProgress:
    def step(self, label: str, total: int) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass

    def log(self, message: str) -> None:
        pass
