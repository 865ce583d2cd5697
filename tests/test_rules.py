"""Rules: logical -> mesh axes, presets, errors that never replicate silently."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from workbench._sharding.rules import LOGICAL_AXES, Rules, constrain


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def test_spec_maps_names_tuples_and_none():
    r = Rules(batch=("data", "model"), embed=None, mlp="model")
    assert r.spec(("batch", None, "embed")) == P(("data", "model"), None, None)
    assert r.spec(("embed", "mlp")) == P(None, "model")
    assert r["batch"] == ("data", "model") and r["embed"] is None and r["mlp"] == "model"


def test_unmapped_logical_axis_lists_known_names():
    r = Rules(batch="data", embed=None)
    with pytest.raises(KeyError) as e:
        r.spec(("embed", "mlp"), tensor="blocks.0.mlp.up")
    msg = str(e.value)
    assert "'mlp'" in msg and "blocks.0.mlp.up" in msg and "batch, embed" in msg
    assert "mlp=None" in msg  # says how to replicate on purpose
    assert r.spec(("embed", "mlp"), strict=False) == P(None, None)


def test_mesh_axis_used_twice_in_one_tensor_is_an_error():
    r = Rules(embed="model", mlp="model")
    with pytest.raises(ValueError, match=r"mesh axis 'model' shards both dim 0 \('embed'\) "
                                         r"and dim 1 \('mlp'\) of 'w'"):
        r.spec(("embed", "mlp"), tensor="w")
    r2 = Rules(batch=("data", "model"), embed="data")
    with pytest.raises(ValueError, match="'data'"):
        r2.spec(("batch", "embed"))


def test_presets(mesh):
    dp = Rules.preset("dp", mesh)
    assert set(dp) == set(LOGICAL_AXES)
    assert dp["batch"] == ("data", "model") and all(dp[k] is None for k in LOGICAL_AXES[1:])
    fsdp = Rules.preset("fsdp", mesh)
    assert fsdp["embed"] == ("data", "model") and fsdp["mlp"] is None
    tp = Rules.preset("tp", mesh)
    assert tp["batch"] == "data" and tp["heads"] == tp["mlp"] == tp["vocab"] == "model"
    assert tp["embed"] is None
    ft = Rules.preset("fsdp_tp", mesh)
    assert ft.spec(("embed", "heads", "head_dim")) == P("data", "model", None)
    data_only = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    with pytest.raises(ValueError, match="model axis"):
        Rules.preset("tp", data_only)
    with pytest.raises(ValueError, match="unknown rules preset 'zero3'"):
        Rules.preset("zero3", mesh)


def test_immutable_replace_and_json_round_trip():
    r = Rules(batch=("data", "model"), embed=None)
    with pytest.raises(AttributeError):
        r.foo = 1
    r2 = r.replace(embed="data")
    assert r["embed"] is None and r2["embed"] == "data"
    assert Rules.from_dict(r2.to_dict()) == r2
    assert hash(Rules.from_dict(r.to_dict())) == hash(r)


def test_check_mesh_names_the_bad_axis(mesh):
    with pytest.raises(ValueError, match="mesh axis 'tensor'.*\\('data', 'model'\\)"):
        Rules(mlp="tensor").check_mesh(mesh)


def test_constrain_shards_activations_inside_jit(mesh):
    rules = Rules(batch="data", embed="model")

    def f(x):
        return constrain(x * 2.0, ("batch", "embed"))

    x = jnp.ones((8, 4))
    assert constrain(x, ("batch", "embed")) is x   # no active rules: no-op
    with rules.activate(mesh):
        out = jax.jit(f)(x)
    assert out.sharding == NamedSharding(mesh, P("data", "model"))
    np.testing.assert_array_equal(np.asarray(out), 2 * np.ones((8, 4)))
