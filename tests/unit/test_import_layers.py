"""The layer order of `aenv`, written down once and checked over the real import graph.

Every import statement counts: at module level, inside a function, under `TYPE_CHECKING`.
A package may import from the layers below its own and from nothing above; packages that
share a layer do not import each other; and no chain of modules imports back into itself
(a circle). A new top-level package or module has to be placed in `LAYERS` before it can be
imported by anything, so the table stays whole."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "aenv"

# Top to bottom. A row's entries are the top-level packages and modules of `aenv` (`aenv`
# itself is its `__init__`); each entry is independent of the others in its row.
LAYERS: tuple[tuple[str, ...], ...] = (
    # The command line; it starts the server.
    ("cli",),
    # The composition root of a node.
    ("server",),
    # The HTTP API, and what it serves besides the orchestrator: builds and the cluster.
    ("api",),
    ("builds", "cluster"),
    # The orchestrator's facade and parts; the sandbox proxy and the web console beside it;
    # the in-sandbox code interpreter.
    ("orchestrator", "proxy", "console", "codeinterp"),
    # What the orchestrator drives.
    ("runtime", "snapshots", "volumes", "keys", "secretstore"),
    ("images", "envd"),
    # Shared by everything above: settings, records, errors and small helpers.
    (
        "telemetry",
        "serving",
        "redact",
        "config",
        "envd_wire",
        "envd_client",
        "envd_errors",
        "domain",
        "egress",
        "nodenet",
        "registries",
        "paging",
        "errors",
        "sqlitedb",
        "fsutil",
        "logctx",
        "background",
        "threadstream",
        "crashpoint",
        PACKAGE,
    ),
)
# The bottom row may import within itself (without circles): it is one layer of helpers.
SHARED = LAYERS[-1]
# What these import of the orchestrator is its package: the Orchestrator, its parts' types
# and the records they take and return, never one of its modules. (The composition root builds the parts; builds still
# read the catalog and drive envd through the orchestrator's modules.)
FACADE_ONLY = ("cli", "api", "cluster", "proxy", "console")
ORCHESTRATOR = f"{PACKAGE}.orchestrator"


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (the longest name of a module that exists)
    line: int

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.target}"


def modules(src: Path = SRC) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        if "node_modules" in path.parts:
            continue
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _targets(
    module: str, path: Path, node: ast.Import | ast.ImportFrom, known: set[str]
) -> Iterator[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            base = here[: len(here) - node.level + 1]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        # `from pkg import mod` imports the module `pkg.mod`, `from mod import name` `mod`.
        names = [
            f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names
        ]
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            yield name


def imports(src: Path = SRC) -> list[Import]:
    found = modules(src)
    known = set(found)
    out: set[Import] = set()
    for module, path in found.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _targets(module, path, node, known):
                    out.add(Import(module, target, node.lineno))
    return sorted(out, key=lambda i: (i.source, i.line, i.target))


def entry(module: str) -> str:
    """The top-level package or module of `aenv` that `module` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE


def layer_of(name: str) -> int:
    for i, row in enumerate(LAYERS):
        if name in row:
            return i
    raise KeyError(name)


def breaks(graph: list[Import]) -> list[str]:
    """Imports that go up, or sideways within a row, with where they are."""
    out = []
    for imp in graph:
        a, b = entry(imp.source), entry(imp.target)
        if a == b:
            continue
        la, lb = layer_of(a), layer_of(b)
        if lb < la:
            out.append(f"{imp}: {a} may not import {b} (a layer above)")
        elif lb == la and LAYERS[la] is not SHARED:
            out.append(f"{imp}: {a} and {b} share a layer and may not import each other")
    return out


def circles(graph: list[Import]) -> list[list[str]]:
    """The module-level strongly connected components with more than one module."""
    edges: dict[str, set[str]] = {}
    for imp in graph:
        edges.setdefault(imp.source, set()).add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    # Iterative Tarjan: the graph is deep enough to hit the recursion limit.
    work: list[tuple[str, Iterator[str]]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        work.append((v, iter(sorted(edges.get(v, ())))))

    for root in sorted(edges):
        if root in index:
            continue
        visit(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    visit(w)
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_every_top_level_package_and_module_has_its_layer() -> None:
    unplaced = sorted({entry(m) for m in modules()} - {n for row in LAYERS for n in row})
    assert unplaced == [], f"place these in LAYERS ({__file__}): {unplaced}"


def test_no_import_goes_up_or_sideways() -> None:
    found = breaks(imports())
    assert found == [], "imports against the layer order:\n" + "\n".join(found)


def test_the_layers_above_see_only_the_orchestrators_facade() -> None:
    found = [
        str(imp)
        for imp in imports()
        if entry(imp.source) in FACADE_ONLY and imp.target.startswith(f"{ORCHESTRATOR}.")
    ]
    assert found == [], "orchestrator modules imported past its facade:\n" + "\n".join(found)


def test_no_circles() -> None:
    found = circles(imports())
    assert found == [], "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_check_sees_imports_in_functions_and_type_checking_blocks(tmp_path: Path) -> None:
    pkg = tmp_path / PACKAGE
    (pkg / "api").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "api" / "__init__.py").write_text("")
    (pkg / "config.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .api import routes\n"
    )
    (pkg / "api" / "routes.py").write_text("def f():\n    from ..config import X\n")
    graph = imports(tmp_path)
    assert [str(i) for i in graph] == [
        "aenv.api.routes:2 imports aenv.config",
        "aenv.config:3 imports aenv.api.routes",
    ]
    assert circles(graph) == [["aenv.api.routes", "aenv.config"]]
    assert breaks(graph) == [
        "aenv.config:3 imports aenv.api.routes: config may not import api (a layer above)"
    ]


# Where an import may wait for the function that needs it, and why: start-up time. Anywhere
# else an import in a function only hides a dependency (the contracts above count it anyway).
DEFERRED_OK = {
    "envd": "PID 1 of every sandbox: a cold start imports only what serving needs",
    "cli": "a command imports only what it runs, so `aenv --help` stays fast",
    "codeinterp": "jupyter's client, when the first context starts",
}


def deferred(src: Path = SRC) -> list[str]:
    """Imports inside functions, as `module:line`."""
    out = []
    for module, path in modules(src).items():
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                out += [
                    f"{module}:{node.lineno}"
                    for node in ast.walk(fn)
                    if isinstance(node, ast.Import | ast.ImportFrom)
                ]
    return sorted(set(out))


def test_imports_wait_in_functions_only_where_start_up_time_is_the_reason() -> None:
    found = [d for d in deferred() if entry(d.partition(":")[0]) not in DEFERRED_OK]
    assert found == [], "imports inside functions (move them to the top):\n" + "\n".join(found)
