"""The runtime spec a sandbox gets: its limits (CPU quota and shares, memory, processes
inside and host tasks) follow its shape, and /tmp is the rootfs's own when asked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aenv.runtime.base import Mount, SandboxSpec
from aenv.runtime.gvisor import oci


def spec(**kw: Any) -> SandboxSpec:
    return SandboxSpec(sandbox_id="s", layers=[], args=["/init"], **kw)


def config(s: SandboxSpec, **kw: Any) -> dict[str, Any]:
    return oci.config(s, rootfs=Path("/r"), netns_path="/run/netns/x", cgroups_path="/p/s", **kw)


def rlimit(cfg: dict[str, Any], name: str) -> int:
    (hit,) = [r for r in cfg["process"]["rlimits"] if r["type"] == name]
    assert hit["soft"] == hit["hard"]
    return int(hit["hard"])


def test_limits_follow_the_sandbox_shape() -> None:
    small = config(spec(cpu_count=1, memory_mb=512))
    big = config(spec(cpu_count=4, memory_mb=8192))
    for cfg, cpus, mem in ((small, 1, 512), (big, 4, 8192)):
        res = cfg["linux"]["resources"]
        assert res["cpu"]["quota"] == cpus * res["cpu"]["period"]
        assert res["memory"]["limit"] == mem * 2**20
        assert res["pids"]["limit"] > rlimit(cfg, "RLIMIT_NPROC")
    # A node busy with both splits CPU 1:4, and the bigger one may run more processes.
    assert (
        big["linux"]["resources"]["cpu"]["shares"]
        == 4 * small["linux"]["resources"]["cpu"]["shares"]
    )
    assert rlimit(small, "RLIMIT_NPROC") < rlimit(big, "RLIMIT_NPROC")
    assert rlimit(config(spec(memory_mb=64)), "RLIMIT_NPROC") >= 128  # enough for a shell


def test_tmp_is_bound_from_the_rootfs_only_when_asked() -> None:
    def tmp_mounts(cfg: dict[str, Any]) -> list[dict[str, Any]]:
        return [m for m in cfg["mounts"] if m["destination"] == "/tmp"]

    assert tmp_mounts(config(spec())) == []  # runsc's own tmpfs (the memory overlay's case)
    (bound,) = tmp_mounts(config(spec(), tmp_on_rootfs=True))
    assert bound["source"] == "/r/tmp" and bound["type"] == "bind"
    assert "nosuid" in bound["options"]
    mine = Mount(source=Path("/host/t"), destination="/tmp", readonly=False)
    (kept,) = tmp_mounts(config(spec(mounts=[mine]), tmp_on_rootfs=True))
    assert kept["source"] == "/host/t"  # a mount the caller asked for wins
