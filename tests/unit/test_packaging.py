"""The distribution: a client install (no `server` extra) runs the CLI, the commands that run
node code in-process say in one line that they need the extra, the extra's packages are the
ones the hint names, the version is the installed distribution's, and `aenv bench` runs from
a checkout only (the harness is not in the wheel)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aenv import DISTRIBUTION, __version__
from aenv.cli import bench as bench_cmd
from aenv.cli.errors import SERVER_MODULES
from aenv.cli.main import app
from tests.unit.fake_aenv import _one_error_line

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# Run in a fresh interpreter where the server extra's modules cannot be imported, as in a
# client-only install (a meta path finder refuses them, the way a missing package does), so
# this needs no second venv. Prints what the parent checks, as JSON.
CLIENT_ONLY = r"""
import json, sys
from importlib.machinery import PathFinder

BLOCKED = frozenset(sys.argv[1].split(","))


class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())

import typer
from typer.testing import CliRunner

from aenv.cli.main import app

out = {"loaded": sorted({m.partition(".")[0] for m in sys.modules} & BLOCKED), "help": {}}
runner = CliRunner()


def walk(cmd, path):
    res = runner.invoke(app, [*path, "--help"])
    out["help"][" ".join(path) or "aenv"] = [res.exit_code, res.stderr[-500:]]
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        walk(sub, [*path, name])


walk(typer.main.get_command(app), [])
out["runs"] = {}
for args in (["server"], ["gateway"], ["template", "build-base", "-q"]):
    res = runner.invoke(app, args)
    out["runs"][" ".join(args)] = [res.exit_code, res.stderr]
out["loaded_after"] = sorted({m.partition(".")[0] for m in sys.modules} & BLOCKED)
print(json.dumps(out))
"""


def _extra_modules(extra: str) -> set[str]:
    """The import names of an extra's requirements (`prometheus-client` → prometheus_client)."""
    reqs = PYPROJECT["project"]["optional-dependencies"][extra]
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("-", "_") for r in reqs}


def test_the_cli_runs_without_the_server_extra(tmp_path: Path) -> None:
    env = {"AENV_HOME": str(tmp_path), "AENV_URL": "http://127.0.0.1:9", "PATH": "/usr/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", CLIENT_ONLY, ",".join(sorted(SERVER_MODULES))],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    # Importing the CLI loads none of them, and every command's --help works.
    assert out["loaded"] == []
    assert len(out["help"]) > 40, out["help"].keys()
    assert {path: r for path, r in out["help"].items() if r[0] != 0} == {}
    # The in-process commands fail in one line that names the extra; nothing half-ran.
    for args, (code, stderr) in out["runs"].items():
        assert code == 1, (args, stderr)
        line = _one_error_line(stderr)
        assert f"pip install '{DISTRIBUTION}[server]'" in line, (args, line)
    assert out["loaded_after"] == []


def test_the_hint_names_the_modules_of_the_server_extra() -> None:
    # starlette is fastapi's; every other entry is one requirement of the extra.
    assert SERVER_MODULES - _extra_modules("server") == {"starlette"}
    assert _extra_modules("server") <= SERVER_MODULES
    # And the client install brings none of them.
    base = {
        re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("-", "_")
        for r in PYPROJECT["project"]["dependencies"]
    }
    assert base & SERVER_MODULES == set()
    # The test extra installs the server: a fresh clone's `pip install -e '.[test]'` runs all.
    assert f"{DISTRIBUTION}[server]" in PYPROJECT["project"]["optional-dependencies"]["test"]


def test_the_version_is_the_installed_distributions() -> None:
    assert PYPROJECT["project"]["name"] == DISTRIBUTION
    assert __version__ == version(DISTRIBUTION)
    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0 and res.stdout == f"aenv {__version__}\n"


def test_bench_is_found_in_a_checkout_only(tmp_path: Path) -> None:
    assert bench_cmd.checkout_with_bench() == ROOT  # beside src/ (an editable install)
    assert bench_cmd.checkout_with_bench((tmp_path, ROOT)) == ROOT
    assert bench_cmd.checkout_with_bench((tmp_path,)) is None


def test_bench_outside_a_checkout_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_cmd, "checkout_with_bench", lambda candidates=None: None)
    res = CliRunner().invoke(app, ["bench", "--quick"])
    assert res.exit_code == 1
    assert "runs from a checkout" in _one_error_line(res.stderr)
    # Its options are the CLI's own, so the help works anywhere.
    res = CliRunner().invoke(app, ["bench", "--help"])
    assert res.exit_code == 0 and "--quick" in res.stdout
