"""``workbench.perf``, split from ``workbench.planning``: the old module paths still import,
warn with the new path and give the new module's own objects; perf never imports the plan
pipeline (planning uses perf, not the other way round); ``workbench.perf.formulas`` is the public
home of the hand counts."""
from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

import workbench as wb

MOVED = ("analytic", "attention_cost", "bounds", "calibrate", "predict", "profile",
         "trace")   # and hlo, a leaf below perf since: tests/test_public_api.py
PERF = pathlib.Path(wb.__file__).parent / "perf"


@pytest.mark.parametrize("name", MOVED)
def test_an_old_planning_path_warns_and_gives_the_perf_module(name):
    """In a fresh interpreter (a module is imported once per process): the old path is
    the perf module itself, and importing it warns, naming the new path."""
    code = ("import importlib, warnings\n"
            "warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            f"    old = importlib.import_module('workbench.planning.{name}')\n"
            f"assert old is importlib.import_module('workbench.perf._{name}')\n"
            "print([str(x.message) for x in w if x.category is DeprecationWarning])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"workbench.planning.{name} is now workbench.perf._{name}" in out.stdout


def test_perf_never_imports_the_plan_pipeline():
    bad = []
    for path in sorted(PERF.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            bad += [f"{path.name}:{node.lineno} {m}" for m in mods
                    if m.startswith("workbench.planning")]
    assert not bad, f"perf imports planning: {bad}"


def test_formulas_are_public_and_the_same_functions():
    import workbench.perf as perf
    from workbench import _flops as flops
    from workbench.perf import _analytic as analytic, _attention_cost as attention_cost, formulas
    from workbench.perf import _analytic_collectives as analytic_collectives

    assert perf.formulas is formulas and "formulas" in perf.__all__
    for name in formulas.__all__:
        impl = getattr(analytic, name, None) or getattr(analytic_collectives, name, None) \
            or getattr(attention_cost, name, None) or getattr(flops, name)
        assert getattr(formulas, name) is impl, name
    assert formulas.moe_collectives.__doc__
