"""No import circle across the whole package: the import-time graph of every module under
``workbench/`` is a DAG (test_layering.py checks each package alone, lazy imports too), and
so is the graph of its packages with every import counted, lazy ones and module paths in
strings too (the end of this file).

The graph, read from the source (``ast``), has an edge ``a -> b`` when importing ``a``
needs ``b``:

- **Module-level imports count**: the statements that run when the module is imported
  (top level, and inside ``if`` / ``try`` / ``with`` / loops / class bodies), and those
  under ``if TYPE_CHECKING:``. The latter never run, but a module that names another's
  types needs it as much as one that calls it: a type-only circle is two modules that
  cannot be read apart (``rules`` <-> ``tracing`` was one).
- **Imports inside functions do not count**: they are deferred, run when the function is
  called, after every module has loaded, so they cannot deadlock an import. They are
  how a module loads what it needs only sometimes (safetensors, orbax, the display hook).
  ``test_layering.test_no_package_has_an_import_cycle`` still counts them inside a package.
- **What a target is**: ``import a.b.c`` and ``from a.b import c`` (``c`` a module) need
  ``a.b.c``; ``from a.b import name`` (not a module) needs ``a.b`` (its ``__init__``).
- **Packages run first**: importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``
  first, so the edge also goes to each package above the target that is not above the
  importer too (the importer's own packages are already being imported when it runs).
  An *explicit* import of a package counts, also one above the importer: a package
  ``__init__`` that imports a submodule which imports the package back is a circle.
- **The root** ``workbench/__init__.py`` resolves every public name on first use (PEP
  562) and names them all under ``TYPE_CHECKING`` for IDEs, so it sits on top of the
  graph: a module inside imports ``workbench.x``, never ``workbench`` itself
  (``from workbench import runs`` is the submodule ``workbench._runs``).

A name a package resolves lazily (a ``__getattr__`` in its ``__init__``), imported at module
level from inside the package, would run its module at import time without an edge here;
:func:`test_no_module_level_import_of_a_lazy_name` forbids that, so the graph is complete.
"""
from __future__ import annotations

import ast
import functools
import pathlib
import re

import pytest

from tests.test_layering import PACKAGE, import_cycle, imports, module_name


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_level_imports(source: str) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ``source`` that run (or, under ``if TYPE_CHECKING:``, are
    read) when the module is imported: every statement but those inside functions."""
    out: list[ast.Import | ast.ImportFrom] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue   # deferred: runs when called
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out.append(node)
                continue
            for field in ("body", "orelse", "finalbody"):
                visit(getattr(node, field, None) or [])
            for handler in getattr(node, "handlers", None) or []:
                visit(handler.body)
            for case in getattr(node, "cases", None) or []:
                visit(case.body)

    visit(ast.parse(source).body)
    return out


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def targets(node: ast.Import | ast.ImportFrom, module: str, *, is_package: bool,
            modules: frozenset[str]) -> set[str]:
    """The modules of ``modules`` that the statement ``node`` of ``module`` needs, with the
    packages that run before them (those not above ``module`` too)."""
    if isinstance(node, ast.Import):
        named = {a.name for a in node.names}
    else:
        base = node.module or ""
        if node.level:
            package = (module if is_package else module.rpartition(".")[0]).split(".")
            base = ".".join(package[: len(package) - node.level + 1]
                            + ([node.module] if node.module else []))
        named = {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                 for a in node.names}
    mine = set(_ancestors(module))
    out = set(named)
    for name in named:
        out.update(a for a in _ancestors(name) if a not in mine)
    return {n for n in out if n in modules and n != module}


def import_graph(root: pathlib.Path = PACKAGE
                 ) -> dict[str, dict[str, int]]:
    """``module -> {module it needs at import time: line of the first such import}`` for
    every module under ``root``."""
    files = {module_name(p): p for p in sorted(root.rglob("*.py"))
             if "__pycache__" not in p.parts}
    modules = frozenset(files)
    graph: dict[str, dict[str, int]] = {}
    for mod, path in files.items():
        edges: dict[str, int] = {}
        for node in module_level_imports(path.read_text()):
            for t in targets(node, mod, is_package=path.name == "__init__.py",
                             modules=modules):
                edges.setdefault(t, node.lineno)
        graph[mod] = edges
    return graph


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    """``a (line 3) -> b (line 12) -> a``: each module with the line that imports the next."""
    steps = [f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False)]
    return " -> ".join(steps + [cycle[-1]])


def test_the_reader_counts_what_runs_at_import_time():
    src = ("from typing import TYPE_CHECKING\n"
           "import workbench.models._gpt\n"
           "from workbench.jobs import _cluster, launch\n"
           "if TYPE_CHECKING:\n    from workbench._sharding.rules import Rules\n"
           "try:\n    from . import _flops\nexcept ImportError:\n    pass\n"
           "class C:\n    from workbench._sharding import layouts\n"
           "def f():\n    from workbench.planning import schedule\n")
    mods = frozenset({"workbench", "workbench.models", "workbench.models._gpt", "workbench.jobs",
                      "workbench.jobs._cluster", "workbench._sharding", "workbench._sharding.rules",
                      "workbench._flops", "workbench._sharding.layouts", "workbench.planning",
                      "workbench.planning.schedule", "workbench._step"})
    got: set[str] = set()
    for node in module_level_imports(src):
        got |= targets(node, "workbench._step", is_package=False, modules=mods)
    assert got == {"workbench.models", "workbench.models._gpt",   # the package runs first
                   "workbench.jobs",                # `launch` is a name of jobs/__init__
                   "workbench.jobs._cluster", "workbench._sharding",   # runs before its module
                   "workbench._sharding.rules", "workbench._flops",
                   "workbench._sharding.layouts"}   # not planning: inside a function


def test_a_package_importing_itself_back_counts():
    mods = frozenset({"workbench", "workbench.models", "workbench.models._gpt"})
    [back] = module_level_imports("from workbench.models import GPTConfig\n")
    assert targets(back, "workbench.models._gpt", is_package=False, modules=mods) == {
        "workbench.models"}
    [sibling] = module_level_imports("from workbench.models import _gpt\n")
    assert targets(sibling, "workbench.models._config", is_package=False, modules=mods) == {
        "workbench.models._gpt"}   # models/__init__ is already running: no edge to it
    [root] = module_level_imports("import workbench\n")
    assert targets(root, "workbench.jobs._local", is_package=False, modules=mods) == {
        "workbench"}


def test_the_whole_package_has_no_import_circle():
    graph = import_graph()
    assert len(graph) > 100 and "workbench.hf._load" in graph
    assert "workbench._train_state" in graph["workbench.hf._load"]   # hf sits above the train state
    cycle = import_cycle({m: set(e) for m, e in graph.items()})
    assert cycle is None, f"import circle: {describe(cycle, graph)}"


def _static_names(init: pathlib.Path) -> tuple[bool, set[str]]:
    """Whether a package ``__init__`` resolves names lazily (``__getattr__``), and the names
    it binds at module level."""
    tree = ast.parse(init.read_text())
    lazy = any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return lazy, names


def test_no_module_level_import_of_a_lazy_name():
    """``from workbench.train import Trainer`` at module level would import train/trainer.py
    through ``train.__getattr__`` at import time, an edge the graph cannot see: inside the
    package, import such a name from the module that defines it."""
    files = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))
             if "__pycache__" not in p.parts}
    inits = {m: _static_names(p) for m, p in files.items() if p.name == "__init__.py"}
    found = []
    for mod, path in files.items():
        for node in module_level_imports(path.read_text()):
            if not isinstance(node, ast.ImportFrom) or node.level or node.module not in inits:
                continue
            lazy, bound = inits[node.module]
            for a in node.names:
                if lazy and f"{node.module}.{a.name}" not in files and a.name not in bound:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} "
                                 f"from {node.module} import {a.name}")
    assert not found, found


# ------------------------------------------------------------------ the graph of packages

#: A string that is a whole module path (``"workbench.hf._load"``, or a view's
#: ``"workbench.widgets._plan_view:plan_widget"``): what importlib is handed.
_MODULE_STRING = re.compile(r"workbench(\.[A-Za-z_][A-Za-z0-9_]*)+(:[A-Za-z_][A-Za-z0-9_]*)?")


def _unit(module: str) -> str | None:
    """The package-level node of a module: ``workbench.hf._load`` -> ``hf``,
    ``workbench._step`` -> ``_step``; None for the root (it sits above all of them)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "workbench" else None


def package_edges(root: pathlib.Path = PACKAGE) -> dict[str, dict[str, str]]:
    """``unit -> {unit it needs: "file:line" of the first such use}`` over every module
    under ``root`` but the root ``__init__``: every import (inside functions, under
    ``if TYPE_CHECKING:``), every ``import_module("...")``, and every string constant that
    is a whole module path (a table handed to importlib later counts too)."""
    units = {p.stem for p in root.glob("*.py")} | {p.parent.name for p in root.glob("*/__init__.py")}
    edges: dict[str, dict[str, str]] = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts or path == root / "__init__.py":
            continue
        mod = module_name(path) if root == PACKAGE else _name_under(path, root)
        source, src = path.read_text(), _unit(mod)
        named = [(line, name) for line, name in imports(source, mod,
                                                         is_package=path.name == "__init__.py")]
        named += [(n.lineno, n.value.partition(":")[0]) for n in ast.walk(ast.parse(source))
                  if isinstance(n, ast.Constant) and isinstance(n.value, str)
                  and _MODULE_STRING.fullmatch(n.value)]
        where = path.relative_to(root.parent).as_posix()
        for line, name in named:
            dst = _unit(name)
            if dst in units and src is not None and dst != src:   # a module, not a word
                edges.setdefault(src, {}).setdefault(dst, f"{where}:{line}")
    return edges


def _name_under(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _workbench_edges() -> dict[str, dict[str, str]]:
    return package_edges()


def _circle(edges: dict[str, dict[str, str]]) -> str | None:
    cycle = import_cycle({a: set(b) for a, b in edges.items()})
    if cycle is None:
        return None
    return " -> ".join(f"{a} ({edges[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False)
                       ) + f" -> {cycle[-1]}"


def test_the_packages_form_no_circle():
    """The graph of packages (each subpackage and top-level module of ``workbench/`` one
    node) has no circle, every way a module can reach another counted: lazy imports,
    ``import_module`` and module paths in strings. Views register with the display hook
    from ``widgets``; ``train`` reads Hugging Face folders through ``_hf_format``, below
    it and below ``hf``, so no arrow runs back up."""
    edges = _workbench_edges()
    assert {"widgets", "hf", "train", "_display", "_hub", "_hf_format"} <= set(edges) | {
        d for e in edges.values() for d in e}
    assert "train" in edges["hf"] and "_hub" in edges["data"]   # hf/export_run restores runs
    assert "_hf_format" in edges["train"] and "_hf_format" in edges["hf"]
    assert _circle(edges) is None, f"package circle: {_circle(edges)}"


#: The arrows the layering forbids (docs/architecture.md, "Which way imports go"):
#: (lower, upper) means the lower package never imports the upper one.
BACK_UP = [("_display", "widgets"), ("hardware", "widgets"), ("planning", "widgets"),
           ("train", "hf"), ("data", "hf"), ("models", "hf"), ("models", "any_model"),
           ("_hub", "hf"), ("_hf_format", "hf"), ("_hf_format", "train"),
           ("_hf_format", "planning"), ("models", "_hf_format"), ("_hub", "_hf_format")]


@pytest.mark.parametrize("lower, upper", BACK_UP)
def test_no_arrow_runs_back_up(lower, upper):
    edges = _workbench_edges()
    assert upper not in edges.get(lower, {}), edges[lower][upper]


def test_an_arrow_back_up_is_found_in_the_real_tree(tmp_path):
    """The check can fail: the package's own sources, copied, with one lazy import of
    ``workbench.hf`` added to ``train/_config.py`` (where ``TrainConfig.check`` reads the
    ``init`` folder), give the arrow ``train -> hf`` and the circle it closes, which the
    tree as it is has not."""
    assert "hf" not in _workbench_edges()["train"] and _circle(_workbench_edges()) is None
    copy = tmp_path / "workbench"
    for path in PACKAGE.rglob("*.py"):
        if "__pycache__" not in path.parts:
            (copy / path.relative_to(PACKAGE)).parent.mkdir(parents=True, exist_ok=True)
            (copy / path.relative_to(PACKAGE)).write_text(path.read_text())
    config = copy / "train" / "_config.py"
    lines = config.read_text().splitlines()
    config.write_text("\n".join(lines + ["", "", "def _read_init(path):",
                                          "    from workbench.hf import _load",
                                          "    return _load"]) + "\n")
    edges = package_edges(copy)
    assert edges["train"]["hf"] == f"workbench/train/_config.py:{len(lines) + 4}"
    assert _circle(edges) is not None and "hf" in _circle(edges)


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "workbench"
    for rel, text in {"__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_package_check_fails_on_a_made_up_circle(tmp_path):
    """A circle hidden in a lazy import and a string handed to importlib later is found,
    with the file and line of each arrow; the same tree without the string has none."""
    low = "def f():\n    from workbench.high import _view\n"
    high = "import workbench.low\n"
    table = 'VIEWS = {"x": "workbench.high._view:draw"}\n'
    root = _tree(tmp_path, {"low.py": low, "high/__init__.py": "", "high/_view.py": high})
    circle = _circle(package_edges(root))
    assert circle == ("high (workbench/high/_view.py:1) -> low (workbench/low.py:2) -> high")
    root = _tree(tmp_path / "b", {"low.py": table, "high/__init__.py": "", "high/_view.py": high})
    assert _circle(package_edges(root)) == (
        "high (workbench/high/_view.py:1) -> low (workbench/low.py:1) -> high")
    root = _tree(tmp_path / "c", {"low.py": "X = 1\n", "high/__init__.py": "",
                                  "high/_view.py": high})
    assert _circle(package_edges(root)) is None and package_edges(root) == {
        "high": {"low": "workbench/high/_view.py:1"}}
