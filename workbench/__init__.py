"""Workbench: see and run sharded JAX training from a notebook.

Usage::

    import workbench as wb

    wb.simulate_devices(8)                 # on a laptop, before JAX starts
    mesh = wb.make_mesh(data=4, model=2)
    wb.show(wb.layout((64, 2048), ("data", "model"), mesh))

Importing ``workbench`` has no side effects and imports nothing heavy: every public
name is resolved on first use (PEP 562), so ``workbench.server`` and ``workbench.runs``
can be imported by the Jupyter server without importing JAX.
"""
from __future__ import annotations

import importlib
import sys as _sys
import types as _types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> (module, attribute); attribute None means the module itself.
_EXPORTS: dict[str, tuple[str, str | None]] = {
    "simulate_devices": ("workbench.devices", "simulate_devices"),
    "devices": ("workbench.devices", "devices"),
    "DeviceInfo": ("workbench.devices", "DeviceInfo"),
    "peak_flops": ("workbench.devices", "peak_flops"),
    "make_mesh": ("workbench.mesh", "make_mesh"),
    "abstract_mesh": ("workbench.mesh", "abstract_mesh"),
    "MeshInfo": ("workbench.mesh", "MeshInfo"),
    "layout": ("workbench.layout", "layout"),
    "Layout": ("workbench.layout", "Layout"),
    "Rules": ("workbench.rules", "Rules"),
    "plan": ("workbench.plan", "plan"),
    "Plan": ("workbench.plan", "Plan"),
    "compare": ("workbench.plan", "compare"),
    "TrainConfig": ("workbench.train", "TrainConfig"),
    "Trainer": ("workbench.train", "Trainer"),
    "launch": ("workbench.launch", "launch"),
    "Job": ("workbench.launch", "Job"),
    "show": ("workbench.widgets", "show"),
    "exercise": ("workbench.exercises", "exercise"),
    "models": ("workbench.models", None),
    "runs": ("workbench.runs", None),
    "data": ("workbench.data", None),
    "train": ("workbench.train", None),
}

__all__ = sorted(_EXPORTS)


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


class _CallableSubmodule(_types.ModuleType):
    """A submodule that is also its same-named public function (``workbench.layout``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, self.__name__.rpartition(".")[2])(*args, **kwargs)


class _Package(_types.ModuleType):
    """Importing ``workbench.layout`` makes Python set ``workbench.layout`` to the module,
    shadowing the public function ``wb.layout``; such a module is made callable instead,
    so ``wb.layout(...)``, ``wb.plan(...)`` work whichever import came first."""

    def __setattr__(self, name: str, value: Any) -> None:
        export = _EXPORTS.get(name)
        if (export == (f"{__name__}.{name}", name) and isinstance(value, _types.ModuleType)
                and type(value) is _types.ModuleType):
            value.__class__ = _CallableSubmodule
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from workbench import data, models, runs, train
    from workbench.devices import DeviceInfo, devices, peak_flops, simulate_devices
    from workbench.exercises import exercise
    from workbench.launch import Job, launch
    from workbench.layout import Layout, layout
    from workbench.mesh import MeshInfo, abstract_mesh, make_mesh
    from workbench.plan import Plan, compare, plan
    from workbench.rules import Rules
    from workbench.train import TrainConfig, Trainer
    from workbench.widgets import show
