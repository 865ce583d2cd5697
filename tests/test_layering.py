"""Layering: headless core never imports display libraries; the server never imports jax.

Two kinds of checks: import the modules in a subprocess with the forbidden packages
blocked (what runs at import time), and an AST walk over every source file (what any
function might import later, lazily).
"""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

CORE = ["workbench", "workbench.hardware", "workbench._sharding.mesh", "workbench._sharding.layouts",
        "workbench._sharding.rules", "workbench._sharding.placement", "workbench._sharding.pytrees",
        "workbench._sharding.topology", "workbench._search.search", "workbench.models", "workbench.hf._load", "workbench._hf_format.load",
        "workbench.hf._export", "workbench._flops",
        "workbench._step", "workbench.perf", "workbench.planning", "workbench._runs",
        "workbench.train", "workbench.data", "workbench.jobs"]
BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def __init__(self, names): self.names = names
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in self.names:
            raise ImportError(f'blocked import of {name}')
sys.meta_path.insert(0, Block(%r))
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_core_imports_without_display_libraries():
    mods = [m for m in CORE if _exists(m)]
    code = BLOCK % ["IPython", "ipywidgets", "anywidget", "plotly"] + "\n".join(
        f"import {m}" for m in mods) + "\nprint('ok')"
    out = _run(code)
    assert out.stdout.strip() == "ok", out.stderr[-3000:]


def test_server_and_runs_do_not_import_jax():
    mods = [m for m in ("workbench._runs", "workbench.server") if _exists(m)]
    assert mods, "workbench._runs should exist"
    code = BLOCK % ["jax", "jaxlib", "flax", "numpy"] + "\n".join(
        f"import {m}" for m in mods) + "\nprint('ok')"
    out = _run(code)
    assert out.stdout.strip() == "ok", out.stderr[-3000:]


def test_import_workbench_is_light_and_silent():
    out = _run("import sys, workbench; print(sorted(m for m in ('jax', 'IPython') if m in sys.modules))")
    assert out.stdout.strip() == "[]" and out.stderr == ""


def _exists(mod: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:
        return False


PUBLIC_FUNCTIONS = {"devices": "workbench.hardware", "layout": "workbench._sharding.layouts",
                    "plan": "workbench.planning", "launch": "workbench.jobs",
                    "show": "workbench.widgets", "simulate_devices": "workbench.hardware"}


def test_public_functions_are_plain_functions_whatever_was_imported_first():
    """``wb.layout`` / ``wb.plan`` / ``wb.devices`` / ``wb.launch`` / ``wb.show`` are the
    functions themselves (real signature and docstring), whether their modules were imported
    before or after the name was first used, and ``from workbench import layout`` too."""
    check = ("import inspect, types, workbench as wb\n"
             "for name, mod in %r.items():\n"
             "    f = getattr(wb, name)\n"
             "    assert type(f) is types.FunctionType, (name, type(f))\n"
             "    assert f is getattr(__import__(mod, fromlist=['x']), name), name\n"
             "    assert 'args' not in inspect.signature(f).parameters, name\n"
             "    assert f.__doc__ and f.__module__.startswith(mod), name\n"
             "from workbench import layout, plan, devices, launch, show\n"
             "assert all(type(f) is types.FunctionType for f in (layout, plan, devices, launch, show))\n"
             "print('ok')\n") % PUBLIC_FUNCTIONS
    modules_first = "".join(f"import {m}\n" for m in sorted(set(PUBLIC_FUNCTIONS.values())))
    names_first = ("import workbench as wb\n"
                   + "".join(f"wb.{n}\n" for n in PUBLIC_FUNCTIONS)
                   + modules_first)
    for prefix in (modules_first, names_first, "import workbench as wb\nwb.simulate_devices(8)\n"):
        out = _run(prefix + check)
        assert out.stdout.strip() == "ok", (prefix, out.stderr[-3000:])


# ---------------------------------------------------------------- imports read from the source

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "workbench"
DISPLAY = ("IPython", "ipywidgets", "anywidget", "plotly")


def module_name(path: pathlib.Path) -> str:
    """``.../workbench/server/_app.py`` -> ``workbench.server._app``."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(source: str, module: str, *, is_package: bool = False,
            type_checking: bool = True, modules: frozenset[str] = frozenset()
            ) -> list[tuple[int, str]]:
    """Every module that ``source`` (the module ``module``) imports, anywhere: top level,
    inside functions and classes, ``importlib.import_module("literal")``; with
    ``type_checking=False``, not the imports under ``if TYPE_CHECKING:``.

    ``from a import b`` yields ``a`` and ``a.b`` (``b`` may be a module); only ``a.b`` when
    every such name is in ``modules`` (``from package import submodule`` runs the
    submodule, not more of the package's ``__init__``). Returns ``(line, module)`` pairs.
    """
    out: list[tuple[int, str]] = []
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if not type_checking and _type_checking_only(node):
            for child in node.orelse:  # type: ignore[attr-defined]
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names if a.name != "*"]
            if not names or not all(n in modules for n in names):
                out.append((node.lineno, base))
            out.extend((node.lineno, n) for n in names)
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module",
                                                                             "__import__")))):
            out.append((node.lineno, node.args[0].value))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return out


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def core_files() -> list[pathlib.Path]:
    """Every module of the headless core: workbench/*.py and its subpackages but
    ``widgets/`` and ``server/``."""
    files = [p for p in sorted(PACKAGE.rglob("*.py"))
             if p.relative_to(PACKAGE).parts[0] not in ("widgets", "server")]
    assert len(files) > 20 and PACKAGE / "train" / "_trainer.py" in files
    return files


def core_offenders() -> set[tuple[str, str, int]]:
    """``(file, module, line)`` of each display import in the core, ``workbench.widgets``
    included (the views register with the display hook from above; imports under
    ``if TYPE_CHECKING:`` never run)."""
    found: dict[tuple[str, int], str] = {}
    for path in core_files():
        rel = path.relative_to(PACKAGE).as_posix()
        for line, name in imports(path.read_text(), module_name(path),
                                  is_package=path.name == "__init__.py", type_checking=False):
            if _within(name, DISPLAY + ("workbench.server", "workbench.widgets")):
                if (rel, line) not in found or len(name) < len(found[rel, line]):
                    found[rel, line] = name  # `from a import b`: name the module `a`
    return {(rel, name, line) for (rel, line), name in found.items()}


def test_the_import_reader_sees_lazy_relative_and_dynamic_imports():
    src = ("from typing import TYPE_CHECKING\n"
           "if TYPE_CHECKING:\n    import plotly\n"
           "def f():\n    import IPython.display as d\n"
           "class C:\n    def g(self):\n        from ..widgets import _plan_view\n"
           "def h():\n    importlib.import_module('anywidget')\n")
    got = {name for _, name in imports(src, "workbench.planning._report", type_checking=False)}
    assert {"IPython.display", "workbench.widgets", "workbench.widgets._plan_view",
            "anywidget"} <= got and "plotly" not in got
    assert "plotly" in {name for _, name in imports(src, "workbench.x")}


def test_core_never_imports_display_code_even_lazily():
    """The headless core never imports IPython, ipywidgets, anywidget, plotly or the server,
    not even inside a function, nor ``workbench.widgets``: the display hook holds what the
    widgets register, and imports the package only the root names (``views_from``)."""
    offenders = sorted(core_offenders())
    assert not offenders, ("display imports in the headless core (file, module, line): "
                           + repr(offenders))
    root = (PACKAGE / "__init__.py").read_text()   # the one place that names the views
    assert 'views_from("workbench.widgets")' in root


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph ``graph`` (as the list of its nodes), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def package_graph(folder: pathlib.Path, *, type_checking: bool = True) -> dict[str, set[str]]:
    """Which modules of ``folder``'s package import which others (every import counted,
    also inside functions; ``if TYPE_CHECKING:`` ones too unless ``type_checking=False``:
    a type-only cycle is still two modules that need each other)."""
    files = {module_name(p): p for p in sorted(folder.glob("*.py"))}
    known = frozenset(files)
    return {mod: {n for _, n in imports(p.read_text(), mod, is_package=p.name == "__init__.py",
                                        type_checking=type_checking, modules=known)
                  if n in files and n != mod}
            for mod, p in files.items()}


def packages() -> list[pathlib.Path]:
    """``workbench`` and every subpackage (a folder with an ``__init__.py``)."""
    return [PACKAGE] + sorted(p.parent for p in PACKAGE.rglob("__init__.py")
                              if p.parent != PACKAGE)


def test_import_cycle_finder():
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_server_modules_import_each_other_without_a_cycle():
    graph = package_graph(PACKAGE / "server")
    assert {f"workbench.server._{m}" for m in ("app", "handlers", "hub")} <= set(graph)
    assert "workbench.server._handlers" in graph["workbench.server._app"]  # app wires the handlers
    assert import_cycle(graph) is None, import_cycle(graph)


def test_the_import_reader_resolves_submodules_of_a_package():
    src = "from workbench.models import _attention, GPTConfig\nfrom workbench.jobs import _cluster\n"
    known = frozenset({"workbench.jobs._cluster", "workbench.models._attention"})
    got = {n for _, n in imports(src, "workbench.x", modules=known)}
    assert "workbench.jobs" not in got and "workbench.jobs._cluster" in got
    assert {"workbench.models", "workbench.models._attention"} <= got  # GPTConfig: __init__


@pytest.mark.parametrize("folder", packages(), ids=lambda p: p.relative_to(PACKAGE.parent)
                         .as_posix())
def test_no_package_has_an_import_cycle(folder):
    """Within every package the modules form a tree (a DAG): counting every import that
    can run, those inside functions too, so no lazy import hides a cycle. (Imports under
    ``if TYPE_CHECKING:`` never run and are left out here; across the whole package,
    test_import_graph.py counts them, with every module-level import.)"""
    graph = package_graph(folder, type_checking=False)
    assert len(graph) >= 2 or folder.name == "exercises", graph
    assert import_cycle(graph) is None, import_cycle(graph)


def test_models_is_a_tree_with_config_at_the_root():
    """``models/_config.py`` is pure data: of ``models`` it imports only the remat policies
    (``_remat``, which imports none), the shared layers import only config and the kernels,
    never the models built on them."""
    graph = package_graph(PACKAGE / "models")
    m = "workbench.models._"
    assert graph[m + "remat"] == set() and graph[m + "config"] == {m + "remat", m + "dtypes",
                                                                  m + "lora_spec"}
    # ... and the LoRA adapters (Flax's nnx.LoRA on the projections), which import config
    # only, and the fp8 matmuls (qwix), which import no models module
    assert graph[m + "layers"] <= {m + "config", m + "attention", m + "context", m + "lora",
                                   m + "fp8", m + "dtypes"}
    assert graph[m + "lora"] <= {m + "config", m + "lora_spec"} and graph[m + "fp8"] == set()
    assert {m + "config", m + "layers", m + "moe", m + "pipeline"} <= graph[m + "gpt"]
    assert m + "layers" in graph[m + "moe"]
    assert m + "gpt" not in graph[m + "moe"] | graph[m + "pipeline"] | graph[m + "layers"]
    assert m + "moe" not in graph[m + "pipeline"]


#: What ``workbench/_sharding/`` (meshes, layouts, rules, placement, the trace context) may import.
SHARDING_BELOW = ("workbench._sharding", "workbench.hardware", "workbench._display",
                  "workbench._validate")


def test_sharding_sits_low():
    """``_sharding`` imports only itself, ``hardware`` and the root's ``_display`` and
    ``_validate`` (every import counted, inside functions too): models, planning, perf,
    train, hf... all build on it, so it can never import them back."""
    found = []
    for path in sorted((PACKAGE / "_sharding").glob("*.py")):
        for line, name in imports(path.read_text(), module_name(path),
                                  is_package=path.name == "__init__.py"):
            if _within(name, ("workbench",)) and not _within(name, SHARDING_BELOW):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    assert len(package_graph(PACKAGE / "_sharding")) == 8
    assert not found, found


def test_the_hlo_reader_is_a_leaf():
    """``workbench/_compiled/`` (the optimised HLO text read: collectives, loops, cycles)
    imports nothing of Workbench but itself: the hardware catalogue, planning, perf and the
    exercises read programs through it, so it sits below all of them."""
    found = []
    for path in sorted((PACKAGE / "_compiled").glob("*.py")):
        for line, name in imports(path.read_text(), module_name(path),
                                  is_package=path.name == "__init__.py"):
            if _within(name, ("workbench",)) and not _within(name, ("workbench._compiled",)):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    assert (PACKAGE / "_compiled" / "hlo.py").is_file()
    assert not found, found


@pytest.mark.parametrize("module", ["server/_handlers.py", "server/_hub.py", "server/_index.py"])
def test_server_modules_never_import_the_app(module):
    """The app wires hub and handlers; nothing imports it back (not even for types)."""
    path = PACKAGE / module
    names = {n for _, n in imports(path.read_text(), module_name(path))}
    assert not any(_within(n, ("workbench.server._app",)) for n in names), names
