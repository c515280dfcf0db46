"""`aenv cp`'s transfers (`cli/copy.py`) over the one envd client against a real envd on
loopback (`python -m aenv.envd`): a tree up and back with its modes, one file to stdout,
and a missing source as one line."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from aenv.cli.connect import run_with
from aenv.cli.copy import LocalPath, Remote, download, upload
from aenv.cli.errors import CliError
from aenv.envd_client import EnvdClient, EnvdTarget


@pytest.fixture(scope="module")
def envd_url(envd_launcher: Callable[..., str]) -> str:
    return envd_launcher()


def _client(url: str) -> EnvdClient:
    host, _, port = url.removeprefix("http://").partition(":")
    return EnvdClient(EnvdTarget.direct(host, port=int(port)))


def test_a_tree_goes_up_and_comes_back_with_its_modes(envd_url: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"A" * 100_000)
    (src / "sub" / "run.sh").write_text("#!/bin/sh\n")
    (src / "sub" / "run.sh").chmod(0o750)
    (src / "b").write_text("b")
    remote = tmp_path / "remote"  # "in the sandbox": envd runs on this host
    remote.mkdir()

    async def up(envd: EnvdClient) -> str:
        return await upload(envd, str(src), Remote("sbx", f"{remote}/"), LocalPath.of(str(src)))

    assert run_with(_client(envd_url), up) == f"{remote}/src"
    assert (remote / "src" / "a.txt").read_bytes() == b"A" * 100_000
    assert (remote / "src" / "sub" / "run.sh").stat().st_mode & 0o777 == 0o750

    back = tmp_path / "back"
    written = run_with(
        _client(envd_url),
        lambda envd: download(
            envd, Remote("sbx", f"{remote}/src"), str(back), LocalPath.of(str(back))
        ),
    )
    assert written == back
    assert sorted(str(p.relative_to(back)) for p in back.rglob("*")) == [
        "a.txt",
        "b",
        "sub",
        "sub/run.sh",
    ]
    assert (back / "a.txt").read_bytes() == b"A" * 100_000
    assert os.stat(back / "sub" / "run.sh").st_mode & 0o777 == 0o750


def test_a_missing_source_is_one_line(envd_url: str, tmp_path: Path) -> None:
    with pytest.raises(CliError) as exc:
        run_with(
            _client(envd_url),
            lambda envd: download(
                envd, Remote("sbx", str(tmp_path / "nope")), "-", LocalPath.of("-")
            ),
        )
    assert exc.value.message == f"sbx:{tmp_path}/nope: no such file or directory"
