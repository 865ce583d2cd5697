"""Plan before you allocate: the Trainer's own step compiled ahead of time (or estimated by
formula on hardware you do not have) -> memory, FLOPs, collectives and layout lints per
device; ``Plan.materialize()`` builds the sharded model.

Modules: ``planner`` (``plan()``, ``compare()``: the Trainer's step from ``workbench.step``,
compiled for the devices at hand, by the TPU compiler for an abstract TPU slice, or
estimated), ``compile`` (compiles in a worker thread: progress, Ctrl-C, in-process and
on-disk caches), ``report`` (the ``Plan`` record, its text and dict forms, and
``Comparison``), ``predict`` (the roofline behind ``Plan.predicted``), ``analytic``
(formulas for abstract meshes, calibrated in BENCHMARKS.md), ``lints`` (layout mistakes),
``hlo`` (collectives read from the compiled program), ``search`` / ``search_space`` /
``search_result`` (``wb.search``: layouts ranked by predicted step time).
"""
from workbench.planning.hlo import Collective
from workbench.planning.lints import Lint
from workbench.planning.planner import Plan, compare, plan
from workbench.planning.report import Comparison

__all__ = ["Collective", "Comparison", "Lint", "Plan", "compare", "plan"]
