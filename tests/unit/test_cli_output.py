"""The listings' one set of output options (`-o table|wide|json|yaml`, `-q`, the hidden
`--json`) and `--watch`, as a user sees them, against the fake control plane (conftest's
`fake` and `cli`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from aenv.cli import watch
from aenv.cli.main import app
from tests.unit.fake_aenv import FakeAenv


def _three(fake: FakeAenv) -> None:
    fake.add("sbx-a", metadata={"team": "alpha"})
    fake.add("sbx-b", state="paused")
    fake.add("sbx-c")


def test_ls_yaml_json_and_quiet(cli: CliRunner, fake: FakeAenv) -> None:
    _three(fake)
    res = cli.invoke(app, ["ls", "-o", "yaml"])
    assert res.exit_code == 0, res.output
    docs = yaml.safe_load(res.stdout)
    assert [d["sandboxID"] for d in docs] == ["sbx-a", "sbx-b", "sbx-c"]
    assert docs[0]["metadata"] == {"team": "alpha"}

    res = cli.invoke(app, ["ls", "--output", "json", "-s", "paused"])
    assert [d["sandboxID"] for d in json.loads(res.stdout)] == ["sbx-b"]

    res = cli.invoke(app, ["ls", "-q"])
    assert res.exit_code == 0 and res.stdout == "sbx-a\nsbx-b\nsbx-c\n"
    res = cli.invoke(app, ["ls", "-q", "-m", "team=alpha"])
    assert res.stdout == "sbx-a\n"


def test_wide_has_more_columns_than_table(cli: CliRunner, fake: FakeAenv) -> None:
    _three(fake)
    table = cli.invoke(app, ["ls", "-o", "table"]).stdout.splitlines()
    wide = cli.invoke(app, ["ls", "-o", "wide"]).stdout.splitlines()
    assert "DISK" not in table[0] and "ENVD" not in table[0]
    assert {"DISK", "ENVD", "ID"} <= set(wide[0].split())
    assert len(wide) == len(table) == 4
    assert "0.6.4" in wide[1] and "0.6.4" not in table[1]


def test_bad_output_format_is_a_usage_error(cli: CliRunner) -> None:
    res = cli.invoke(app, ["ls", "-o", "xml"])
    assert res.exit_code == 2 and "xml" in res.stderr


def test_snapshot_ls_formats_and_the_old_json_flag(cli: CliRunner, fake: FakeAenv) -> None:
    fake.add("sbx-a")
    for name in ("one", "two"):
        assert cli.invoke(app, ["snapshot", "create", "sbx-a", "--name", name]).exit_code == 0
    res = cli.invoke(app, ["snapshot", "ls", "-q"])
    assert res.stdout == "snap1\nsnap2\n"
    # `--json` still works (scripts), but is no longer offered.
    res = cli.invoke(app, ["snapshot", "ls", "--json"])
    assert [s["snapshotID"] for s in json.loads(res.stdout)] == ["snap1", "snap2"]
    assert "--json" not in cli.invoke(app, ["snapshot", "ls", "--help"]).stdout
    res = cli.invoke(app, ["snapshot", "ls", "-o", "yaml"])
    assert yaml.safe_load(res.stdout)[1]["names"] == ["two"]


def test_empty_listing(cli: CliRunner) -> None:
    res = cli.invoke(app, ["ls", "-o", "table"])
    assert res.exit_code == 0 and res.stdout == "" and "no sandboxes" in res.stderr
    assert cli.invoke(app, ["ls", "-q"]).stdout == ""
    assert yaml.safe_load(cli.invoke(app, ["ls", "-o", "yaml"]).stdout) == []


def test_inspect_yaml(cli: CliRunner, fake: FakeAenv) -> None:
    fake.add("sbx-a", cpuCount=4)
    res = cli.invoke(app, ["inspect", "sbx-a", "-o", "yaml"])
    assert res.exit_code == 0, res.output
    doc = yaml.safe_load(res.stdout)
    assert doc["sandboxID"] == "sbx-a" and doc["cpuCount"] == 4


def test_keys_ls_quiet_and_yaml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AENV_HOME", str(tmp_path))
    monkeypatch.setenv("AENV_CONFIG_FILE", str(tmp_path / "none.toml"))
    runner = CliRunner()
    for name in ("ci", "dev"):
        assert runner.invoke(app, ["keys", "create", name]).exit_code == 0
    assert runner.invoke(app, ["keys", "ls", "-q"]).stdout == "ci\ndev\n"
    docs = yaml.safe_load(runner.invoke(app, ["keys", "ls", "-o", "yaml"]).stdout)
    assert [d["name"] for d in docs] == ["ci", "dev"]


def _stepper(monkeypatch: pytest.MonkeyPatch, steps: list[Any]) -> None:
    """Replace the watch's pause: each pause runs the next step; past the last, Ctrl-C."""

    def pause(_seconds: float) -> None:
        if not steps:
            raise KeyboardInterrupt
        steps.pop(0)()

    monkeypatch.setattr(watch, "_sleep", pause)


def test_ls_watch_prints_a_frame_per_change_and_exits_0_on_ctrl_c(
    cli: CliRunner, fake: FakeAenv, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.add("sbx-a")
    _stepper(
        monkeypatch,
        [
            lambda: None,  # no change: no new frame
            lambda: fake.add("sbx-b"),
            lambda: fake.sandboxes["sbx-a"].update(state="paused"),
        ],
    )
    res = cli.invoke(app, ["ls", "-w", "-o", "yaml"])
    assert res.exit_code == 0, res.output
    frames = list(yaml.safe_load_all(res.stdout))
    assert [[d["sandboxID"] for d in f] for f in frames] == [
        ["sbx-a"],
        ["sbx-a", "sbx-b"],
        ["sbx-a", "sbx-b"],
    ]
    assert frames[-1][0]["state"] == "paused"


def test_ls_watch_quiet_tables(
    cli: CliRunner, fake: FakeAenv, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.add("sbx-a")
    _stepper(monkeypatch, [lambda: fake.add("sbx-b")])
    res = cli.invoke(app, ["ls", "--watch", "-q"])
    assert res.exit_code == 0 and res.stdout == "sbx-a\nsbx-a\nsbx-b\n"
    fake.sandboxes.clear()
    _stepper(monkeypatch, [lambda: fake.add("sbx-c")])
    res = cli.invoke(app, ["ls", "-w", "-o", "table"])
    assert res.exit_code == 0
    assert "no sandboxes" in res.stderr and res.stdout.splitlines()[1].startswith("sbx-c")
