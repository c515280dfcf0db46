"""The isolation-backend interface. Backends live beside this file and are chosen at startup.

A backend boots a sandbox from a `SandboxSpec` (rootfs layers + mounts + init command + limits)
inside its own network slot, and can freeze, thaw, checkpoint, restore and destroy it. It knows
nothing about envd, templates or the API: the orchestrator composes those into the spec.

What it hands back is an `Instance` (`aenv.domain`): the orchestrator reads its `id` and
`address`, stores it whole (`dataclasses.asdict`, so `data` holds only JSON values) and passes
it back; `data` is the backend's own and means nothing to anyone else.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aenv.domain import EgressPolicy, Instance
from aenv.egress import SecretLookup

__all__ = ["Instance", "Mount", "Runtime", "SandboxSpec", "Stats"]


@dataclass(frozen=True)
class Mount:
    source: Path
    destination: str
    readonly: bool = True


@dataclass
class SandboxSpec:
    sandbox_id: str
    # Read-only layer directories, topmost first (overlayfs `lowerdir` order).
    layers: list[Path]
    # The sandbox's first process (envd); argv and environment.
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    cpu_count: int = 2
    memory_mb: int = 512
    hostname: str = "sandbox"
    cwd: str = "/"
    # The sandbox's writable layer: a host directory the orchestrator owns (and seals into a
    # read-only layer on a snapshot). When set, the rootfs is a host overlay per container
    # (`lowerdir=layers`, `upperdir=upper`) and every rootfs write lands in `upper`; the
    # runtime never deletes it. None: writes stay in the backend's memory (and checkpoints).
    upper: Path | None = None
    # The writable layer's size in MiB (0: the backend's default). gVisor's upper lives in
    # the orchestrator's storage, which bounds it; a VM backend sizes the guest's disk by it.
    disk_mb: int = 0
    # Where the sandbox may connect to; None or an open policy: no rules beyond the node's
    # fixed denies. In force before the sandbox's first instruction runs.
    egress: EgressPolicy | None = None


@dataclass
class Stats:
    cpu_used_pct: float
    mem_used_bytes: int
    mem_total_bytes: int
    rss_bytes: int


class Runtime(abc.ABC):
    """One isolation backend. All methods are async and keep blocking work off the loop."""

    name: str = "abstract"

    def ready_within(self) -> float:
        """Seconds a booted or restored sandbox may take until its init (envd) serves, before
        the caller gives up on it; a backend that emulates its guests' CPU needs more."""
        return 20.0

    def describe(self) -> dict[str, str]:
        """What `GET /nodes` and `aenv status` show of the backend: its name and what runs
        the sandboxes' code (gVisor's platform, QEMU's accelerator), once started."""
        return {"backend": self.name, "accelerator": ""}

    @abc.abstractmethod
    async def start(self, keep: set[str]) -> dict[str, Instance]:
        """Prepare the host (pools, NAT) and reconcile after a crash.

        `keep` holds the instance ids (`Instance.id`) the catalog still knows as running,
        frozen or stopped: the backend returns, keyed by id, the ones it could recover (still
        alive, or stopped with their network slot intact: `is_stopped`) and removes every
        other trace it left on the host (containers, netns, veths, mounts, bundle dirs). It
        never deletes a sandbox's `upper` directory."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop background work (pools); sandboxes keep running."""

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec, *, reuse: Instance | None = None) -> Instance:
        """Boot a sandbox; returns once its init process was started (not once envd answers).

        `reuse`: a stopped instance (see `stop`) of the same sandbox whose network slot (and
        so address) and, where possible, instance id the new one takes over."""

    @abc.abstractmethod
    async def stop(self, inst: Instance) -> None:
        """Remove the sandbox's processes and rootfs mount but keep its network slot.

        After `checkpoint(inst, dir, leave_running=False)` this is the cheap half of a
        hibernate/re-stack: the container is removed, `spec.upper` is no longer in use (the
        caller may rename or seal it), and `restore(spec, dir, reuse=inst)` brings the
        sandbox back at the same address. On a running instance it kills the processes
        (files in `upper` are kept, memory is not). `destroy` releases the slot."""

    @abc.abstractmethod
    async def destroy(self, inst: Instance) -> None:
        """Remove the sandbox and everything it held (running or stopped); idempotent."""

    @abc.abstractmethod
    async def freeze(self, inst: Instance) -> None: ...

    @abc.abstractmethod
    async def thaw(self, inst: Instance) -> None: ...

    @abc.abstractmethod
    async def checkpoint(
        self, inst: Instance, image_dir: Path, *, leave_running: bool, hold: bool = False
    ) -> None:
        """Write memory + process state (and in-sandbox FS state the backend keeps) to
        image_dir, after which `image_complete(image_dir)` holds. With `leave_running` the
        sandbox goes on; without, it is done (not `alive`) and only `stop` or `destroy` may
        follow. `hold` (with `leave_running`): its processes stay stopped from before the
        checkpoint until `thaw`, its files flushed to the host (so a copy of its upper taken
        meanwhile matches the image); `is_frozen` says so meanwhile, also after a restart."""

    @abc.abstractmethod
    async def restore(
        self, spec: SandboxSpec, image_dir: Path, *, reuse: Instance | None = None
    ) -> Instance:
        """Start a sandbox from a checkpoint image: a new one (own instance id, own network
        slot), or with `reuse` the stopped instance's own slot (same address) and id.

        The image must come from a sandbox with the same rootfs mode (`upper` set or not);
        with `upper`, `spec.layers` must hold what the checkpointed sandbox saw (typically its
        sealed upper on top of its old layers) and `spec.upper` a fresh empty directory.
        Raises `RuntimeFailure` when `image_dir` is not `image_complete`."""

    @abc.abstractmethod
    async def stats(self, inst: Instance) -> Stats: ...

    @abc.abstractmethod
    async def alive(self, inst: Instance) -> bool: ...

    async def exit_cause(self, inst: Instance) -> str | None:
        """Why an instance that is no longer `alive` ended, when the backend can tell (say
        the host killed it at its memory limit); None when it cannot."""
        return None

    async def sync_files(self, inst: Instance) -> None:
        """Makes the `upper` of a running, frozen or checkpointed sandbox show every file it
        wrote so far, for a reader on the host (a diff) or before a `destroy` whose upper is
        kept (a template build's step, a files-only pause, the seal after a hibernation). A
        backend whose rootfs writes land there at once (gVisor's host overlay) has nothing
        to do; a VM's writes are in its own disk."""
        return None

    def on_memory_pressure(self, listener: Callable[[Instance], None]) -> None:
        """`listener(instance)` runs when a running sandbox uses more memory than its size
        (see `runtime/memguard.py`): the caller has a process inside killed before the
        host's OOM killer ends the whole sandbox. A backend that cannot tell never calls it."""
        return None

    async def nap(self, inst: Instance, on: bool) -> None:
        """Lets an idle sandbox's processes sleep in long stretches (`on`) or wake on time
        again (see `runtime/naps.py`); a backend without naps does nothing. Its processes go
        on either way: a nap delays timers, never events."""
        return None

    async def is_frozen(self, inst: Instance) -> bool:
        """Whether the container is frozen (start-up recovery puts it back in the state its
        record says: a crash may fall between a freeze or thaw and its record's save)."""
        return False

    @abc.abstractmethod
    async def set_egress(self, inst: Instance, policy: EgressPolicy) -> None:
        """Replace the egress rules of a running, frozen or stopped sandbox, atomically (no
        moment without rules); an open policy removes them. Raises `RuntimeFailure` for an
        instance that is gone."""

    def use_secrets(self, lookup: SecretLookup) -> None:
        """Where the egress path reads the secrets that header transforms name (a backend
        without header transforms ignores it)."""
        return None

    @property
    def egress_ca_pem(self) -> bytes | None:
        """The CA certificate (PEM) the egress path signs intercepted hosts' certificates
        with, for the trust stores of sandboxes with header transforms; None: the backend
        intercepts nothing (after `start`)."""
        return None

    @abc.abstractmethod
    def is_stopped(self, inst: Instance) -> bool:
        """True for an instance after `stop` (its slot kept, no processes)."""

    @abc.abstractmethod
    def image_complete(self, image_dir: Path) -> bool:
        """Whether `image_dir` holds a whole checkpoint image this backend can restore (what
        `checkpoint` wrote, all of it: a partly fetched or interrupted one is not)."""
