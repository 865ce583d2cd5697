"""Layouts against JAX's own answers: devices_indices_map, addressable_shards, abstract meshes."""
import math

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

import workbench as wb

MESH_SHAPES = [(8,), (4, 2), (2, 4), (2, 2, 2), (1, 8), (8, 1), (2, 1, 4)]
NAMES = ("a", "b", "c")


@st.composite
def cases(draw, divisible=True):
    mesh_shape = draw(st.sampled_from(MESH_SHAPES))
    names = NAMES[: len(mesh_shape)]
    rank = draw(st.integers(0, 4))
    axes = list(names)
    spec = []
    for _ in range(rank):
        choice = draw(st.integers(0, 2))
        if choice == 0 or not axes:
            spec.append(None)
            continue
        k = draw(st.integers(1, min(2, len(axes))))
        picked = draw(st.permutations(axes))[:k]
        for a in picked:
            axes.remove(a)
        spec.append(picked[0] if k == 1 else tuple(picked))
    sizes = dict(zip(names, mesh_shape))
    shape = []
    for entry in spec:
        parts = 1 if entry is None else math.prod(
            sizes[a] for a in ((entry,) if isinstance(entry, str) else entry))
        if divisible:
            shape.append(parts * draw(st.integers(1, 3)))
        else:
            shape.append(draw(st.integers(0, 2 * parts + 3)))
    # A shorter spec than the rank is allowed: trailing dims are unsplit.
    trim = draw(st.integers(0, len(spec)))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "int8", "float16"]))
    return mesh_shape, names, tuple(shape), tuple(spec[:trim]), dtype


def _mesh(shape, names):
    return wb.make_mesh(dict(zip(names, shape)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_ranges_and_bytes_equal_jax(case):
    mesh_shape, names, shape, spec, dtype = case
    mesh = _mesh(mesh_shape, names)
    lay = wb.layout(shape, P(*spec), mesh, dtype=dtype)
    sharding = NamedSharding(mesh, P(*spec))
    ref = sharding.devices_indices_map(shape)
    for dev, slices in ref.items():
        want = tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(slices, shape))
        assert lay.indices[dev.id] == want
    assert lay.shard_shape == sharding.shard_shape(shape)
    x = jax.device_put(np.zeros(shape, dtype=jax.numpy.dtype(dtype)), sharding)
    for shard in x.addressable_shards:
        assert lay.bytes_per_device[shard.device.id] == shard.data.nbytes
    # replica groups: devices with the same index slices
    by_index = {}
    for dev, slices in ref.items():
        by_index.setdefault(tuple((s.start, s.stop) for s in slices), set()).add(dev.id)
    assert sorted(map(sorted, by_index.values())) == sorted(map(sorted, lay.replica_groups))
    assert lay.replication == len(ref) // len(by_index)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_abstract_mesh_equals_concrete(case):
    mesh_shape, names, shape, spec, dtype = case
    concrete = wb.layout(shape, spec, _mesh(mesh_shape, names), dtype=dtype)
    for m in (wb.abstract_mesh(**dict(zip(names, mesh_shape))), AbstractMesh(mesh_shape, names)):
        abstract = wb.layout(shape, spec, m, dtype=dtype)
        # Same mesh positions hold the same blocks; ids differ (concrete ids follow devices).
        np.testing.assert_array_equal(abstract.starts, concrete.starts)
        np.testing.assert_array_equal(abstract.stops, concrete.stops)
        assert abstract.shard_shape == concrete.shard_shape
        assert abstract.replication == concrete.replication
        sh = NamedSharding(m.abstract if hasattr(m, "abstract") else m, P(*spec))
        assert abstract.shard_shape == sh.shard_shape(shape)


@settings(max_examples=100, deadline=None)
@given(cases(divisible=False))
def test_uneven_dims_pad_like_xla(case):
    """XLA splits a dim of size n into k blocks of ceil(n/k); the last ones hold less or nothing."""
    mesh_shape, names, shape, spec, dtype = case
    lay = wb.layout(shape, spec, _mesh(mesh_shape, names), dtype=dtype)
    itemsize = jax.numpy.dtype(dtype).itemsize
    for d, (n, k) in enumerate(zip(shape, lay.partitions)):
        c = -(-n // k)
        assert lay.shard_shape[d] == c
        for row in range(lay.n_devices):
            b = lay.block_index[row, d]
            assert (lay.starts[row, d], lay.stops[row, d]) == (min(b * c, n), min(b * c + c, n))
    held = sum(lay.bytes_per_device.values())
    assert held == lay.total_bytes * lay.replication
    assert lay.padding_waste == lay.padded_bytes_per_device * lay.n_devices - held


def test_large_abstract_mesh_hand_count():
    mesh = wb.abstract_mesh(data=512, model=8)  # 4096 devices
    lay = wb.layout((8192, 28672), ("data", "model"), mesh, dtype="bfloat16")
    assert lay.shard_shape == (16, 3584)
    assert lay.padded_bytes_per_device == 16 * 3584 * 2
    assert lay.indices[4095] == ((8176, 8192), (25088, 28672))
    rep = wb.layout((8192, 28672), (None, "model"), mesh, dtype="bfloat16")
    assert rep.replication == 512 and len(rep.replica_groups) == 8
    assert rep.replica_groups[1][:3] == (1, 9, 17)


def test_live_array_layout():
    mesh = wb.make_mesh(data=4, model=2)
    x = jax.device_put(np.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("model", "data")))
    lay = wb.layout(x)
    for shard in x.addressable_shards:
        want = tuple((s.start, s.stop) for s in shard.index)
        assert lay.indices[shard.device.id] == want
    single = wb.layout(jax.numpy.ones((3, 5)))
    assert single.replication == 1 and list(single.indices.values()) == [((0, 3), (0, 5))]


@pytest.mark.parametrize("shape, spec, needle", [
    ((4, 4), ("data", "data"), "mesh axis 'data' shards both dim 0 and dim 1 of 'w'"),
    ((4,), ("data", None), "has 2 entries but 'w' has rank 1"),
    ((4,), ("dta",), "unknown mesh axis 'dta' in the spec of 'w' (dim 0)"),
])
def test_bad_specs_name_tensor_axis_and_fix(shape, spec, needle):
    mesh = wb.make_mesh(data=4, model=2)
    with pytest.raises(ValueError) as err:
        wb.layout(shape, spec, mesh, name="w")
    assert needle in str(err.value)


@pytest.mark.parametrize("shape, spec, needle", [
    ((64, 8), "data", "spec='data' for 'w' is a bare string, which would be read one character "
                      "per dim (P('d', 'a', 't', 'a')); a spec has one entry per tensor dim: "
                      "write P('data') or ('data',)"),
    ((64.7, 8), ("data",), "wb.layout of 'w': shape[0]=64.7 is a float; shape[0] must be an "
                           "integer >= 0: pick shape[0]=64 or shape[0]=65"),
    ((64, "8"), None, "shape[1]='8' is a string; shape[1] must be an integer >= 0: write "
                      "shape[1]=8"),
    ((4,), (3,), "entry 3 (dim 0) in the spec of 'w' must be None, a mesh axis name"),
    ((4,), 3, "spec=3 for 'w' must be a PartitionSpec or a tuple"),
])
def test_bare_string_specs_and_non_integer_dims_are_refused(shape, spec, needle):
    mesh = wb.make_mesh(data=4, model=2)
    with pytest.raises(TypeError) as err:
        wb.layout(shape, spec, mesh, name="w")
    assert needle in str(err.value)
    # what the message says to write works, and equals JAX's own sharding
    if isinstance(spec, str):
        lay = wb.layout(shape, P(spec), mesh, name="w")
        want = NamedSharding(mesh, P(spec)).devices_indices_map(shape)
        assert lay.indices == {d.id: tuple((s.start or 0, n if s.stop is None else s.stop)
                                           for s, n in zip(idx, shape))
                               for d, idx in want.items()}


def test_text_form_has_the_numbers():
    mesh = wb.make_mesh(data=4, model=2)
    text = str(wb.layout((64, 2048, 12288), ("data", None, "model"), mesh, dtype="bfloat16"))
    assert "block (16, 2048, 6144) = 384 MiB per device" in text
    assert "replication x1" in text and "devices 7" in text


# -- pytrees (workbench._sharding.pytrees) ---------------------------------------------------------

def test_tree_layouts_equal_jax_shards_and_carry_logical_axes():
    """Every leaf's ranges equal ``devices_indices_map``, bytes per device equal the sum of
    ``addressable_shards``; equal (shape, dtype, spec) leaves share one geometry."""
    from workbench._sharding.pytrees import tree_layouts

    mesh = wb.make_mesh(data=4, model=2, devices=jax.devices()[::-1])   # ids != positions
    sds = lambda shape, spec, dtype=np.float32: jax.ShapeDtypeStruct(
        shape, dtype, sharding=NamedSharding(mesh, spec))
    tree = {"w": sds((8, 64), P("data", "model")), "mu": {"w": sds((8, 64), P("data", "model"))},
            "b": sds((6,), P("model")), "count": sds((), P(), np.int32)}
    tl = tree_layouts(tree, mesh, logical={"w": ("embed", "mlp"), "mu.w": ("embed", "mlp")})
    arrays = jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype), s.sharding), tree)
    per_device: dict[int, int] = {}
    for path, arr in jax.tree_util.tree_flatten_with_path(arrays)[0]:
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        want = {d.id: tuple((s.start or 0, n if s.stop is None else s.stop)
                            for s, n in zip(idx, arr.shape))
                for d, idx in arr.sharding.devices_indices_map(arr.shape).items()}
        assert tl[name].indices == want and tl[name].name == name
        for shard in arr.addressable_shards:
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    ids = np.asarray(tl.mesh.device_ids).reshape(-1).tolist()
    assert dict(zip(ids, tl.bytes_per_device().tolist())) == per_device
    assert tl["mu.w"].logical_axes == ("embed", "mlp") and tl["b"].logical_axes is None
    assert tl.distinct == 3 and not tl.notes                      # w and mu.w share one
    with pytest.raises(KeyError, match="no tensor 'x' in this tree"):
        tl["x"]
