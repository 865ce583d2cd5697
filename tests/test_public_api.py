"""The public surface: the ``wb.*`` names and the documented modules, each with an
``__all__`` whose every name exists; the notebooks, the README and the user docs import
only those names (the reference: each module's own ``__all__``). Everything else is
private: modules with a leading underscore, and names outside ``__all__``."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib
import re
import textwrap

import pytest

import workbench as wb

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: The documented modules (docs/architecture.md, "Public surface"); ``wb.*`` is the rest.
PUBLIC_MODULES = (
    "workbench", "workbench.models", "workbench.models.pipeline", "workbench.models.context",
    "workbench.hf",
    "workbench.data", "workbench.train", "workbench.runs", "workbench.jobs",
    "workbench.hardware", "workbench.mesh", "workbench.layouts", "workbench.rules",
    "workbench.placement", "workbench.flops", "workbench.step", "workbench.topology", "workbench.planning",
    "workbench.planning.search", "workbench.perf", "workbench.perf.formulas",
    "workbench.perf.predict", "workbench.perf.analytic",
    "workbench.exercises", "workbench.widgets",
)
#: What readers of the project are shown: the notebooks, the README, the user guides.
USER_TEXTS = (sorted((ROOT / "notebooks" / "source").glob("*.py"))
              + [ROOT / "README.md", ROOT / "docs" / "your_model.md",
                 ROOT / "docs" / "predictions.md"])


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_public_modules_declare_what_is_public(module):
    mod = importlib.import_module(module)
    assert isinstance(getattr(mod, "__all__", None), (list, tuple)), f"{module} has no __all__"
    for name in mod.__all__:
        assert getattr(mod, name, None) is not None or name in getattr(mod, "__dict__", {}), \
            f"{module}.__all__ names {name!r}, which it does not have"


def test_wb_names_are_public_and_documented():
    assert set(wb.__all__) >= {"plan", "Plan", "search", "make_mesh", "abstract_mesh",
                               "Rules", "Trainer", "TrainConfig", "launch", "show"}
    for name in wb.__all__:
        value = getattr(wb, name)
        assert value.__doc__, f"wb.{name} has no docstring"


def _code_of(path: pathlib.Path) -> list[str]:
    """The Python of a notebook source, or of the fenced ``python`` blocks of a text."""
    text = path.read_text()
    if path.suffix == ".py":
        return [text]
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _imports(code: str) -> list[tuple[str, str | None]]:
    try:
        tree = ast.parse(textwrap.dedent(code))
    except SyntaxError:   # a fragment of a doc: its import lines are still whole
        return [(m, n.strip()) for m, names in re.findall(
            r"from (workbench[\w.]*) import ([\w, ]+)", code) for n in names.split(",")]
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("workbench"):
            out += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.startswith("workbench")]
    return out


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ModuleNotFoundError, ValueError):
        return False


def _uses(path: pathlib.Path) -> list[tuple[str, str | None]]:
    """``(module, name)`` for each ``from workbench.x import name`` and ``import
    workbench.x`` in the code of ``path``, and each ```workbench.x.name``` a text names."""
    out = [use for code in _code_of(path) for use in _imports(code)]
    if path.suffix == ".md":
        for dotted in re.findall(r"`(workbench(?:\.[A-Za-z_]\w*)+)", path.read_text()):
            parts = dotted.split(".")
            mod = next(".".join(parts[:i]) for i in range(len(parts), 0, -1)
                       if _is_module(".".join(parts[:i])))
            rest = parts[len(mod.split(".")):]
            out.append((mod, rest[0] if rest else None))
    return out


@pytest.mark.parametrize("path", USER_TEXTS, ids=lambda p: p.name)
def test_notebooks_and_docs_use_only_the_public_api(path):
    bad = []
    for module, name in _uses(path):
        if module not in PUBLIC_MODULES:
            full = f"{module}.{name}" if name else module
            if full not in PUBLIC_MODULES:
                bad.append(f"{full} (module {module} is not public)")
            continue
        if name is not None and name not in importlib.import_module(module).__all__ \
                and f"{module}.{name}" not in PUBLIC_MODULES:
            bad.append(f"{module}.{name} (not in {module}.__all__)")
    assert not bad, f"{path.name} uses private names: {bad}"
