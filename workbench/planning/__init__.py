"""Plan before you allocate: the Trainer's own step compiled ahead of time (or estimated by
formula on hardware you do not have) -> memory, FLOPs, collectives and layout lints per
device; ``Plan.materialize()`` builds the sharded model.

Modules: ``planner`` (``plan()``, ``compare()``) runs the ``stages``: resolve the inputs,
choose the compile target (the devices at hand, the TPU compiler for an abstract TPU
slice, or formulas), build the abstract step (the Trainer's own, from ``workbench.step``),
``measure`` (compile, or estimate), lint; ``compile`` (compiles in a worker thread:
progress, Ctrl-C, in-process and on-disk caches), ``report`` (``PlanReport``: the
serialisable numbers with their text and dict forms, and ``Comparison``), ``handle``
(``Plan``: the report with the runnable step, ``materialize``), ``predict`` (the roofline behind ``Plan.predicted``), ``analytic``
(formulas for abstract meshes, calibrated in BENCHMARKS.md), ``lints`` (layout mistakes),
``hlo`` (collectives read from the compiled program), ``search`` / ``search_space`` /
``search_result`` (``wb.search``: layouts ranked by predicted step time).
"""
from workbench.planning.hlo import Collective
from workbench.planning.lints import Lint
from workbench.planning.handle import Plan
from workbench.planning.planner import compare, plan
from workbench.planning.report import Comparison, PlanReport

__all__ = ["Collective", "Comparison", "Lint", "Plan", "PlanReport", "compare", "plan"]
