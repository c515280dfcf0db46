"""The stock `e2b-code-interpreter` SDK against template `code-interpreter-v1` on a real
server: the template is built by the project's own command (its packages layer is cached
machine-wide like base's rootfs, so only the first run on a machine installs packages)."""

from __future__ import annotations

import base64
import subprocess
from collections.abc import Iterator

import pytest
from e2b import NotFoundException, TimeoutException
from e2b_code_interpreter import OutputMessage, Sandbox

from tests.integration.conftest import AENV, Server

pytestmark = pytest.mark.integration

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def ci_template(e2b_env: Server) -> Server:
    subprocess.run(
        [AENV, "template", "build-code-interpreter", "--quiet"],
        env=e2b_env.env,
        check=True,
        timeout=1200,
    )
    return e2b_env


@pytest.fixture(scope="module")
def sbx(ci_template: Server) -> Iterator[Sandbox]:
    s = Sandbox.create(timeout=300, envs={"GREETING": "hello"})  # the SDK's default template
    try:
        yield s
    finally:
        s.kill()


def test_default_template_state_and_streams(sbx: Sandbox) -> None:
    assert sbx.get_info().template_id
    out: list[OutputMessage] = []
    err: list[OutputMessage] = []
    first = sbx.run_code(
        "import sys\nx = 40\nprint('to stdout')\nprint('to stderr', file=sys.stderr)",
        on_stdout=out.append,
        on_stderr=err.append,
    )
    assert first.error is None
    assert [m.line for m in out] == ["to stdout\n"]
    assert [m.line for m in err] == ["to stderr\n"]
    assert err[0].error and not out[0].error
    assert "".join(first.logs.stdout) == "to stdout\n"
    # State kept between calls; the last expression is the main result.
    second = sbx.run_code("x + 2")
    assert second.text == "42"
    assert second.execution_count == (first.execution_count or 0) + 1
    # The sandbox's own variables, and per-run ones that do not stay.
    assert sbx.run_code("import os; os.environ['GREETING']").text == "hello"
    assert sbx.run_code("os.environ.get('ONCE')", envs={"ONCE": "yes"}).text == "yes"
    assert sbx.run_code("os.environ.get('ONCE', 'gone')").text == "gone"


def test_error_name_value_traceback(sbx: Sandbox) -> None:
    ex = sbx.run_code("def f():\n    return undefined_name\nf()")
    assert ex.error is not None
    assert ex.error.name == "NameError"
    assert "undefined_name" in ex.error.value
    assert "f()" in ex.error.traceback and "NameError" in ex.error.traceback
    # The context goes on after an error.
    assert sbx.run_code("x").text == "40"


def test_rich_results_html_and_matplotlib_png(sbx: Sandbox) -> None:
    html = sbx.run_code("from IPython.display import HTML\nHTML('<b>bold</b>')")
    assert html.results[0].html == "<b>bold</b>"
    chart = sbx.run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [3, 1, 2])\n"
        "plt.title('chart')\n"
        "plt.show()"
    )
    assert chart.error is None
    png = chart.results[0].png
    assert png, chart.results
    raw = base64.b64decode(png)
    assert raw.startswith(PNG_MAGIC)
    assert len(raw) > 1000


def test_bash_and_contexts(sbx: Sandbox) -> None:
    # The default bash context keeps its shell state.
    sbx.run_code("COUNT=3; cd /tmp", language="bash")
    ex = sbx.run_code("echo count=$COUNT; pwd", language="bash")
    assert "".join(ex.logs.stdout) == "count=3\n/tmp\n"
    assert ex.execution_count == 2
    # The sandbox's own variables in a bash context too.
    assert "".join(sbx.run_code("echo $GREETING", language="bash").logs.stdout) == "hello\n"
    failed = sbx.run_code(
        "echo oops >&2; exit_code_of() { return 4; }; exit_code_of", language="bash"
    )
    assert "".join(failed.logs.stderr) == "oops\n"
    assert failed.error is not None and failed.error.value == "4"

    ctx = sbx.create_code_context(language="bash", cwd="/home/user")
    assert ctx.language == "bash" and ctx.cwd == "/home/user"
    sbx.run_code("MINE=only-here", context=ctx)
    mine = sbx.run_code("echo ${MINE:-unset} ${COUNT:-unset}", context=ctx)
    assert "".join(mine.logs.stdout) == "only-here unset\n"
    assert ctx.id in [c.id for c in sbx.list_code_contexts()]
    sbx.restart_code_context(ctx)
    fresh = sbx.run_code("echo ${MINE:-unset}", context=ctx)
    assert "".join(fresh.logs.stdout) == "unset\n"
    sbx.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]
    with pytest.raises(NotFoundException):
        sbx.run_code("echo hi", context=ctx)

    # A python context of its own: its variables are not the default context's.
    py = sbx.create_code_context()
    assert py.language == "python"
    assert sbx.run_code("'x' in globals()", context=py).text == "False"
    sbx.run_code("y = 5", context=py)
    sbx.restart_code_context(py)
    assert sbx.run_code("'y' in globals()", context=py).text == "False"
    sbx.remove_code_context(py)


def test_a_timed_out_run_is_stopped(sbx: Sandbox) -> None:
    sbx.run_code("before = 'kept'")
    with pytest.raises(TimeoutException):
        sbx.run_code("import time\ntime.sleep(600)", timeout=3)
    # The kernel was interrupted (not left sleeping with the context locked); state stays.
    assert sbx.run_code("before").text == "kept"


def test_state_survives_pause_resume_and_fork(ci_template: Server) -> None:
    s = Sandbox.create(timeout=300)
    children: list[Sandbox] = []
    try:
        s.run_code("kept = [1, 2, 3]")
        assert s.pause()
        s = Sandbox.connect(s.sandbox_id)
        assert s.run_code("kept + [4]").text == "[1, 2, 3, 4]"
        for child in s.fork(count=1):
            assert isinstance(child, Sandbox), child
            children.append(child)
        assert children[0].run_code("kept.append(9); kept").text == "[1, 2, 3, 9]"
        assert s.run_code("kept").text == "[1, 2, 3]"
    finally:
        for c in children:
            c.kill()
        s.kill()
