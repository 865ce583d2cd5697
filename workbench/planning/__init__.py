"""Plan before you allocate: the Trainer's own step compiled ahead of time (or estimated by
formula on hardware you do not have) -> memory, FLOPs, collectives and layout lints per
device; ``Plan.materialize()`` builds the sharded model.

Modules: ``planner`` (``plan()``, ``compare()``; ``options``: ``PlanOptions``, the record
of ``plan()``'s and ``wb.search``'s keyword arguments) runs the ``stages``: resolve the inputs,
choose the compile target (the devices at hand, the TPU compiler for an abstract TPU
slice, or formulas), build the abstract step (the Trainer's own, from ``workbench._step``),
``measure`` (compile, or estimate), lint; ``compile`` (compiles in a worker thread:
progress, Ctrl-C, in-process and on-disk caches; ``flags``: the overlap options),
``report`` (``PlanReport``: the serialisable numbers with their text and dict forms;
``compiled_numbers``: what it read from the compiled program; ``serialise``: its JSON),
``comparison`` (``Comparison``), ``handle`` (``Plan``: the report with the runnable step,
``materialize``), ``lints`` (layout mistakes; ``parallel_lints``: those of context
parallelism and mixtures of experts, known before tracing), ``activations`` (the
step's tensors and why each collective runs). The layout search (``wb.search``: layouts
ranked by predicted step time) is built on ``plan``, in ``workbench._search``. How long a
step takes (the HLO cost reading, the roofline, the formulas, traces, profiles,
calibration) is ``workbench.perf``.
"""
from workbench._compiled.hlo import Collective
from workbench.planning._lints import Lint
from workbench.planning._comparison import Comparison
from workbench.planning._handle import Plan
from workbench.planning._planner import compare, plan
from workbench.planning._report import PlanReport

__all__ = ["Collective", "Comparison", "Lint", "Plan", "PlanReport", "compare", "plan"]
