"""`aenv rm --all -m`, `aenv pause --all -m` (one bulk call by metadata, routes/bulk.py) and
`aenv tree ID` (a lineage drawn), against the fake control plane."""

from __future__ import annotations

import json
from urllib.parse import parse_qs, urlsplit

from typer.testing import CliRunner

from aenv.cli.main import app
from tests.unit.fake_aenv import FakeAenv, _one_error_line


def _query(path: str) -> dict[str, list[str]]:
    return parse_qs(urlsplit(path).query)


def test_rm_all_by_metadata(cli: CliRunner, fake: FakeAenv) -> None:
    fake.add("sbx-a", metadata={"run": "r1", "team": "ml"})
    fake.add("sbx-b", metadata={"run": "r1", "team": "ml"}, state="paused")
    fake.add("sbx-c", metadata={"run": "r1"})
    fake.add("sbx-d", metadata={"run": "r2", "team": "ml"})
    res = cli.invoke(app, ["rm", "--all", "-m", "run=r1", "-m", "team=ml"])
    assert res.exit_code == 0, res.stderr
    assert res.stdout.split() == ["sbx-a", "sbx-b"]
    assert set(fake.sandboxes) == {"sbx-c", "sbx-d"}
    method, path, _, _ = fake.requests[-1]
    assert method == "DELETE" and urlsplit(path).path == "/sandboxes"
    assert parse_qs(_query(path)["metadata"][0]) == {"run": ["r1"], "team": ["ml"]}
    assert len(fake.requests) == 1  # one call, not a listing and a kill each


def test_pause_all_by_metadata(cli: CliRunner, fake: FakeAenv) -> None:
    fake.add("sbx-a", metadata={"run": "r1"})
    fake.add("sbx-b", metadata={"run": "r1", "stuck": "yes"})
    fake.add("sbx-c", metadata={"run": "r2"})
    res = cli.invoke(app, ["pause", "--all", "--metadata", "run=r1"])
    assert res.exit_code == 1  # one could not be paused
    assert res.stdout.split() == ["sbx-a"]
    assert _one_error_line(res.stderr) == "aenv: sbx-b: would not pause"
    assert [s["state"] for s in fake.sandboxes.values()] == ["paused", "running", "running"]


def test_all_needs_a_query_and_no_ids(cli: CliRunner, fake: FakeAenv) -> None:
    fake.add("sbx-a", metadata={"run": "r1"})
    for args in (
        ["rm", "--all"],
        ["pause", "--all"],
        ["rm", "--all", "-m", "run=r1", "sbx-a"],
        ["rm", "-m", "run=r1"],
        ["rm"],
        ["pause"],
    ):
        res = cli.invoke(app, args)
        assert res.exit_code == 2, args  # a usage error
        assert _one_error_line(res.stderr).startswith("aenv: "), args
    assert fake.requests == [] and set(fake.sandboxes) == {"sbx-a"}


_TREE = {
    "sandboxID": "sbx-b",
    "lineage": {"templateID": "base", "parentID": "sbx-a", "forkPoint": "ifork1"},
    "ancestors": [{"sandboxID": "sbx-a", "state": "running", "lineage": {"templateID": "base"}}],
    "descendants": [
        {
            "sandboxID": "sbx-c",
            "state": "paused",
            "lineage": {"templateID": "base", "parentID": "sbx-b"},
            "children": [
                {
                    "sandboxID": "sbx-e",
                    "state": "running",
                    "lineage": {"templateID": "base", "snapshotID": "snap1", "snapshotOf": "sbx-c"},
                }
            ],
        },
        {"sandboxID": "sbx-d", "state": "running", "lineage": {"parentID": "sbx-b"}},
    ],
}


def test_tree(cli: CliRunner, fake: FakeAenv) -> None:
    fake.add("sbx-b")
    fake.lineages["sbx-b"] = _TREE
    res = cli.invoke(app, ["tree", "sbx-b"])
    assert res.exit_code == 0, res.stderr
    assert res.stdout.splitlines() == [
        "base",
        "└─ sbx-a  (running)",
        "   └─ sbx-b  (this)  fork  <-",
        "      ├─ sbx-c  (paused)  fork",
        "      │  └─ sbx-e  (running)  snapshot snap1",
        "      └─ sbx-d  (running)  fork",
    ]
    res = cli.invoke(app, ["tree", "sbx-b", "-o", "json"])
    assert json.loads(res.stdout) == _TREE
    res = cli.invoke(app, ["tree", "nope"])
    assert res.exit_code == 1 and "not found" in _one_error_line(res.stderr)


def test_timeout_one_or_all(cli: CliRunner, fake: FakeAenv) -> None:
    fake.add("sbx-a", metadata={"run": "r1"})
    fake.add("sbx-b", metadata={"run": "r2"})
    res = cli.invoke(app, ["timeout", "sbx-a", "30"])
    assert res.exit_code == 0 and res.stdout.strip() == "sbx-a"
    method, path, _, body = fake.requests[-1]
    assert (method, path, json.loads(body)) == ("POST", "/sandboxes/sbx-a/timeout", {"timeout": 30})
    res = cli.invoke(app, ["timeout", "--all", "-m", "run=r1", "600"])
    assert res.exit_code == 0 and res.stdout.split() == ["sbx-a"]
    method, path, _, body = fake.requests[-1]
    assert (method, urlsplit(path).path) == ("POST", "/sandboxes/timeout")
    assert parse_qs(_query(path)["metadata"][0]) == {"run": ["r1"]}
    assert json.loads(body) == {"timeout": 600}
    sent = len(fake.requests)
    for args in (
        ["timeout", "sbx-a"],
        ["timeout", "sbx-a", "x"],
        ["timeout", "--all", "600"],
        ["timeout", "--all", "-m", "run=r1", "sbx-a", "600"],
        ["timeout", "a", "b", "600"],
    ):
        res = cli.invoke(app, args)
        assert res.exit_code == 2, args
        _one_error_line(res.stderr)
    assert len(fake.requests) == sent
