"""Widget payloads built headlessly and compared with JAX: device positions, per-device
blocks (``devices_indices_map``), shard bytes (``addressable_shards``); and ``show`` dispatch."""
from __future__ import annotations

import json
import subprocess
import sys
import types

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from workbench._display import Displayable
from workbench._sharding.layouts import layout
from workbench._sharding.mesh import abstract_mesh, make_mesh, mesh_info
from workbench._sharding.rules import Rules
from workbench.widgets import show, view_for
from workbench.widgets._show import VIEWS
from workbench.widgets._payload import layout_payload, mesh_payload
from workbench._sharding.pytrees import tree_layouts
from workbench.widgets._tree_payload import tree_payload


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(data=4, model=2, devices=jax.devices()[::-1])  # ids != positions


def _slices(index, shape):
    return [(s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape)]


def _check_blocks_against_jax(payload, shape, sharding):
    """Every block's ranges equal JAX's for each device holding it; each device once."""
    ref = sharding.devices_indices_map(shape)
    ids = payload["mesh"]["device_ids"]
    seen = []
    for b in payload["blocks"]:
        for pos in b["positions"]:
            dev = next(d for d in ref if d.id == ids[pos])
            assert _slices(ref[dev], shape) == list(zip(b["start"], b["stop"]))
            seen.append(ids[pos])
    assert sorted(seen) == sorted(d.id for d in ref)


# -- mesh ---------------------------------------------------------------------------------


def test_mesh_payload_positions_match_mesh_devices(mesh):
    p = mesh_payload(mesh)
    assert p["axis_names"] == ["data", "model"] and p["axis_sizes"] == [4, 2]
    for i, dev_id in enumerate(p["device_ids"]):
        coord = np.unravel_index(i, p["axis_sizes"])
        assert mesh.devices[coord].id == dev_id
        assert mesh.devices[coord].process_index == p["process_index"][i]
    assert not p["abstract"] and p["n_hosts"] == 1
    json.dumps(p)


def test_abstract_pod_mesh_payload_carries_chip_coords_and_hosts():
    info = abstract_mesh("v5p-256", data=-1, model=4)
    p = mesh_payload(info)
    assert p["size"] == 128 and p["abstract"] and p["hardware"] == "v5p-256"
    assert p["coords"] == info.coords.reshape(128, 3).tolist()
    assert p["process_index"] == info.process_index.reshape(-1).tolist()
    assert p["n_hosts"] == len(set(p["process_index"])) > 1
    assert p["memory_per_device"] == info.memory_per_device


# -- layout -------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,spec", [
    ((64, 32, 16), ("data", None, "model")),
    ((8, 4), (("data", "model"), None)),
    ((16,), (None,)),
    ((), ()),
    ((4, 8, 2, 6), (None, "data", "model", None)),
])
def test_layout_payload_blocks_equal_devices_indices_map(mesh, shape, spec):
    lay = layout(shape, spec, mesh, dtype="bfloat16")
    p = layout_payload(lay)
    _check_blocks_against_jax(p, shape, NamedSharding(mesh, P(*spec)))
    assert [tuple(b["positions"]) for b in p["blocks"]] == [
        tuple(p["mesh"]["device_ids"].index(i) for i in g) for g in lay.replica_groups]
    assert p["num_shards"] == len(p["blocks"]) and p["replication"] == lay.replication


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_layout_payload_random_cases_equal_jax(data):
    sizes = data.draw(st.sampled_from([(8,), (4, 2), (2, 4), (2, 2, 2)]))
    names = ("a", "b", "c")[:len(sizes)]
    m = make_mesh(dict(zip(names, sizes)))
    rank = data.draw(st.integers(0, 4))
    free = list(names)
    spec = []
    for _ in range(rank):
        k = data.draw(st.integers(0, min(2, len(free))))
        axes = tuple(free.pop(data.draw(st.integers(0, len(free) - 1))) for _ in range(k))
        spec.append(None if not axes else axes[0] if k == 1 else axes)
    parts = [int(np.prod([m.shape[a] for a in ((s,) if isinstance(s, str) else s or ())]))
             for s in spec]
    shape = tuple(k * data.draw(st.integers(1, 3)) for k in parts)
    p = layout_payload(layout(shape, tuple(spec), m))
    _check_blocks_against_jax(p, shape, NamedSharding(m, P(*spec)))


def test_layout_payload_bytes_equal_addressable_shards(mesh):
    x = jax.device_put(np.zeros((16, 6, 8), np.float32), NamedSharding(mesh, P("data", None, "model")))
    p = layout_payload(layout(x))
    ids = p["mesh"]["device_ids"]
    got = {ids[pos]: b["bytes"] for b in p["blocks"] for pos in b["positions"]}
    assert got == {s.device.id: s.data.nbytes for s in x.addressable_shards}
    assert p["padded_bytes_per_device"] == x.addressable_shards[0].data.nbytes
    assert p["total_bytes"] == x.nbytes and p["dtype"] == "float32"


def test_layout_payload_on_2048_abstract_devices():
    lay = layout((8192, 28672), ("data", "model"), abstract_mesh(data=256, model=8), dtype="bfloat16")
    p = layout_payload(lay)
    assert len(p["blocks"]) == 2048 and p["shard_shape"] == [32, 3584]
    assert p["blocks"][9]["start"] == [32, 3584] and p["blocks"][9]["positions"] == [9]


# -- pytrees ------------------------------------------------------------------------------


def test_tree_payload_bytes_and_memory_equal_addressable_shards(mesh):
    specs = {"emb": P("model", "data"), "w": {"up": P("data", "model"), "b": P()},
             "norm": P(None), "x": P(("data", "model"))}
    shapes = {"emb": (32, 8), "w": {"up": (8, 64), "b": (64,)}, "norm": (8,), "x": (16,)}
    tree = jax.tree.map(lambda s, sp: jax.device_put(np.ones(s, np.float32), NamedSharding(mesh, sp)),
                        shapes, specs, is_leaf=lambda x: isinstance(x, tuple))
    p = tree_payload(tree)
    ref_memory: dict[int, int] = {}
    for row, leaf in zip(p["rows"], jax.tree.leaves(tree)):
        shards = leaf.addressable_shards
        assert row["bytes"] == max(s.data.nbytes for s in shards)
        distinct = {tuple(_slices(s.index, leaf.shape)) for s in shards}
        assert row["replication"] == 8 // len(distinct)
        for s in shards:
            ref_memory[s.device.id] = ref_memory.get(s.device.id, 0) + s.data.nbytes
    assert [r["path"] for r in p["rows"]] == ["emb", "norm", "w.b", "w.up", "x"]
    assert dict(zip(p["mesh"]["device_ids"], p["memory"])) == ref_memory
    assert p["totals"]["max_device_bytes"] == max(ref_memory.values())
    assert p["totals"]["params"] == sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(tree))


def _tiny_gpt():
    from flax import nnx

    from workbench.models import GPT, GPTConfig

    return GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0))


def test_nnx_module_rows_carry_logical_axes_and_rules_specs(mesh):
    from flax import nnx

    model = nnx.eval_shape(_tiny_gpt)
    rules = Rules.preset("fsdp_tp", mesh)
    tl = tree_layouts(model, mesh, rules=rules)
    p = tree_payload(tl)
    flat = nnx.to_flat_state(nnx.state(model))
    meta = {".".join(map(str, k)): v.get_metadata()["out_sharding"] for k, v in flat}
    assert {r["path"]: tuple(r["logical"]) for r in p["rows"]} == meta
    for r in p["rows"]:
        want = layout(tuple(r["shape"]), rules.spec(r["logical"]), mesh)
        assert r["spec"] == "P(" + ", ".join(repr(a[0]) if a else "None" for a in want.spec) + ")"
        assert r["bytes"] == max(want.bytes_per_device.values())
    assert tl.distinct < len(p["rows"])  # identical layouts built once


def test_sharded_nnx_module_reads_shardings_from_arrays(mesh):
    from flax import nnx

    model = nnx.eval_shape(_tiny_gpt)  # then real sharded arrays, as materialize() gives
    rules = Rules.preset("fsdp_tp", mesh)
    for _, var in nnx.to_flat_state(nnx.state(model)):
        sharding = rules.sharding(var.get_metadata()["out_sharding"], mesh)
        var.set_value(jax.device_put(np.ones(var.get_value().shape, np.float32), sharding))
    p = tree_payload(model)  # no mesh, no rules: both come from the arrays
    arrays = {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(nnx.state(model))}
    for r in p["rows"]:
        assert r["bytes"] == max(s.data.nbytes for s in arrays[r["path"]].addressable_shards)
    assert p["mesh"]["device_ids"] == mesh_info(mesh).device_ids.reshape(-1).tolist()


def test_rules_plan_an_unsharded_model_and_single_device_arrays_say_where_they_are(mesh):
    from flax import nnx

    model = nnx.eval_shape(_tiny_gpt)
    for _, var in nnx.to_flat_state(nnx.state(model)):  # as after eager init on one device
        var.set_value(jax.device_put(np.ones(var.get_value().shape, np.float32), jax.devices()[0]))
    rules = Rules.preset("fsdp_tp", mesh)
    planned = {r["path"]: r for r in tree_payload(model, mesh=mesh, rules=rules)["rows"]}
    assert planned["lm_head"]["spec"] == "P('data', 'model')" and planned["lm_head"]["note"] is None
    placed = tree_payload(model)  # no rules: where the arrays are now, all on device 0
    assert {r["spec"] for r in placed["rows"]} == {"SingleDeviceSharding"}
    assert placed["memory"] == [sum(r["total"] for r in placed["rows"])]


def test_unsharded_leaves_say_so():
    p = tree_payload({"w": np.zeros((4, 4), np.float32)}, mesh=make_mesh(data=8))
    assert p["rows"][0]["replication"] == 8 and "no sharding given" in p["rows"][0]["note"]


# -- show ---------------------------------------------------------------------------------


def test_show_dispatches_each_kind(mesh):
    from flax import nnx

    from workbench.hardware import devices
    from workbench.widgets._devices_view import DevicesWidget
    from workbench.widgets._layout_view import LayoutWidget
    from workbench.widgets._mesh_view import MeshWidget
    from workbench.widgets._tree_view import TreeView

    x = jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(mesh, P("data")))
    assert isinstance(show(mesh), MeshWidget) and isinstance(show(mesh_info(mesh)), MeshWidget)
    assert isinstance(show(mesh.abstract_mesh), MeshWidget)
    assert isinstance(show(x), LayoutWidget) and show(x).payload["replication"] == 2
    sds = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh, P(None, "model")))
    assert show(sds).payload["spec"] == [[], ["model"]]
    assert isinstance(show(layout((8,), ("data",), mesh)), LayoutWidget)
    assert isinstance(show(devices()), DevicesWidget) and isinstance(show(jax.devices()), DevicesWidget)
    assert isinstance(show({"a": x}), TreeView)
    assert isinstance(show(nnx.eval_shape(_tiny_gpt), mesh=mesh), TreeView)
    with pytest.raises(TypeError, match="does not know how to draw a builtins.object"):
        show(object())
    with pytest.raises(TypeError, match=r"ndarray of shape \(3,\) has no sharding to draw"):
        show(np.zeros(3))
    single = jax.device_put(np.zeros((4, 2), np.float32), jax.devices()[3])
    assert show(single).payload["blocks"][0]["positions"] == [0]
    assert show(single).payload["mesh"]["device_ids"] == [3]
    with pytest.raises(ValueError, match="no array leaves"):
        show({"a": 1})


def _displayable_classes():
    """Every class in the workbench package that displays itself (``Displayable``)."""
    import importlib
    import pkgutil

    import workbench
    from workbench._display import Displayable

    for m in pkgutil.walk_packages(workbench.__path__, "workbench."):
        if not m.name.startswith(("workbench.server", "workbench.widgets", "workbench.__main__")):
            importlib.import_module(m.name)
    found, todo = set(), [Displayable]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.add(sub)
            todo.append(sub)
    return {c for c in found if c.__module__.startswith("workbench.")}


def test_every_workbench_object_displays_through_its_own_view():
    """One route: each core class has exactly one widget view, registered from the widgets
    side (no core class names one), ``show`` draws it with that function, and outside a
    notebook the bundle is the object's text."""
    from workbench import _display
    from workbench.exercises import exercise

    classes = _displayable_classes()
    names = {c.__name__ for c in classes}
    assert {"MeshInfo", "Layout", "DeviceInventory", "Plan", "Comparison", "Job", "Trainer",
            "Exercise", "SearchResult", "Schedule", "ProfileReport", "DeviceInfo"} <= names, names
    for cls in classes:
        assert "_view" not in vars(cls), cls   # the core names no view
        drawn = next(c for c in cls.__mro__ if any(_display.matches(c, p) for p in VIEWS))
        paths = [p for p in VIEWS if _display.matches(drawn, p)]   # its own, or a base's
        assert len(paths) == 1, (cls, paths)   # one view per class, none ambiguous
        for target in VIEWS[paths[0]].values():
            assert callable(_display.resolve(target)), target
    # every registered workbench path names a class that exists
    assert all(any(_display.matches(c, p) for c in classes)
               for p in VIEWS if p.startswith("workbench."))
    m = make_mesh(data=4, model=2)
    lay = layout((8, 4), ("data", "model"), m)
    ex = exercise("spec_for_block")
    for obj, widget_cls in ((mesh_info(m), "MeshWidget"), (lay, "LayoutWidget"),
                            (ex, "ExerciseView")):
        assert view_for(obj) == _display.view_target(obj) == VIEWS[
            next(p for p in VIEWS if _display.matches(type(obj), p))]["widget"]
        assert type(show(obj)).__name__ == widget_cls == type(obj.widget()).__name__
        assert obj._repr_mimebundle_() == {"text/plain": repr(obj)}  # not in a notebook
    assert view_for(m) == "workbench.widgets._mesh_view:mesh_widget"
    code = ("import sys, workbench.widgets as w; "
            "bad = [m for m in ('anywidget', 'ipywidgets', 'IPython', 'jax', 'workbench.planning') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


class Unseen(Displayable):
    """A displayable class no view is registered for."""


def test_the_hook_finds_views_only_through_what_registers_them():
    """A class with no registered view gets a TypeError naming it and the fix; one
    registered by path (not imported by the registry) draws through its function; the
    root's loader is what makes ``workbench.widgets`` register."""
    import importlib

    from workbench import _display

    with pytest.raises(TypeError, match=r"no widget view is registered for .*Unseen.*register_view"):
        Unseen().widget()
    path = f"{Unseen.__module__}.{Unseen.__qualname__}"
    _display.register_view(path, "widget", "json:dumps")
    try:
        with pytest.raises(TypeError, match="not JSON serializable"):   # json.dumps drew it
            Unseen().widget()
        assert _display.view(Unseen(), "widget") is importlib.import_module("json").dumps
        with pytest.raises(TypeError, match="no figure view"):
            _display.view(Unseen(), "figure")
    finally:
        del _display._VIEWS[path, "widget"]
    code = ("import sys, workbench, workbench._display as d; "
            "assert 'workbench.widgets' not in sys.modules; "
            "assert d.view_target(workbench.make_mesh) is None; "   # a function: no view
            "assert 'workbench.widgets' in sys.modules, 'the loader did not run'; "
            "assert d._SINKS['status_line'].startswith('workbench.widgets.')")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tree_view_draws_a_row_on_demand_and_treescope_lazily(mesh):
    from flax import nnx

    view = show(nnx.eval_shape(_tiny_gpt), mesh=mesh, rules=Rules.preset("fsdp_tp", mesh))
    assert view.layout_view.payload == {} and view.table.treescope_html == ""
    view.table.selected = "blocks.0.attn.q"  # what a click on the row sends
    p = view.layout_view.payload
    ref = layout((64, 4, 16), Rules.preset("fsdp_tp", mesh).spec(("embed", "heads", "head_dim")), mesh)
    assert p["name"] == "blocks.0.attn.q" and p["logical_axes"] == ["embed", "heads", "head_dim"]
    assert p["blocks"] == layout_payload(ref)["blocks"]
    view.table.want_treescope = True
    assert "treescope" in view.table.treescope_html
    assert "blocks.0.attn.q" in repr(view) and "P('data', 'model', None)" in repr(view)


def test_widgets_carry_inlined_esm_and_css_and_text_repr(mesh):
    w = show(mesh)
    assert "./common.js" not in w._esm and "function fmtBytes" in w._esm
    assert ".wb-widget" in w._css and ".wb-mesh-grid" in w._css
    assert repr(w) == str(mesh_info(mesh))
    lay = layout((8, 4), ("data", None), mesh)
    assert repr(show(lay)) == str(lay)


def test_layout_widget_rejects_bad_dims(mesh):
    with pytest.raises(ValueError, match=r"dims=\[0, 0\] must name two different dims of 'w'"):
        show(layout((8, 4), ("data", None), mesh, name="w"), dims=(0, 0))
