"""``show(obj)``: the view of an object, picked by its type (the implementation of
:mod:`workbench.widgets`)."""
from __future__ import annotations

import sys
from typing import Any

from workbench import _display

#: What draws each class: its path (the package exporting it, or the module defining it;
#: see ``_display.matches``) -> {kind: "module:function"}. Registered with the display hook
#: when this package is imported, so no core module names a view.
VIEWS: dict[str, dict[str, str]] = {
    "jax.sharding.Mesh": {"widget": "workbench.widgets._mesh_view:mesh_widget"},
    "jax.sharding.AbstractMesh": {"widget": "workbench.widgets._mesh_view:mesh_widget"},
    "workbench._sharding.MeshInfo": {"widget": "workbench.widgets._mesh_view:mesh_widget"},
    "workbench._sharding.Layout": {"widget": "workbench.widgets._layout_view:layout_widget"},
    "workbench.hardware.DeviceInfo": {"widget": "workbench.widgets._devices_view:devices_widget"},
    "workbench.hardware.DeviceInventory": {
        "widget": "workbench.widgets._devices_view:devices_widget"},
    "workbench.models.Schedule": {"widget": "workbench.widgets._schedule_view:schedule_widget"},
    "workbench.perf.ProfileReport": {"widget": "workbench.widgets._profile_view:profile_widget"},
    "workbench.planning.Plan": {"widget": "workbench.widgets._plan_view:plan_widget"},
    "workbench.planning.Comparison": {"widget": "workbench.widgets._plan_view:compare_widget",
                                      "figure": "workbench.widgets._plan_view:compare_figure"},
    "workbench._search.SearchResult": {"widget": "workbench.widgets._search_view:search_widget",
                                       "figure": "workbench.widgets._search_view:search_figure"},
    "workbench.exercises.Exercise": {"widget": "workbench.widgets._exercise_view:exercise_widget"},
    "workbench.train.Trainer": {"widget": "workbench.widgets._train_panel:train_widget"},
    "workbench.jobs.Job": {"widget": "workbench.widgets._job_view:job_widget"},
}
#: The notebook's sinks the core calls (``_display.status_line``, ``_display.text_stream``).
SINKS = {"status_line": "workbench.widgets._show:status_line",
         "text_stream": "workbench.widgets._generation_view:stream_widget"}

for _path, _kinds in VIEWS.items():
    for _kind, _target in _kinds.items():
        _display.register_view(_path, _kind, _target)
for _name, _target in SINKS.items():
    _display.register_sink(_name, _target)

# Structural fallbacks, tried in order when no class in the object's MRO has a view.
_ARRAY_VIEW = "workbench.widgets._layout_view:layout_widget"
_DEVICES_VIEW = "workbench.widgets._devices_view:devices_widget"
_TREE_VIEW = "workbench.widgets._tree_view:tree_widget"


def view_for(obj: Any) -> str:
    """The ``"module:function"`` that draws ``obj``."""
    registered = _display.view_target(obj)
    if registered is not None:
        return registered
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
    return _display.resolve(view_for(obj))(obj, **options)


def status_line(text: str) -> Any:
    """One notebook output line showing ``text``; the returned callable replaces its text
    (how ``wb.plan`` says it is compiling, then how long it took)."""
    from IPython.display import display

    handle = display({"text/plain": text}, raw=True, display_id=True)
    return lambda done: handle.update({"text/plain": done}, raw=True)
