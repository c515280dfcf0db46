"""Isolation backends side by side, behind one interface.

* `base.py` — the interface (`Runtime`, `SandboxSpec`, `Mount`, `Stats`; the `Instance`
  handle is `aenv.domain`'s) and its contract suite, `tests/contract/runtime_contract.py`,
  which every backend passes (the fake in the unit suite, gVisor in the integration suite).
* `select.py` — the one place a backend is chosen, by `AENV_RUNTIME` (`Settings.runtime`).
* `gvisor/` — everything runsc-specific: OCI spec, bundles, the runsc CLI, its processes,
  checkpoint holds over the control socket, reconcile after a crash, the subreaper.
* `fake.py` — an in-memory backend with the same contract, for tests of the layers above.
* Host pieces any backend on this host uses, each in a place of its own: `net/` (a network
  slot per sandbox: router and inner namespaces, veths, egress rules and proxy), `storage/`
  (the btrfs pool and ext4 disk images that hold uppers), `rootfs.py` (host overlay mounts),
  `bundle.py`/`bundle_build.py` (the envd bundle every sandbox runs), and the process-level
  helpers `freezer.py`, `naps.py`, `memguard.py`, `priority.py`, `_proc.py`.

A new backend is one package here and one entry in `select.BACKENDS`. Where a microVM
backend (QEMU `microvm`, issue 25) meets the interface:
* network: the guest's tap device lives in the sandbox's inner namespace of its `net/` slot,
  so `Instance.address` keeps its meaning (every port of the sandbox at one host address)
  and egress rules, the proxy and port forwards work unchanged. envd may instead be reached
  over vsock; that is the backend's concern as long as `address:ENVD_PORT` answers (a
  forwarder in the router namespace), so the orchestrator's envd client stays one.
* rootfs: `SandboxSpec.layers` + `upper` describe the files, not how they are mounted; a VM
  backend turns them into block devices (the read-only layers as one image it caches per
  template stack, the upper as the sandbox's disk from `storage/`), and the guest mounts an
  overlay of the two. `checkpoint`/`restore` write and read the VMM's own image in
  `image_dir`; `image_complete` tells whose image it is.
* optional hooks (`nap`, `on_memory_pressure`, `is_frozen`, `exit_cause`) have defaults that
  do nothing, so a backend implements what its isolation can do.
"""
