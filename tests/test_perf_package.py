"""``workbench.perf``, split from ``workbench.planning`` (its old paths are gone:
tests/test_one_name.py): perf never imports the plan
pipeline (planning uses perf, not the other way round); ``workbench.perf.formulas`` is the public
home of the hand counts."""
from __future__ import annotations

import ast
import pathlib

import workbench as wb

PERF = pathlib.Path(wb.__file__).parent / "perf"


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
