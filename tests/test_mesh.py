"""Meshes: sizes, -1 inference, errors, axis types, abstract meshes and hardware presets."""
import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import workbench as wb
from workbench._sharding.mesh import HARDWARE_PRESETS, mesh_info


def test_make_mesh_kwargs_dict_and_infer():
    m = wb.make_mesh(data=4, model=2)
    assert dict(m.shape) == {"data": 4, "model": 2}
    assert m.axis_types == (AxisType.Auto, AxisType.Auto)
    assert dict(wb.make_mesh({"data": -1, "model": 2}).shape) == {"data": 4, "model": 2}
    assert sorted(d.id for d in m.devices.flat) == [d.id for d in jax.devices()]
    ex = wb.make_mesh(data=8, axis_types="explicit")
    assert ex.axis_types == (AxisType.Explicit,)


@pytest.mark.parametrize("axes, needle", [
    ({"data": 4, "model": 4}, "needs 16 devices but 8 devices are available"),
    ({"data": 3, "model": -1}, "cannot infer 'model'"),
    ({"data": -1, "model": -1}, "only one mesh axis may be -1"),
    ({"data": 0}, "mesh axis data=0 is out of range; data must be a positive integer or -1"),
])
def test_make_mesh_errors(axes, needle):
    with pytest.raises(ValueError, match=None) as err:
        wb.make_mesh(axes)
    assert needle in str(err.value)


@pytest.mark.parametrize("kwargs, error, needle", [
    ({"data": True, "devices": "first"}, TypeError, "mesh axis data=True is a bool"),
    ({"data": 2.0}, TypeError, "mesh axis data=2.0 is a float; data must be a positive "
                               "integer or -1: write data=2"),
    ({"data": 2, "devices": "dup"}, ValueError, "devices lists the same device more than "
                                                "once"),
    ({"data": -1, "devices": []}, ValueError, "devices=[] is empty; a mesh needs at least "
                                              "one device"),
    ({"data": 2, "devices": [0, 1]}, TypeError, "devices holds 0 (int), not a JAX device"),
])
def test_make_mesh_refuses_bools_floats_and_bad_device_lists(kwargs, error, needle):
    devs = {"first": jax.devices()[:1], "dup": [jax.devices()[0]] * 2}
    kwargs = dict(kwargs)
    if isinstance(kwargs.get("devices"), str):
        kwargs["devices"] = devs[kwargs["devices"]]
    with pytest.raises(error) as err:
        wb.make_mesh(**kwargs)
    assert needle in str(err.value)


def test_make_mesh_takes_a_device_array_and_numpy_sizes():
    grid = np.array(jax.devices()).reshape(2, 4)
    m = wb.make_mesh(data=np.int64(2), model=-1, devices=grid)
    assert dict(m.shape) == {"data": 2, "model": 4}
    assert sorted(d.id for d in m.devices.flat) == sorted(d.id for d in jax.devices())


def test_dcn_needs_slices_or_processes():
    with pytest.raises(ValueError, match="a DCN axis needs devices from several slices"):
        wb.make_mesh(data=2, model=2, dcn={"data": 2})


def test_mesh_info_of_concrete_mesh():
    m = wb.make_mesh(data=4, model=2)
    info = mesh_info(m)
    assert info.shape == {"data": 4, "model": 2} and info.size == 8
    np.testing.assert_array_equal(info.device_ids, np.vectorize(lambda d: d.id)(m.devices))
    assert info.platform == "cpu" and info.peak_source.startswith("measured")
    assert info.jax_mesh is m and not info.is_abstract


def test_abstract_mesh_presets():
    pod = wb.abstract_mesh("v5p-256", data=-1, model=4)
    assert pod.shape == {"data": 32, "model": 4}  # v5p-256 = 256 TensorCores = 128 chips
    assert pod.device_kind == "TPU v5p" and pod.peak_flops == 459e12
    assert pod.memory_per_device == 95 * 1024**3
    assert pod.coords.shape == (32, 4, 3) and pod.coords.max(axis=(0, 1)).tolist() == [3, 3, 7]
    assert pod.n_hosts == 32  # 4 chips per host
    v2 = wb.abstract_mesh("v2-8", data=8)
    assert v2.size == 8 and v2.n_hosts == 1  # 4 chips x 2 cores
    # v5e/v6e slices up to 8 chips are one VM; larger ones have 4 chips per host.
    assert wb.abstract_mesh("v5e-8", data=8).n_hosts == 1
    assert wb.abstract_mesh("v6e-8", data=8).n_hosts == 1
    assert wb.abstract_mesh("v5e-16", data=16).n_hosts == 4
    gpus = wb.abstract_mesh("2x8xH100", data=2, model=8)
    assert gpus.n_hosts == 2 and gpus.peak_flops == 989e12
    big = wb.abstract_mesh(data=256, model=8)
    assert big.size == 2048 and big.is_abstract
    for name in HARDWARE_PRESETS:
        assert wb.abstract_mesh(name).size >= 1
    with pytest.raises(ValueError, match="unknown hardware preset 'v9-8'"):
        wb.abstract_mesh("v9-8")
    with pytest.raises(ValueError, match="needs 64 devices but 16 v5e-16 devices"):
        wb.abstract_mesh("v5e-16", data=8, model=8)


def test_abstract_multislice_mesh_matches_hybrid_order():
    two = wb.abstract_mesh("v5e-16", data=-1, model=4, dcn={"data": 2})
    one = wb.abstract_mesh("v5e-16", data=4, model=4)
    assert two.shape == {"data": 8, "model": 4} and two.num_slices == 2
    assert two.dcn_axis_sizes == (2, 1) and two.ici_axis_sizes == (4, 4)
    # slice-major along data, as mesh_utils.create_hybrid_device_mesh lays devices out
    np.testing.assert_array_equal(two.coords[:4], one.coords)
    np.testing.assert_array_equal(two.coords[4:], one.coords)
    assert two.n_hosts == 2 * one.n_hosts and "2 slices" in two.describe()
