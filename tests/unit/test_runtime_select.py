"""`AENV_RUNTIME` picks the backend: every name Settings accepts has a backend, and a name
it does not know is a clear error at start-up."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from pydantic import ValidationError

from aenv.config import Settings
from aenv.runtime.fake import FakeRuntime
from aenv.runtime.gvisor import GVisorRuntime
from aenv.runtime.select import BACKENDS, make_runtime


def test_every_name_settings_accept_has_a_backend() -> None:
    names = typing.get_args(Settings.model_fields["runtime"].annotation)
    assert set(names) == set(BACKENDS)


def test_the_setting_picks_the_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(make_runtime(Settings(home=tmp_path)), GVisorRuntime)
    monkeypatch.setenv("AENV_RUNTIME", "fake")
    assert isinstance(make_runtime(Settings(home=tmp_path)), FakeRuntime)


def test_an_unknown_backend_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="runtime"):
        Settings(home=tmp_path, runtime="firecracker")  # type: ignore[arg-type]
