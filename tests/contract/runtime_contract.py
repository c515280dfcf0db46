"""The contract of `aenv.runtime.base.Runtime`, as the orchestrator relies on it.

`RuntimeContract` holds the tests; a backend's test module subclasses it (as `Test...`) and
provides three fixtures:

* `runtime`: a started runtime the tests share (each test destroys what it made);
* `specs`: a `Specs`, making specs whose init process keeps running;
* `runtimes`: a `Runtimes`, for the restart test: unstarted runtimes over a host of the test's
  own, and a way to drop one as a killed server would.

and may override `ready` (wait until a sandbox's init serves, so a checkpoint catches it up and
running). Only the handle's `sandbox_id`, `id` and `address` are read here, as the orchestrator
does; handles pass through JSON (`dataclasses.asdict`) as the catalog stores them.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import pytest

from aenv.domain import EgressPolicy
from aenv.errors import RuntimeFailure
from aenv.runtime.base import Instance, Runtime, SandboxSpec


@dataclass
class Specs:
    """Makes sandbox specs over fixed layers, with a fresh upper dir when asked."""

    layers: list[Path]
    args: list[str]
    # Where upper dirs are made.
    uppers: Path
    memory_mb: int = 256
    made: list[Path] = field(default_factory=list)

    def __call__(
        self,
        sandbox_id: str,
        *,
        upper: bool = False,
        over: list[Path] | None = None,
        egress: EgressPolicy | None = None,
    ) -> SandboxSpec:
        """`over`: layers put on top of the fixed ones (e.g. a sealed upper)."""
        spec = SandboxSpec(
            sandbox_id=sandbox_id,
            layers=[*(over or []), *self.layers],
            args=list(self.args),
            memory_mb=self.memory_mb,
            cpu_count=1,
            egress=egress,
        )
        if upper:
            spec.upper = self.uppers / f"upper-{sandbox_id}-{secrets.token_hex(3)}"
            spec.upper.mkdir(parents=True)
            self.made.append(spec.upper)
        return spec


class Runtimes(Protocol):
    def new(self) -> Runtime:
        """An unstarted runtime over this test's own host (every call shares that host)."""
        ...

    async def crash(self, rt: Runtime) -> None:
        """Drops `rt` as a killed server process would: no cleanup, its sandboxes go on."""
        ...


def stored(inst: Instance) -> Instance:
    """The handle as the catalog gives it back."""
    return Instance(**json.loads(json.dumps(dataclasses.asdict(inst))))


class RuntimeContract:
    async def ready(self, runtime: Runtime, inst: Instance) -> None:
        """Waits until the sandbox's init process serves (backends with real processes)."""

    async def test_create_gives_a_running_instance(self, runtime: Runtime, specs: Specs) -> None:
        a = await runtime.create(specs("ct-a"))
        b = await runtime.create(specs("ct-b", upper=True))
        try:
            assert (a.sandbox_id, b.sandbox_id) == ("ct-a", "ct-b")
            assert a.id and b.id and a.id != b.id
            assert a.address and b.address and a.address != b.address
            for inst in (a, b):
                assert await runtime.alive(inst) and not runtime.is_stopped(inst)
                # What the catalog stored works as well as the handle itself.
                assert await runtime.alive(stored(inst))
            await self.ready(runtime, a)
            stats = await runtime.stats(a)
            assert stats.mem_total_bytes > 0 and 0 <= stats.cpu_used_pct <= 100
        finally:
            await runtime.destroy(a)
            await runtime.destroy(b)
        assert not await runtime.alive(a) and not await runtime.alive(b)

    async def test_freeze_and_thaw(self, runtime: Runtime, specs: Specs) -> None:
        inst = await runtime.create(specs("ct-frz"))
        try:
            await self.ready(runtime, inst)
            await runtime.freeze(inst)
            # Frozen is still there: memory kept, nothing to restore.
            assert await runtime.alive(inst) and not runtime.is_stopped(inst)
            await runtime.thaw(inst)
            assert await runtime.alive(inst)
            await self.ready(runtime, inst)
        finally:
            await runtime.destroy(inst)

    async def test_checkpoint_leaving_it_running_and_restore_a_new_one(
        self, runtime: Runtime, specs: Specs, tmp_path: Path
    ) -> None:
        image = tmp_path / "img-lr"
        assert not runtime.image_complete(image)
        parent = await runtime.create(specs("ct-par"))
        child: Instance | None = None
        try:
            await self.ready(runtime, parent)
            await runtime.checkpoint(parent, image, leave_running=True)
            assert runtime.image_complete(image)
            assert await runtime.alive(parent)
            child = await runtime.restore(specs("ct-kid"), image)
            assert child.sandbox_id == "ct-kid"
            assert (child.id, child.address) != (parent.id, parent.address)
            assert child.address != parent.address
            assert await runtime.alive(child) and await runtime.alive(parent)
            await self.ready(runtime, child)
        finally:
            await runtime.destroy(parent)
            if child is not None:
                await runtime.destroy(child)

    async def test_hibernate_then_restore_into_the_same_slot(
        self, runtime: Runtime, specs: Specs, tmp_path: Path
    ) -> None:
        """checkpoint (not leaving it running), stop, restore with `reuse`: same address."""
        image = tmp_path / "img-hib"
        first = specs("ct-hib", upper=True)
        inst = await runtime.create(first)
        again: Instance | None = None
        try:
            await self.ready(runtime, inst)
            await runtime.checkpoint(inst, image, leave_running=False)
            assert runtime.image_complete(image)
            assert not await runtime.alive(inst)
            await runtime.stop(inst)
            assert runtime.is_stopped(inst) and not await runtime.alive(inst)
            await runtime.stop(inst)  # stopping a stopped instance changes nothing
            assert runtime.is_stopped(inst)
            assert first.upper is not None
            # The caller may now use the old upper as a read-only layer (a seal).
            again = await runtime.restore(
                specs("ct-hib", upper=True, over=[first.upper]), image, reuse=stored(inst)
            )
            assert again.address == inst.address
            assert await runtime.alive(again) and not runtime.is_stopped(again)
            await self.ready(runtime, again)
        finally:
            await runtime.destroy(again if again is not None else inst)

    async def test_stop_a_running_one_then_boot_it_again(
        self, runtime: Runtime, specs: Specs
    ) -> None:
        first = specs("ct-stp", upper=True)
        inst = await runtime.create(first)
        again: Instance | None = None
        try:
            await self.ready(runtime, inst)
            await runtime.stop(inst)
            assert runtime.is_stopped(inst) and not await runtime.alive(inst)
            again = await runtime.create(specs("ct-stp", upper=True), reuse=inst)
            assert again.address == inst.address
            assert await runtime.alive(again)
            await self.ready(runtime, again)
        finally:
            await runtime.destroy(again if again is not None else inst)

    async def test_egress_rules_follow_the_sandbox_through_its_states(
        self, runtime: Runtime, specs: Specs, tmp_path: Path
    ) -> None:
        """set_egress on a running, frozen and stopped instance; specs with rules create and
        restore (new slot, own slot); the node still reaches a sandbox with no internet."""
        closed = EgressPolicy(allow_internet=False, allow_out=["203.0.113.10"])
        some = EgressPolicy(deny_out=["198.51.100.0/24", "192.0.2.7"])
        inst = await runtime.create(specs("ct-egr", egress=closed))
        child: Instance | None = None
        again: Instance | None = None
        try:
            await self.ready(runtime, inst)
            await runtime.set_egress(inst, some)
            await runtime.freeze(inst)
            await runtime.set_egress(stored(inst), closed)
            await runtime.thaw(inst)
            await self.ready(runtime, inst)
            await runtime.checkpoint(inst, tmp_path / "img-egr-lr", leave_running=True)
            child = await runtime.restore(specs("ct-egk", egress=some), tmp_path / "img-egr-lr")
            await self.ready(runtime, child)
            await runtime.set_egress(child, EgressPolicy())  # open: no rules left
            await runtime.checkpoint(inst, tmp_path / "img-egr", leave_running=False)
            await runtime.stop(inst)
            await runtime.set_egress(inst, some)
            again = await runtime.restore(
                specs("ct-egr", egress=closed), tmp_path / "img-egr", reuse=stored(inst)
            )
            await self.ready(runtime, again)
            await runtime.set_egress(again, some)
        finally:
            if child is not None:
                await runtime.destroy(child)
            await runtime.destroy(again if again is not None else inst)
        for gone in (again, child):
            assert gone is not None
            with pytest.raises(RuntimeFailure):
                await runtime.set_egress(gone, EgressPolicy())

    async def test_destroy_is_idempotent(self, runtime: Runtime, specs: Specs) -> None:
        running = await runtime.create(specs("ct-dr"))
        stopped = await runtime.create(specs("ct-ds", upper=True))
        await runtime.stop(stopped)
        for inst in (running, stopped):
            await runtime.destroy(inst)
            await runtime.destroy(inst)
            await runtime.destroy(stored(inst))
            assert not await runtime.alive(inst)
        # A destroyed instance cannot be brought back into its slot.
        with pytest.raises(RuntimeFailure):
            await runtime.create(specs("ct-ds", upper=True), reuse=stopped)

    async def test_bad_input_is_refused(
        self, runtime: Runtime, specs: Specs, tmp_path: Path
    ) -> None:
        for bad_id in ("", "../up", "a b", "-dash"):
            with pytest.raises(RuntimeFailure):
                await runtime.create(specs(bad_id))
        missing = specs("ct-nou")
        missing.upper = tmp_path / "no-such-upper"
        with pytest.raises(RuntimeFailure):
            await runtime.create(missing)
        empty = tmp_path / "empty-image"
        empty.mkdir()
        for image in (tmp_path / "no-such-image", empty):
            assert not runtime.image_complete(image)
            with pytest.raises(RuntimeFailure):
                await runtime.restore(specs("ct-noi"), image)
        inst = await runtime.create(specs("ct-bad", upper=True))
        try:
            # `reuse` takes only a stopped instance, of the same sandbox.
            with pytest.raises(RuntimeFailure):
                await runtime.create(specs("ct-bad", upper=True), reuse=inst)
            assert await runtime.alive(inst)
            await runtime.stop(inst)
            with pytest.raises(RuntimeFailure):
                await runtime.create(specs("ct-other", upper=True), reuse=inst)
            # A stopped instance has no processes to freeze or checkpoint.
            with pytest.raises(RuntimeFailure):
                await runtime.freeze(inst)
            with pytest.raises(RuntimeFailure):
                await runtime.checkpoint(inst, tmp_path / "img-bad", leave_running=True)
            assert runtime.is_stopped(inst)
        finally:
            await runtime.destroy(inst)

    async def test_restart_recovers_what_is_kept(
        self, runtimes: Runtimes, specs: Specs, tmp_path: Path
    ) -> None:
        rt1 = runtimes.new()
        await rt1.start(set())
        kept = await rt1.create(specs("ct-keep", upper=True))
        dropped = await rt1.create(specs("ct-drop"))
        hibernated = await rt1.create(specs("ct-hold", upper=True))
        for inst in (kept, dropped, hibernated):
            await self.ready(rt1, inst)
        await rt1.checkpoint(hibernated, tmp_path / "img-rs", leave_running=False)
        await rt1.stop(hibernated)
        await runtimes.crash(rt1)

        rt2 = runtimes.new()
        recovered = await rt2.start({kept.id, hibernated.id, "ghost-00000000"})
        assert set(recovered) == {kept.id, hibernated.id}
        back, held = recovered[kept.id], recovered[hibernated.id]
        assert (back.sandbox_id, back.address) == (kept.sandbox_id, kept.address)
        assert await rt2.alive(back) and not rt2.is_stopped(back)
        await self.ready(rt2, back)
        assert rt2.is_stopped(held) and not await rt2.alive(held)
        assert not await rt2.alive(dropped)
        # The stopped one still holds its slot: restored at its own address.
        again = await rt2.restore(specs("ct-hold", upper=True), tmp_path / "img-rs", reuse=held)
        assert again.address == hibernated.address
        await self.ready(rt2, again)
        await rt2.destroy(back)
        await rt2.destroy(again)
        await rt2.destroy(dropped)  # not its own: still harmless
        await rt2.close()

        # With nothing kept, nothing comes back.
        await runtimes.crash(rt2)
        rt3 = runtimes.new()
        assert await rt3.start(set()) == {}
        await rt3.close()
