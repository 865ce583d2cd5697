"""The public surface: the ``wb.*`` names and the public modules (no path part with a
leading underscore), each thin, with an ``__all__`` whose every name exists; the
notebooks, the README and the user guides use only those names (the reference: each
module's own ``__all__``). Old module paths are gone: tests/test_one_name.py."""
from __future__ import annotations

import ast
import importlib
import pathlib
import pkgutil
import re
import textwrap

import pytest

import workbench as wb

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: The public modules (docs/architecture.md, "Public surface"). A new one is a decision:
#: add it here and there.
PUBLIC_MODULES = (
    "workbench", "workbench.any_model", "workbench.data", "workbench.exercises", "workbench.hardware",
    "workbench.hf", "workbench.jobs", "workbench.models", "workbench.perf",
    "workbench.perf.formulas", "workbench.planning", "workbench.runs", "workbench.server",
    "workbench.train", "workbench.widgets",
)
#: What readers of the project are shown: the notebooks, the README, the user guides
#: (every doc but the contributors' architecture.md, contracts.md and testing.md).
USER_TEXTS = (sorted((ROOT / "notebooks" / "source").glob("*.py")) + [ROOT / "README.md"]
              + sorted(p for p in (ROOT / "docs").glob("*.md")
                       if p.name not in {"architecture.md", "contracts.md", "testing.md"}))
#: Functions a thin public module may define: PEP 562's hooks, the server's entry point.
THIN_DEFS = {"__getattr__", "__dir__", "_jupyter_server_extension_points"}


def _all_modules() -> list[str]:
    return ["workbench"] + [m.name for m in pkgutil.walk_packages(wb.__path__, "workbench.")
                            if "labextension" not in m.name]


def test_the_public_modules_are_exactly_those_without_an_underscore():
    public = sorted(m for m in _all_modules()
                    if not any(part.startswith("_") for part in m.split(".")))
    assert public == sorted(PUBLIC_MODULES)


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_public_modules_are_thin_and_declare_what_is_public(module):
    mod = importlib.import_module(module)
    assert isinstance(getattr(mod, "__all__", None), (list, tuple)), f"{module} has no __all__"
    for name in mod.__all__:
        assert getattr(mod, name, None) is not None or name in getattr(mod, "__dict__", {}), \
            f"{module}.__all__ names {name!r}, which it does not have"
    tree = ast.parse(pathlib.Path(mod.__file__).read_text())
    defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert set(defined) <= THIN_DEFS, f"{module} defines {defined}: move them to a private " \
                                      "module and re-export"


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
        return [(m, n.strip().split()[0]) for m, names in re.findall(
            r"from (workbench[\w.]*) import ([\w, ]+)", code) for n in names.split(",")]
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("workbench"):
            out += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.startswith("workbench")]
    return out


def _dotted(text: str, prefix: str) -> list[tuple[str, str | None]]:
    """``(module, name)`` for each ``wb.a.b...`` / ```workbench.a.b``` chain in ``text``:
    the longest public-module prefix, and the name after it (None: the module itself)."""
    out = []
    for chain in re.findall(rf"{re.escape(prefix)}((?:\.[A-Za-z_]\w*)+)", text):
        parts = ["workbench", *chain.strip(".").split(".")]
        i = max(i for i in range(1, len(parts) + 1)
                if ".".join(parts[:i]) in PUBLIC_MODULES or i == 1)
        mod = ".".join(parts[:i])
        out.append((mod, parts[i] if i < len(parts) else None))
    return out


def _uses(path: pathlib.Path) -> list[tuple[str, str | None]]:
    """Every ``from workbench.x import name`` / ``import workbench.x`` in the code of
    ``path``, every ``wb.x.y`` chain, and each ```workbench.x.y``` a text names."""
    text = path.read_text()
    out = [use for code in _code_of(path) for use in _imports(code)]
    out += _dotted(text, "wb")
    if path.suffix == ".md":
        out += _dotted(text, "`workbench")
    return out


def _bad_uses(uses: list[tuple[str, str | None]]) -> list[str]:
    bad = []
    for module, name in uses:
        full = f"{module}.{name}" if name else module
        if module not in PUBLIC_MODULES:
            if full not in PUBLIC_MODULES:
                bad.append(f"{full} (module {module} is not public)")
            continue
        public = importlib.import_module(module).__all__
        if name is not None and name not in public and full not in PUBLIC_MODULES:
            bad.append(f"{full} (not in {module}.__all__)")
    return bad


@pytest.mark.parametrize("path", USER_TEXTS, ids=lambda p: p.name)
def test_notebooks_and_docs_use_only_the_public_api(path):
    bad = _bad_uses(_uses(path))
    assert not bad, f"{path.name} uses private names: {bad}"


def test_the_check_catches_a_private_import_and_a_private_attribute():
    code = ("from workbench.perf._predict import predict\nimport workbench.step\n"
            "wb.models.GPTConfig\nwb.hf.load_params\nwb.rules.penzai_rules\n")
    uses = _imports(code) + _dotted(code, "wb")
    assert _bad_uses(uses) == [
        "workbench.perf._predict.predict (module workbench.perf._predict is not public)",
        "workbench.step (module workbench.step is not public)",
        "workbench.hf.load_params (not in workbench.hf.__all__)",
        "workbench.rules (not in workbench.__all__)"]


def test_a_missing_module_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("workbench.planning.no_such_module")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("workbench.nope.deeper")
