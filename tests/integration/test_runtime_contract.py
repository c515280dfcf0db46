"""The runtime contract against gVisor: real runsc, slots, overlays (busybox sandboxes, set up
as in gvisor_env.py). Own net prefixes and homes; every trace is removed at the end."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from aenv.config import Settings
from aenv.runtime.base import Instance, Runtime
from aenv.runtime.gvisor import GVisorRuntime
from tests import netplan
from tests.contract.runtime_contract import RuntimeContract, Specs

from .gvisor_env import INIT, assert_no_traces, crash, make_rootfs, make_settings, started_runtime
from .gvisor_net import wait_http

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("runsc") is None or not Path("/bin/busybox").exists(),
        reason="needs root, runsc and busybox-static",
    ),
]

PREFIX, CIDR = netplan.slot_net("rco").prefix, netplan.slot_net("rco").cidr
RESTART_PREFIX, RESTART_CIDR = netplan.slot_net("rcr").prefix, netplan.slot_net("rcr").cidr


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_rootfs(tmp_path_factory.mktemp("contract-layer"))


@pytest.fixture
def specs(rootfs: Path, tmp_path: Path) -> Specs:
    return Specs(layers=[rootfs], args=INIT, uppers=tmp_path / "uppers")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runtime(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GVisorRuntime]:
    async with started_runtime(tmp_path_factory.mktemp("contract-home"), PREFIX, CIDR) as rt:
        yield rt


class GVisorRuntimes:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.used = False

    def new(self) -> Runtime:
        self.used = True
        return GVisorRuntime(self.settings)

    async def crash(self, rt: Runtime) -> None:
        assert isinstance(rt, GVisorRuntime)
        crash(rt)


@pytest_asyncio.fixture(loop_scope="module")
async def runtimes(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GVisorRuntimes]:
    settings = make_settings(
        tmp_path_factory.mktemp("contract-home-rs"), RESTART_PREFIX, RESTART_CIDR, pool=1
    )
    made = GVisorRuntimes(settings)
    yield made
    if made.used:
        await GVisorRuntime(settings).purge()
        assert_no_traces(settings)


class TestGVisorRuntime(RuntimeContract):
    async def ready(self, runtime: Runtime, inst: Instance) -> None:
        await wait_http(inst)
