"""Bad input through the stock E2B SDK against a real node: what would break a sandbox is
refused with a clear error and the sandbox keeps working; the files API never reaches the
host, whatever the path or symlink."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from e2b import NotFoundException, Sandbox
from e2b.exceptions import InvalidArgumentException, SandboxException


@pytest.fixture
def sbx(sandboxes: list[object]) -> Sandbox:
    s = Sandbox.create(envs={"KEEP": "1"}, metadata={"suite": "bad-input"})
    sandboxes.append(s)
    return s


def test_create_refuses_env_and_metadata_that_would_break_it(sandboxes: list[object]) -> None:
    for envs in ({"A=B": "x"}, {"A": "x\0y"}, {"BIG": "x" * (40 << 10)}):
        with pytest.raises(SandboxException, match="envVars"):
            sandboxes.append(Sandbox.create(envs=envs))
    with pytest.raises(SandboxException, match="metadata"):
        sandboxes.append(Sandbox.create(metadata={"k": "x" * (8 << 10)}))
    assert sandboxes == []


def test_commands_with_bad_env_are_refused_and_the_sandbox_lives(sbx: Sandbox) -> None:
    for envs in ({"A=B": "x"}, {"A": "x\0y"}, {"BIG": "x" * (1 << 20)}):
        with pytest.raises(InvalidArgumentException):
            sbx.commands.run("echo ran", envs=envs)
    assert sbx.commands.run("echo $KEEP").stdout == "1\n"


def test_files_api_stays_inside_the_sandbox(sbx: Sandbox) -> None:
    host_dir = Path(tempfile.mkdtemp(prefix="aenv-host-only-"))
    try:
        marker = host_dir / "secret"
        marker.write_text("host secret")
        sbx.commands.run(f"ln -s {marker} ~/to-host && ln -s {host_dir} ~/to-host-dir")
        # Reading through a symlink or `..` resolves in the sandbox, where the path is absent.
        for path in ("/home/user/to-host", f"../../../../..{marker}", str(marker)):
            with pytest.raises(NotFoundException):
                sbx.files.read(path)
        # Writing through them writes the sandbox's files; the host's stay as they were.
        sbx.files.write(f"../../../..{marker}", "planted")
        sbx.files.write("/home/user/to-host-dir/planted", "planted")
        sbx.files.write("/home/user/to-host", "overwritten")
        assert marker.read_text() == "host secret"
        assert sorted(p.name for p in host_dir.iterdir()) == ["secret"]
        assert sbx.files.read(str(marker)) == "overwritten"
        assert sbx.files.read(str(host_dir / "planted")) == "planted"
    finally:
        marker.unlink(missing_ok=True)
        host_dir.rmdir()
