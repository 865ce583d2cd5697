"""Any Flax NNX module: the Flax sharding guide's model planned, shown, materialised and
trained without a user-entered mesh context or Rules; errors for bad annotations."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import workbench as wb
from workbench.any_model._spec import UnknownAxesError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import DotReluDot  # noqa: E402  (the guide's model, with its activation constraint)

pytestmark = pytest.mark.usefixtures("wb_cache")

D = 64


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


EXAMPLE = {k: jax.ShapeDtypeStruct((16, D), jnp.float32) for k in ("x", "y")}


@pytest.fixture(scope="module")
def mesh():
    return wb.make_mesh(data=2, model=4)


def _guide(rngs):
    return DotReluDot(D, rngs)


def test_guide_model_plans_without_rules_or_mesh_context(mesh):
    plan = wb.plan(_guide, mesh=mesh, batch=16, example_batch=EXAMPLE, loss_fn=mse,
                   progress=False)
    assert plan.source == "cpu-compiler"
    # The reference: the Flax guide's own way, eager sharding inside the user's mesh.
    with jax.set_mesh(mesh):
        ref = DotReluDot(D, nnx.Rngs(0))
        ref_specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(ref, nnx.Param)))
    mine = jax.tree.map(lambda s: s.spec, plan.shardings.params)
    assert jax.tree.map(tuple, mine) == jax.tree.map(tuple, ref_specs)
    # the batch goes over the data axis only (the guide's P('data', ...) activations)
    assert plan.batch_shardings["x"].spec == P("data", None)
    assert not [w for w in plan.warnings if w.kind in ("unmapped", "unannotated")]
    model = plan.materialize(seed=0)
    assert model.dot1.kernel[...].sharding.spec == P(None, "model")
    assert model.w2[...].sharding.spec == P("model", None)
    # materialised values equal the unsharded init from the same key
    with nnx.use_eager_sharding(False):   # unsharded, on one device
        unsharded = DotReluDot(D, nnx.Rngs(params=jax.random.key(0)))
    plain = nnx.to_pure_dict(nnx.state(unsharded, nnx.Param))
    got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 got, plain)
    # one step of the compiled plan equals the unsharded step
    batch = {k: jax.random.normal(jax.random.key(i), (16, D)) for i, k in enumerate("xy")}
    state = plan.init_state(seed=0)
    _, metrics = plan.train_step()(state, {k: jax.device_put(v, plan.batch_shardings[k])
                                           for k, v in batch.items()})
    with jax.set_mesh(mesh):  # the guide's constraint names the mesh's axes
        want = jax.jit(mse)(unsharded, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(want), rtol=1e-5)


def test_guide_model_inside_user_mesh_context(mesh):
    with jax.set_mesh(mesh):
        plan = wb.plan(_guide, mesh=mesh, batch=16, example_batch=EXAMPLE, loss_fn=mse,
                       progress=False)
    assert plan.shardings.params["w2"].spec == P("model", None)


def test_show_draws_the_guide_plan(mesh):
    from workbench.widgets._plan_view import PlanView

    plan = wb.plan(_guide, mesh=mesh, batch=16, example_batch=EXAMPLE, loss_fn=mse,
                   progress=False)
    view = wb.show(plan)
    assert isinstance(view, PlanView)
    lay = view.tensors.layouts["params.dot1.kernel"]
    assert lay.spec == ((), ("model",))


def test_logical_names_without_rules_say_which_rules_to_add(mesh):
    class Logical(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jnp.zeros((D, D)), out_sharding=("hidden_in", "mlp"))

        def __call__(self, x):
            return x @ self.w[...]

    with pytest.raises(UnknownAxesError) as err:
        wb.plan(Logical, mesh=mesh, batch=16, example_batch=EXAMPLE, loss_fn=mse)
    msg = str(err.value)
    assert "'hidden_in'" in msg and "hidden_in=" in msg and "'w'" in msg
    assert "'mlp'" not in msg.split("known")[0]          # mlp has a default rule
    # with the rule it plans, sharded as the rule says
    plan = wb.plan(Logical, mesh=mesh, batch=16, example_batch=EXAMPLE, loss_fn=mse,
                   rules=wb.Rules(batch="data", hidden_in="data", mlp="model"), progress=False)
    assert plan.shardings.params["w"].spec == P("data", "model")


def test_annotation_naming_an_absent_mesh_axis(mesh):
    class Tensor(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "tensor"))
            self.l = nnx.Linear(D, D, kernel_init=init, rngs=rngs)

        def __call__(self, x):
            return self.l(x)

    with pytest.raises(UnknownAxesError) as err:
        wb.plan(Tensor, mesh=mesh, batch=16, example_batch=EXAMPLE, loss_fn=mse)
    assert "'tensor'" in str(err.value) and "('data', 'model')" in str(err.value)


def test_unannotated_module_is_replicated_with_a_lint(mesh):
    class Plain(nnx.Module):
        def __init__(self, rngs):
            self.l = nnx.Linear(D, D, rngs=rngs)

        def __call__(self, x):
            return self.l(x)

    plan = wb.plan(Plain, mesh=mesh, batch=16, example_batch=EXAMPLE, loss_fn=mse,
                   progress=False)
    assert all(all(a is None for a in s.spec) for s in jax.tree.leaves(
        plan.shardings.params, is_leaf=lambda x: isinstance(x, NamedSharding)))
    lint = [w for w in plan.warnings if w.kind == "unannotated"]
    assert len(lint) == 1 and set(lint[0].paths) == {"params.l.kernel", "params.l.bias"}
    kernel = D * D * 4 + D * 4
    assert plan.memory["params"] == kernel      # every device holds all of it


def test_forward_failing_on_the_batch_names_keys_and_shapes(mesh):
    with pytest.raises(ValueError, match=r"\{z: float32\[16, 64\]\}.*KeyError"):
        wb.plan(_guide, mesh=mesh, batch=16, example_batch={"z": EXAMPLE["x"]}, loss_fn=mse)


@pytest.mark.tpu
def test_guide_model_on_an_abstract_meshes():
    est = wb.plan(_guide, mesh=wb.abstract_mesh("v5p-1024", data=-1, model=4), batch=1024,
                  example_batch={k: jax.ShapeDtypeStruct((1024, D), jnp.float32)
                                 for k in "xy"}, loss_fn=mse, compile=False, progress=False)
    assert est.source == "estimate"
    assert est.layouts["params.w2"].spec == (("model",), ())
    tpu = wb.plan(_guide, mesh=wb.abstract_mesh("v5p-8", data=2, model=2), batch=16,
                  example_batch=EXAMPLE, loss_fn=mse, progress=False)
    assert tpu.source == "tpu-compiler"
    # the TPU program's w2 gradient is reduced over the data axis, as the layout implies
    assert any(c.kind == "all-reduce" and c.axes == ("data",) for c in tpu.collectives)


def _token_loss(model, batch):
    x = jax.nn.one_hot(batch["inputs"], D).mean(1)
    y = jax.nn.one_hot(batch["targets"], D).mean(1)
    return jnp.mean((model(x) - y) ** 2)


def test_trainer_trains_and_resumes_a_factory_model_bitwise(tmp_path):
    spec = wb.any_model.from_nnx(_guide, loss_fn=_token_loss, vocab_size=D, name="dot_relu_dot")
    cfg = wb.TrainConfig(model=spec, mesh={"data": 2, "model": 4}, batch=8, seq=16, steps=4,
                         checkpoint_every=2, data="synthetic",
                         rules=wb.Rules(batch="data", model="model"))
    straight = wb.Trainer(cfg, tmp_path / "a", progress=None)
    straight.run(steps=4)
    assert straight.state.params["w2"].sharding.spec == P("model", None)
    first = wb.Trainer(cfg, tmp_path / "b", progress=None)
    first.run(steps=2)
    again = wb.Trainer(cfg, tmp_path / "b", progress=None)   # the run record's model
    assert again.step == 2
    again.run(steps=4)
    assert again.losses == straight.losses
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 again.state.params, straight.state.params)
    assert straight.losses[-1] < straight.losses[0]
