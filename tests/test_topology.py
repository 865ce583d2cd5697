"""TPU topologies: compile for TPU slices on this machine, against JAX's own TPU compile."""
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import workbench as wb
import workbench._sharding.mesh  # noqa: F401 - wb._sharding.mesh below
from workbench._compiled.hlo import parse_collectives
from workbench._sharding.topology import (topology_name, tpu_compiler_available, tpu_devices,
                                          tpu_target)

needs_libtpu = pytest.mark.skipif(
    not tpu_compiler_available(),
    reason="the TPU compiler (libtpu) is not installed: pip install 'workbench[tpu-compile]'")
pytestmark = pytest.mark.tpu   # libtpu: TPU topologies, lowered and compiled for


def _step(w1, w2, x):
    """A small MLP's loss and gradients: matmuls, a reduction, sharded weight grads."""
    def loss(w1, w2):
        h = jnp.tanh(x @ w1)                       # (B, H)
        return jnp.mean((h @ w2) ** 2)             # (B, D) -> ()
    return jax.value_and_grad(loss, argnums=(0, 1))(w1, w2)


def _compile(mesh):
    shard = (NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P("model", None)),
             NamedSharding(mesh, P("data", None)))
    shapes = (jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16),
              jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16),
              jax.ShapeDtypeStruct((64, 256), jnp.bfloat16))
    return jax.jit(_step, in_shardings=shard).lower(*shapes).compile()


def _reference_mesh(topology, shape):
    """The reference: devices straight from JAX's topology API."""
    from jax.experimental import topologies

    devs = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    grid = np.array(devs).reshape(shape)
    return Mesh(grid, ("data", "model"), axis_types=(AxisType.Auto,) * 2)


@needs_libtpu
@pytest.mark.parametrize("preset, topology, axes", [
    ("v5e-4", "v5e:2x2", {"data": 2, "model": 2}),
    ("v5p-8", "v5p:2x2x1", {"data": 2, "model": 2}),
])
def test_tpu_mesh_compiles_like_jax_itself(preset, topology, axes):
    assert topology_name(preset) == topology
    target = tpu_target(wb.abstract_mesh(preset, **axes))
    assert target.mesh is not None, target.reason
    assert "TPU compiler" in target.reason and target.topology == topology
    assert dict(target.mesh.shape) == axes
    assert all(a == AxisType.Auto for a in target.mesh.axis_types)
    assert {d.platform for d in target.mesh.devices.flat} == {"tpu"}

    ours = _compile(target.mesh)
    ref = _compile(_reference_mesh(topology, tuple(axes.values())))
    mine, theirs = ours.memory_analysis(), ref.memory_analysis()
    for field in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                  "alias_size_in_bytes", "generated_code_size_in_bytes"):
        assert getattr(mine, field) == getattr(theirs, field), field
    assert ours.cost_analysis()["flops"] == ref.cost_analysis()["flops"]
    assert "optimal_seconds" in ours.cost_analysis()  # the TPU compiler's own estimate

    text = ours.as_text()
    assert re.search(r"\{1,0:T\(8,128\)", text), "TPU tiled layouts in the HLO"
    # every collective instruction in the text is reported, with the right count per kind
    found = re.findall(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.+?\s(all-reduce|all-gather|"
                       r"reduce-scatter|all-to-all|collective-permute)(?:-start)?\(",
                       text, flags=re.M)
    reported = parse_collectives(text, tuple(axes), tuple(axes.values()))
    by_kind = {k: sum(c.count for c in reported if c.kind == k) for k in set(found)}
    assert found and by_kind == {k: found.count(k) for k in set(found)}
    grads = [c for c in reported if c.kind == "all-reduce" and c.axes == ("data",)]
    assert grads, "weight gradients are summed over the data axis"


@needs_libtpu
def test_presets_map_to_topologies_the_compiler_accepts():
    for preset, n in [("v5p-256", 128), ("v5e-16", 16), ("v6e-8", 8), ("v5e-1", 1)]:
        devs = tpu_devices(preset)
        assert len(devs) == n and devs[0].platform == "tpu"
    assert topology_name("v5p-256") == "v5p:4x4x8" and topology_name("v6e-256") == "v6e:16x16"
    two = tpu_devices("v5e-4", num_slices=2)
    assert len(two) == 8 and sorted({d.slice_index for d in two}) == [0, 1]


@needs_libtpu
def test_multislice_mesh_puts_slices_on_the_dcn_axis():
    info = wb.abstract_mesh("v5e-4", data=-1, model=2, dcn={"data": 2})
    mesh = tpu_target(info).mesh
    assert mesh is not None and dict(mesh.shape) == {"data": 4, "model": 2}
    slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    assert (slices[:2] == 0).all() and (slices[2:] == 1).all()
    assert wb._sharding.mesh.mesh_info(mesh).dcn_axis_sizes == (2, 1)


@needs_libtpu
def test_unknown_and_unsupported_topologies_say_why():
    with pytest.raises(ValueError, match="v5p-256"):      # lists the valid presets
        tpu_devices("v9-8")
    with pytest.raises(ValueError, match="does not accept the TPU topology 'v5e:3x3'"):
        tpu_devices("v5e:3x3")
    gpu = tpu_target(wb.abstract_mesh("8xH100", data=8))
    assert gpu.mesh is None and "not a TPU slice" in gpu.reason


@needs_libtpu
def test_v4_compiles_in_megacore_mode_like_jax_itself():
    """A v4 chip is one JAX device (megacore), as on a v4 VM: 4 devices for v4-8."""
    from jax.experimental import topologies

    v4 = tpu_target(wb.abstract_mesh("v4-8", data=2, model=2))
    assert v4.mesh is not None and v4.topology == "v4:2x2x1", v4.reason
    assert v4.mesh.devices.size == 4 and {d.device_kind for d in v4.mesh.devices.flat} == {"TPU v4"}
    devs = topologies.get_topology_desc(platform="tpu", topology_name="v4:2x2x1",
                                        chip_config_name="megacore").devices
    ref = Mesh(np.array(devs).reshape(2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    mine, theirs = _compile(v4.mesh).memory_analysis(), _compile(ref).memory_analysis()
    assert mine.temp_size_in_bytes == theirs.temp_size_in_bytes
    assert mine.argument_size_in_bytes == theirs.argument_size_in_bytes


def test_without_libtpu_plans_fall_back_with_a_reason():
    code = ("import sys; sys.modules['libtpu'] = None\n"
            "import workbench as wb\nfrom workbench._sharding.topology import tpu_target\n"
            "t = tpu_target(wb.abstract_mesh('v5p-8', data=4)); print(t.mesh is None, t.reason)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": ""})
    assert out.stdout.startswith("True") and "not installed" in out.stdout, out.stderr


@needs_libtpu
def test_libtpu_stays_quiet_on_a_host_without_tpus():
    """wb.devices() (which keeps libtpu quiet, explicitly: importing changes nothing), then
    jax.devices() and a TPU topology: no noise."""
    code = ("import workbench as wb, jax; wb.devices(); print(jax.devices()[0].platform)\n"
            "from workbench._sharding.topology import tpu_devices\n"
            "print(len(tpu_devices('v5e-4')))")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.stdout.split() == ["cpu", "4"], out.stderr
    assert "TPU accelerator type" not in out.stderr and "E0000" not in out.stderr, out.stderr
