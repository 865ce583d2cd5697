"""GPTConfig(scan_layers=True): the stacked, scanned blocks compute the unrolled model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import workbench as wb
from workbench._flops import jaxpr_step_flops
from workbench.models import GPT, GPTConfig
from workbench.models._gpt import stack_blocks, unstack_blocks
from workbench._sharding.rules import Rules
from workbench._step import lm_loss
from workbench._train_state import abstract_model

from _tolerance import assert_close_at_scale, assert_trees_close_at_scale

CFG = GPTConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                d_ff=32, seq_len=8)


def pure_params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def random_params(cfg, seed=0):
    """Random numpy weights in the unrolled layout (norm scales around 1)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def fill(path, x):
        scale = 0.2 if path[-1].key == "scale" else 1 / np.sqrt(x.shape[0])
        base = 1.0 if path[-1].key == "scale" else 0.0
        return jnp.asarray(base + scale * rng.standard_normal(x.shape), x.dtype)

    return jax.tree_util.tree_map_with_path(fill, nnx.to_pure_dict(abstract))


def graph(cfg):
    return nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))[0]


def assert_trees_close(a, b, **tol):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


@pytest.mark.slow
def test_scanned_init_is_the_unrolled_init_stacked():
    """Same Rngs -> block i of the scanned model holds the unrolled block i's weights."""
    unrolled = pure_params(GPT(CFG, rngs=nnx.Rngs(7)))
    scanned = pure_params(GPT(CFG.replace(scan_layers=True), rngs=nnx.Rngs(7)))
    assert scanned["blocks"]["attn"]["q"].shape == (3, 16, 4, 8)
    assert_trees_close(stack_blocks(unrolled), scanned, rtol=0, atol=0)
    assert_trees_close(unstack_blocks(scanned), unrolled, rtol=0, atol=0)


@pytest.mark.parametrize("remat", ["none", "dots", "full"])
@pytest.mark.slow
def test_same_logits_loss_and_gradients(remat):
    """Reference: the unrolled model (checked against plain jax.numpy in test_models)."""
    cfg = CFG.replace(remat=remat)
    params = random_params(cfg, seed=1)
    g_unrolled, g_scanned = graph(cfg), graph(cfg.replace(scan_layers=True))
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def run(g, p):
        logits = nnx.merge(g, p)(batch["inputs"])
        loss, grads = jax.value_and_grad(lambda q: lm_loss(nnx.merge(g, q), batch))(p)
        return logits, loss, grads

    logits0, loss0, grads0 = jax.jit(run, static_argnums=0)(g_unrolled, params)
    logits1, loss1, grads1 = jax.jit(run, static_argnums=0)(g_scanned, stack_blocks(params))
    assert_close_at_scale(logits1, logits0, rtol=1e-5)   # scan reorders nothing but fusions
    np.testing.assert_allclose(float(loss1), float(loss0), rtol=1e-6)
    assert_trees_close_at_scale(unstack_blocks(grads1), grads0, rtol=1e-5)


def test_scan_applies_remat_per_block_and_jaxpr_flops_match():
    """The scanned step's jaxpr is one scan of n_layers over a checkpointed block; matmul
    FLOPs counted in it (scan length multiplied) equal the unrolled model's, remat's
    recompute included."""
    batch = {k: jnp.zeros((2, 8), jnp.int32) for k in ("inputs", "targets")}
    for remat in ("none", "full"):
        counts = []
        for scan in (False, True):
            cfg = CFG.replace(remat=remat, scan_layers=scan)
            g, params, _ = abstract_model(cfg)
            loss = lambda p, b, g=g: lm_loss(nnx.merge(g, p), b)
            counts.append(jaxpr_step_flops(loss, params, batch, 2))
            jaxpr = jax.make_jaxpr(loss)(params, batch).jaxpr
            scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
            assert len(scans) == (1 if scan else 0)
            if scan:
                assert scans[0].params["length"] == cfg.n_layers
                body = str(scans[0].params["jaxpr"])
                assert ("checkpoint" in body or "remat" in body) == (remat == "full")
        assert counts[0].total == counts[1].total and counts[0].forward == counts[1].forward


def test_stacked_params_name_layers_and_every_preset_replicates_it():
    _, _, unrolled = abstract_model(CFG)
    _, _, scanned = abstract_model(CFG.replace(scan_layers=True))
    for path, axes in scanned.items():
        if path.startswith("blocks."):
            assert axes == ("layers", *unrolled[path.replace("blocks.", "blocks.0.", 1)])
        else:
            assert axes == unrolled[path]
    mesh = jax.sharding.AbstractMesh((4, 2), ("data", "model"))
    for name in ("dp", "fsdp", "tp", "fsdp_tp"):
        rules = Rules.preset(name, mesh)
        assert "layers" in rules and rules["layers"] is None
        for path, axes in scanned.items():
            if path.startswith("blocks."):
                want = rules.spec(unrolled[path.replace("blocks.", "blocks.0.", 1)])
                assert tuple(rules.spec(axes)) == (None, *want)


def test_stack_and_unstack_refuse_the_other_layout():
    unrolled = random_params(CFG)
    with pytest.raises(ValueError, match="already be stacked"):
        stack_blocks(stack_blocks(unrolled))
    with pytest.raises(ValueError, match="expects stacked blocks"):
        unstack_blocks(unrolled)
    with pytest.raises(ValueError, match="'blocks' entry"):
        stack_blocks({"embed": unrolled["embed"]})
    with pytest.raises(TypeError, match="scan_layers=.yes. must be True or False"):
        CFG.replace(scan_layers="yes")


@pytest.mark.usefixtures("wb_cache")
@pytest.mark.slow
def test_plan_compiles_with_the_same_memory_and_flops():
    """Same bytes in a different layout: the compiled step's argument bytes (XLA's memory
    analysis) and per-device params/optimizer equal the unrolled plan's."""
    cfg = GPTConfig.preset("tiny")
    mesh = wb.make_mesh(data=4, model=2)
    plans = [wb.plan(cfg.replace(scan_layers=s), mesh=mesh, rules="fsdp_tp", batch=8, seq=64,
                     progress=False) for s in (False, True)]
    unrolled, scanned = plans
    assert scanned.source == unrolled.source == "cpu-compiler"
    for key in ("params", "optimizer", "batch", "arguments"):
        assert scanned.memory[key] == unrolled.memory[key], key
    assert scanned.report.flops.total == unrolled.report.flops.total
    assert not [w for w in scanned.warnings if "unmapped" in str(w).lower()]
    q = scanned.layouts["params.blocks.attn.q"]
    assert q.shape[0] == cfg.n_layers and q.spec[0] == ()
    assert q.spec[1:] == unrolled.layouts["params.blocks.0.attn.q"].spec


@pytest.mark.usefixtures("wb_cache")
@pytest.mark.slow
def test_trainer_trains_the_same_as_unrolled(tmp_path):
    """Same seed, same data: the same initial loss, then the unrolled model's losses up to
    float32 rounding (the partitioner orders the sharded sums differently; Adam's update
    normalises gradients, so the last bits of tiny gradients grow to ~1e-4 in the loss)."""
    base = wb.TrainConfig(model="tiny", mesh={"data": 4, "model": 2}, rules="fsdp_tp",
                          batch=8, seq=32, steps=4, checkpoint_every=4, data="synthetic",
                          optimizer=wb.train.AdamW(lr=1e-2, warmup_steps=1))
    losses = []
    for scan in (False, True):
        cfg = base.replace(model_overrides={"scan_layers": scan})
        tr = wb.Trainer(cfg, run_dir=tmp_path / f"scan{scan}", progress=None)
        tr.run()
        losses.append(tr.losses)
    assert len(losses[1]) == 4 and all(np.isfinite(losses[1]))
    assert losses[1][-1] < losses[1][0]
    np.testing.assert_allclose(losses[1][0], losses[0][0], rtol=1e-6)
    # 4 Adam steps at lr 1e-2 amplify reordered last bits of tiny gradients (seen: 1.0e-4,
    # see _tolerance); a wrong scan already fails the first loss above at 1e-6
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-3)
