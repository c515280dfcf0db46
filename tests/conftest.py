"""Settings shared by every test suite.

The CLI reads stored credentials from `$XDG_CONFIG_HOME/aenv/credentials` before the node's
own defaults: the suite gets a config directory of its own, so a developer's (or a
machine's) `aenv auth` never points a test's CLI at another server.

Under `make test` (AENV_STRICT_SKIPS=1) a test may skip only for a reason in `OPT_IN`: any
other skip means the machine lacks what `make install` provides, and the run fails on it
rather than pass having checked less."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from hypothesis import settings

os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="aenv-test-config-")
atexit.register(functools.partial(shutil.rmtree, os.environ["XDG_CONFIG_HOME"], True))
# No node of the tests builds code-interpreter-v1 at its start (minutes of CPU each): the
# tests that use it build it, or ask for the build themselves (AENV_..._AUTOBUILD=1).
os.environ["AENV_CODE_INTERPRETER_AUTOBUILD"] = "0"

# Property tests check what is generated, not how fast: on a loaded 2-core machine one
# example can take 10x its usual time, and a per-example deadline then fails a correct test.
settings.register_profile("aenv", deadline=None)
settings.load_profile("aenv")

# Skips that are choices, not missing dependencies: opt-in timings, what a newer Python does.
OPT_IN = ("AENV_RUNTIME_BENCH=1", "3.12 does it already")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    if os.environ.get("AENV_STRICT_SKIPS") != "1":
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not any(opt in reason for opt in OPT_IN):
        report.outcome = "failed"
        report.longrepr = f"skipped where `make test` must run it ({reason})"
