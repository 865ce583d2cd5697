"""Plan before you allocate: the Trainer's own step compiled ahead of time (or estimated by
formula on hardware you do not have) -> memory, FLOPs, collectives and layout lints per
device; ``Plan.materialize()`` builds the sharded model.

Modules: ``planner`` (``plan()``, ``compare()``: the Trainer's step from ``workbench.step``,
compiled or estimated), ``report`` (the ``Plan`` record, its text and dict forms, and
``Comparison``), ``analytic`` (formulas for abstract meshes), ``lints`` (layout mistakes),
``hlo`` (collectives read from the compiled program).
"""
from workbench.planning.hlo import Collective
from workbench.planning.lints import Lint
from workbench.planning.planner import Plan, compare, plan
from workbench.planning.report import Comparison

__all__ = ["Collective", "Comparison", "Lint", "Plan", "compare", "plan"]
