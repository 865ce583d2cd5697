"""Workbench: see and run sharded JAX training from a notebook.

Usage::

    import workbench as wb

    wb.simulate_devices(8)                 # on a laptop, before JAX starts
    mesh = wb.make_mesh(data=4, model=2)
    wb.show(wb.layout((64, 2048), ("data", "model"), mesh))

Importing ``workbench`` has no side effects and imports nothing heavy: every public
name is resolved on first use (PEP 562), so ``workbench.server`` and ``workbench._runs``
can be imported by the Jupyter server without importing JAX.

No submodule shares a name with a public function (``wb.layout`` is a function defined in
``workbench._sharding.layouts``, ``wb.plan`` in ``workbench.planning``, ``wb.devices`` in
``workbench.hardware``, ``wb.launch`` in ``workbench.jobs``), so what a name is never
depends on what was imported first.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from workbench import _display

__version__ = "0.1.0"

# public name -> (module, attribute); attribute None means the module itself.
_EXPORTS: dict[str, tuple[str, str | None]] = {
    "simulate_devices": ("workbench.hardware", "simulate_devices"),
    "devices": ("workbench.hardware", "devices"),
    "DeviceInfo": ("workbench.hardware", "DeviceInfo"),
    "peak_flops": ("workbench.hardware", "peak_flops"),
    "make_mesh": ("workbench._sharding.mesh", "make_mesh"),
    "abstract_mesh": ("workbench._sharding.mesh", "abstract_mesh"),
    "MeshInfo": ("workbench._sharding.mesh", "MeshInfo"),
    "layout": ("workbench._sharding.layouts", "layout"),
    "Layout": ("workbench._sharding.layouts", "Layout"),
    "Rules": ("workbench._sharding.rules", "Rules"),
    "plan": ("workbench.planning", "plan"),
    "Plan": ("workbench.planning", "Plan"),
    "compare": ("workbench.planning", "compare"),
    "search": ("workbench._search.search", "search"),
    "SearchResult": ("workbench._search.search", "SearchResult"),
    "calibrate": ("workbench.perf._calibrate", "calibrate"),
    "remove_calibration": ("workbench.hardware._calibration", "remove_calibration"),
    "profile_step": ("workbench.train._profile", "profile_step"),
    "TrainConfig": ("workbench.train", "TrainConfig"),
    "Trainer": ("workbench.train", "Trainer"),
    "launch": ("workbench.jobs", "launch"),
    "attach": ("workbench.jobs", "attach"),
    "Job": ("workbench.jobs", "Job"),
    "Local": ("workbench.jobs", "Local"),
    "Slurm": ("workbench.jobs", "Slurm"),
    "Hosts": ("workbench.jobs", "Hosts"),
    "TPUSlice": ("workbench.jobs", "TPUSlice"),
    "show": ("workbench.widgets", "show"),
    "exercise": ("workbench.exercises", "exercise"),
    "generate": ("workbench._generate", "generate"),
    "models": ("workbench.models", None),
    "hf": ("workbench.hf", None),
    "any_model": ("workbench.any_model", None),
    "runs": ("workbench.runs", None),
    "data": ("workbench.data", None),
    "train": ("workbench.train", None),
}

__all__ = sorted(_EXPORTS)

# The root sits above every package: the one place that tells the layers below where the
# views are (workbench.widgets registers them when first imported, in a notebook).
_display.views_from("workbench.widgets")


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'workbench' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from workbench import any_model, data, hf, models, runs, train
    from workbench.hardware import DeviceInfo, devices, peak_flops, simulate_devices
    from workbench.exercises import exercise
    from workbench.jobs import Hosts, Job, Local, Slurm, TPUSlice, attach, launch
    from workbench._sharding.layouts import Layout, layout
    from workbench._sharding.mesh import MeshInfo, abstract_mesh, make_mesh
    from workbench._generate import generate
    from workbench.planning import Plan, compare, plan
    from workbench.hardware._calibration import remove_calibration
    from workbench.perf._calibrate import calibrate
    from workbench._search.search import SearchResult, search
    from workbench.train._profile import profile_step
    from workbench._sharding.rules import Rules
    from workbench.train import TrainConfig, Trainer
    from workbench.widgets import show
