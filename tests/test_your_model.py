"""A non-token model (an MLP classifier of synthetic images) planned with wb.plan and
trained by the Trainer through Trainer.from_plan: its images and labels are made from the
Trainer's token batch by its loss_fn (docs/your_model.md); the reference is the same spec
trained through TrainConfig(model=spec), and the plan's layouts are the trained state's."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import workbench as wb

pytestmark = pytest.mark.usefixtures("wb_cache")

SIDE, CLASSES, HIDDEN, VOCAB = 8, 4, 128, 256


class MLPClassifier(nnx.Module):
    """Images (B, 8, 8) -> class logits; the hidden layer split over the 'model' mesh axis."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(SIDE * SIDE, HIDDEN, rngs=rngs,
                             kernel_init=nnx.with_partitioning(init, (None, "model")))
        self.down = nnx.Linear(HIDDEN, CLASSES, rngs=rngs,
                               kernel_init=nnx.with_partitioning(init, ("model", None)))

    def __call__(self, images):
        return self.down(jax.nn.relu(self.up(images.reshape(images.shape[0], -1))))


def images_and_labels(batch):
    """The token rows of wb.data.SyntheticData ((a + b t) mod V) as 8x8 images in [0, 1)
    and the class of each (the brightness quartile of its first pixel)."""
    tokens = batch["inputs"]
    images = tokens[:, :SIDE * SIDE].reshape(-1, SIDE, SIDE).astype(jnp.float32) / VOCAB
    labels = tokens[:, 0] * CLASSES // VOCAB
    return images, labels


def classify_loss(model, batch):
    images, labels = images_and_labels(batch)
    logits = model(images).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))


SPEC = wb.any_model.from_nnx(MLPClassifier, name="mlp_classifier", loss_fn=classify_loss,
                          vocab_size=VOCAB)


@pytest.mark.slow
def test_image_classifier_planned_and_trained_from_its_plan(tmp_path):
    mesh = wb.make_mesh(data=2, model=4)
    plan = wb.plan(SPEC, mesh=mesh, batch=16, seq=SIDE * SIDE, progress=False)
    assert plan.source == "cpu-compiler"
    assert plan.layouts["params.up.kernel"].spec == ((), ("model",))
    opt = wb.train.AdamW(lr=3e-2, warmup_steps=0)
    trainer = wb.Trainer.from_plan(plan, tmp_path / "plan", steps=10, data="synthetic",
                                   optimizer=opt, progress=None)
    trainer.run()
    # the reference: the same spec, mesh and rules through TrainConfig
    cfg = wb.TrainConfig(model=SPEC, mesh=dict(mesh.shape), rules=plan.rules, batch=16,
                         seq=SIDE * SIDE, steps=10, data="synthetic", optimizer=opt,
                         checkpoint_every=20, keep=3, seed=0)
    ref = wb.Trainer(cfg, tmp_path / "ref", progress=None)
    ref.run()
    assert trainer.losses == ref.losses
    assert trainer.losses[-1] < trainer.losses[0]
    # the trained state is laid out as planned
    assert trainer.state.params["up"]["kernel"].sharding.spec == P(None, "model")
    assert trainer.state.params["down"]["kernel"].sharding.spec == P("model", None)
    jax.tree.map(lambda s, a: np.testing.assert_equal(s, a.sharding.spec),
                 jax.tree.map(lambda s: s.spec, plan.shardings.params),
                 trainer.state.params)
    # the first loss is the unsharded loss of the model the trainer started from
    first = wb.Trainer.from_plan(plan, tmp_path / "first", steps=1, data="synthetic",
                                 optimizer=opt, progress=None)
    params0 = jax.device_get(first.state.params)
    batch0 = {k: np.asarray(v) for k, v in next(iter(_batches(first))).items()}
    model0 = nnx.merge(nnx.graphdef(SPEC(nnx.Rngs(0))), params0)
    first.parts.data.set_state(first.parts.initial_data_state)
    first.run()
    np.testing.assert_allclose(first.losses[0], float(classify_loss(model0, batch0)),
                               rtol=1e-5)


def _batches(trainer):
    """The trainer's data iterator from its initial state (the first global batch)."""
    data = trainer.parts.data
    data.set_state(trainer.parts.initial_data_state)
    return data


def test_from_plan_refuses_a_batch_the_trainer_cannot_feed(tmp_path):
    spec = wb.any_model.from_nnx(
        MLPClassifier, name="images", vocab_size=VOCAB,
        example_batch=lambda b, t: {"images": jax.ShapeDtypeStruct((b, SIDE, SIDE), jnp.float32),
                                    "labels": jax.ShapeDtypeStruct((b,), jnp.int32)},
        loss_fn=lambda m, b: jnp.mean(m(b["images"])))
    plan = wb.plan(spec, mesh=wb.make_mesh(data=2, model=4), batch=8, compile=False,
                   progress=False)
    with pytest.raises(ValueError, match=r"images: float32\[8, 8, 8\].*token batches"):
        wb.Trainer.from_plan(plan, tmp_path / "x", progress=None)
    assert not (tmp_path / "x").exists()


def test_from_plan_of_a_bare_factory_needs_vocab_size(tmp_path):
    plan = wb.plan(MLPClassifier, mesh=wb.make_mesh(data=2, model=4), batch=8,
                   seq=SIDE * SIDE, loss_fn=classify_loss, compile=False, progress=False)
    with pytest.raises(ValueError, match="no vocab_size"):
        wb.Trainer.from_plan(plan, tmp_path / "y", progress=None)


def image_loss(model, batch):
    logits = model(batch["images"]).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits),
                                         batch["labels"][:, None], 1))


@pytest.mark.slow
def test_image_batches_through_the_plans_own_step():
    """Real image batches (no token data): plan.init_state + plan.train_step, fed with
    batches placed by plan.batch_shardings; the reference is an unsharded optax loop."""
    spec = wb.any_model.from_nnx(
        MLPClassifier, name="images", loss_fn=image_loss,
        example_batch=lambda b, t: {"images": jax.ShapeDtypeStruct((b, SIDE, SIDE), jnp.float32),
                                    "labels": jax.ShapeDtypeStruct((b,), jnp.int32)})
    plan = wb.plan(spec, mesh=wb.make_mesh(data=2, model=4), batch=16, progress=False)
    assert plan.batch_shardings["images"].spec == P("data", None, None)
    rng = np.random.default_rng(0)
    batches = [{"images": rng.random((16, SIDE, SIDE), np.float32),
                "labels": rng.integers(0, CLASSES, 16).astype(np.int32)} for _ in range(3)]
    state = plan.init_state(seed=0)
    params = jax.device_get(state.params)          # the reference starts from the same values
    step = plan.train_step()
    losses = []
    for b in batches:
        state, metrics = step(state, jax.device_put(b, plan.batch_shardings))
        losses.append(float(metrics["loss"]))
    graphdef = nnx.graphdef(spec(nnx.Rngs(0)))
    tx = plan.optimizer
    opt = tx.init(params)
    ref = []
    for b in batches:
        loss, grads = jax.value_and_grad(lambda p: image_loss(nnx.merge(graphdef, p), b))(params)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        ref.append(float(loss))
    np.testing.assert_allclose(losses, ref, rtol=1e-5)


@pytest.mark.slow
def test_penzai_plan_trains_from_plan_like_trainconfig(tmp_path):
    lc = pytest.importorskip("penzai.models.transformer.variants.llamalike_common")
    config = lc.LlamalikeTransformerConfig(
        num_kv_heads=2, query_head_multiplier=2, embedding_dim=64, projection_dim=16,
        mlp_hidden_dim=128, num_decoder_blocks=1, vocab_size=VOCAB, mlp_variant="swiglu",
        tie_embedder_and_logits=False)
    spec = wb.any_model.from_penzai(
        lambda key: lc.build_llamalike_transformer(config, init_base_rng=key), config=config,
        name="pz")
    plan = wb.plan(spec, mesh=wb.make_mesh(data=4, model=2), rules="fsdp_tp", batch=8, seq=16,
                   progress=False)
    opt = wb.train.AdamW(lr=3e-3, warmup_steps=0)
    trainer = wb.Trainer.from_plan(plan, tmp_path / "plan", steps=3, data="synthetic",
                                   optimizer=opt, progress=None)
    trainer.run()
    cfg = wb.TrainConfig(model=spec, mesh={"data": 4, "model": 2}, rules="fsdp_tp", batch=8,
                         seq=16, steps=3, data="synthetic", optimizer=opt, checkpoint_every=20,
                         keep=3, seed=0)
    ref = wb.Trainer(cfg, tmp_path / "ref", progress=None)
    ref.run()
    assert trainer.losses == ref.losses and len(trainer.losses) == 3
