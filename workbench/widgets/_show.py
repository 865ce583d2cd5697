"""``show(obj)``: the view of an object, picked by its type (the implementation of
:mod:`workbench.widgets`)."""
from __future__ import annotations

import importlib
import sys
from typing import Any

_VIEWS: dict[str, str] = {
    "jax.sharding.Mesh": "workbench.widgets._mesh_view:mesh_widget",
    "jax.sharding.AbstractMesh": "workbench.widgets._mesh_view:mesh_widget",
}

# Structural fallbacks, tried in order when no class in the object's MRO is in _VIEWS.
_ARRAY_VIEW = "workbench.widgets._layout_view:layout_widget"
_DEVICES_VIEW = "workbench.widgets._devices_view:devices_widget"
_TREE_VIEW = "workbench.widgets._tree_view:tree_widget"


def _matches(cls: type, key: str) -> bool:
    """Whether ``cls`` is the class named by ``key`` ("pkg.mod.Name"), without importing.

    The class may be defined in a submodule of ``pkg.mod`` (``workbench.train._trainer``)
    or re-exported by it (``jax.sharding.Mesh`` is defined in ``jax._src.mesh``).
    """
    module, _, name = key.rpartition(".")
    if cls.__qualname__ == name and (cls.__module__ == module
                                     or cls.__module__.startswith(module + ".")):
        return True
    loaded = sys.modules.get(module)
    return loaded is not None and getattr(loaded, name, None) is cls


def _resolve(target: str) -> Any:
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)


def view_for(obj: Any) -> str:
    """The ``"module:function"`` that draws ``obj``."""
    own = getattr(type(obj), "_view", None)
    if isinstance(own, str):  # a Workbench object names its view
        return f"workbench.widgets.{own}"
    for cls in type(obj).__mro__:
        for key, target in _VIEWS.items():
            if _matches(cls, key):
                return target
    if hasattr(obj, "sharding") and hasattr(obj, "shape") and hasattr(obj, "dtype"):
        return _ARRAY_VIEW
    if isinstance(obj, (list, tuple)) and obj and all(
            type(d).__name__ == "Device" or _is_jax_device(d) for d in obj):
        return _DEVICES_VIEW
    if _is_tree(obj):
        return _TREE_VIEW
    if hasattr(obj, "shape") and hasattr(obj, "dtype"):
        raise TypeError(
            f"this {type(obj).__name__} of shape {tuple(obj.shape)} has no sharding to draw; "
            "place it with jax.device_put(x, NamedSharding(mesh, spec)), or draw a planned "
            "layout with wb.show(wb.layout(x.shape, spec, mesh))")
    raise TypeError(
        f"wb.show(obj) does not know how to draw a {type(obj).__module__}."
        f"{type(obj).__qualname__}; "
        "it draws meshes, Layouts, sharded arrays, pytrees of arrays, nnx.Modules, "
        "wb.devices(), plans, jobs and trainers")


def _is_jax_device(d: Any) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(d, jax.Device)


def _is_tree(obj: Any) -> bool:
    if isinstance(obj, (dict, list, tuple)):
        return True
    flax_nnx = sys.modules.get("flax.nnx")
    if flax_nnx is not None and isinstance(obj, (flax_nnx.Module, flax_nnx.State)):
        return True
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    leaves = jax.tree_util.tree_leaves(obj)
    return bool(leaves) and not (len(leaves) == 1 and leaves[0] is obj)


def show(obj: Any, **options: Any) -> Any:
    """A widget for ``obj``: mesh, Layout, sharded array, pytree / ``nnx.Module``, devices,
    plan, job or trainer. Keyword options go to the view (e.g. ``dims=(0, 2)`` for a
    layout, ``rules=`` for a model).

    Example::

        mesh = wb.make_mesh(data=4, model=2)
        wb.show(mesh)
        wb.show(wb.layout((64, 2048, 12288), ("data", None, "model"), mesh), dims=(0, 2))
        wb.show(model, rules=wb.Rules(embed="data", mlp="model"))
    """
    return _resolve(view_for(obj))(obj, **options)


def status_line(text: str) -> Any:
    """One notebook output line showing ``text``; the returned callable replaces its text
    (how ``wb.plan`` says it is compiling, then how long it took)."""
    from IPython.display import display

    handle = display({"text/plain": text}, raw=True, display_id=True)
    return lambda done: handle.update({"text/plain": done}, raw=True)
