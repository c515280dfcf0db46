"""Which layers of a sandbox's stack get squashed, and how the stack changes."""

from __future__ import annotations

from aenv.orchestrator.squashing import MOUNT_LIMIT, replace_run, run_to_squash


def stack(n: int) -> list[str]:
    return [f"l{i}" for i in range(n)]  # topmost first


def test_short_stacks_are_left_alone() -> None:
    assert run_to_squash(stack(16), 16) is None
    assert run_to_squash(stack(1), 1) is None


def test_long_stack_goes_back_to_half_the_limit() -> None:
    layers = stack(17)
    run = run_to_squash(layers, 16)
    assert run == layers[:9]  # the newest layers; the 8 at the bottom stay
    new = replace_run(layers, run, "m")
    assert new == ["m", *layers[9:]] and len(new) == 9


def test_off_still_keeps_stacks_mountable() -> None:
    assert run_to_squash(stack(MOUNT_LIMIT), 0) is None
    run = run_to_squash(stack(MOUNT_LIMIT + 1), 0)
    assert run is not None and len(stack(MOUNT_LIMIT + 1)) - len(run) + 1 <= MOUNT_LIMIT
    # A limit above what a mount takes is capped.
    assert run_to_squash(stack(MOUNT_LIMIT + 1), 1000) is not None


def test_replace_run_after_more_layers_were_added() -> None:
    layers = stack(10)
    run = layers[:5]
    later = ["new1", "new0", *layers]  # two snapshots happened while the merge ran
    assert replace_run(later, run, "m") == ["new1", "new0", "m", *layers[5:]]
    assert replace_run(["x", *layers[3:]], run, "m") is None  # the run is gone
