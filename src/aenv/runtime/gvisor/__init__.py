"""The gVisor (`runsc`) backend: the default, and the one that can checkpoint and fork.

Per container (a sandbox has one at a time; a fork child is a new one with a new id), a
bundle dir (`bundles.py`): `$AENV_HOME/sandboxes/<sandbox_id>/<container_id>/`.

* rootfs (`rootfs.py`), per sandbox by `spec.upper`:
  - `upper` set: a writable host overlay (layers + `upper` + a work dir
    `<upper's parent>/work-<container_id>`) mounted at `rootfs/`, runsc `--overlay2=none`:
    rootfs writes land in `upper` on the host, not in memory nor in checkpoints (the sentry's
    own tmpfs mounts such as `/tmp` still are in the checkpoint).
  - `upper` None: the layer itself or a shared read-only overlay of the stack, runsc
    `--overlay2=root:memory`: writes stay in the sentry's memory and travel in checkpoints.
* stop / re-stack: `checkpoint(leave_running=False)` then `stop()` removes the container and
  unmounts its overlay but keeps the network slot (the instance is "stopped"); the caller may
  seal `upper`, and `restore(..., reuse=inst)` starts the sandbox again in the same slot with
  the same container id (so the same address), on a new stack and a new upper.
* network: one slot (`network.py`) per container; the instance's address is the router address.
* limits: `linux.resources` + `linux.cgroupsPath=/<net_prefix>/<container_id>` (runsc creates
  the cgroups; on this host's cgroup v1 hierarchies, memory, cpu quota/shares and pids apply
  to the sandbox and gofer processes; gVisor sizes the guest's RAM by the memory limit, so an
  application's allocation past it fails inside; what still reaches the limit — the sentry's
  own memory — OOM-kills the whole sandbox, not the host, and `exit_cause` says so).
  `RLIMIT_NPROC` in the spec (`oci.process_limit`) bounds processes inside. With a writable
  overlay, /tmp is the rootfs's own (a bind mount), not runsc's in-memory tmpfs.
* destroy: the awaited part only SIGKILLs the sandbox process (it stops serving at once);
  `runsc delete`, slot teardown, unmount and bundle removal finish in a tracked background task
  that `close()` awaits.
* processes: the runtime makes this process a child subreaper, so the runsc sandbox and gofer
  processes it starts are re-parented here and reaped as soon as they exit (`_proc.reap`):
  `runsc delete` of a stopped container then takes ~20 ms instead of waiting for init.

Modules: `backend` (the `Runtime`), `container` (its record in `Instance.data`), `bundles`,
`processes` (ending runsc processes), `reconcile` (start-up after a crash, purge), `stats`.
"""

from aenv.runtime.gvisor.backend import GVisorRuntime

__all__ = ["GVisorRuntime"]
