"""The runtime backend a node runs, chosen by `AENV_RUNTIME`: one entry per backend, so a
new backend is its package plus a line here (and its name in `Settings.runtime`)."""

from __future__ import annotations

from collections.abc import Callable

from ..config import Settings
from .base import Runtime
from .fake import FakeRuntime
from .gvisor import GVisorRuntime
from .qemu import QemuRuntime

BACKENDS: dict[str, Callable[[Settings], Runtime]] = {
    "gvisor": GVisorRuntime,
    "qemu": QemuRuntime,
    "fake": lambda _settings: FakeRuntime(),
}


def make_runtime(settings: Settings) -> Runtime:
    return BACKENDS[settings.runtime](settings)
