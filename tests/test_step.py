"""The train step: sharded init, state shardings, sharded step == single-device step."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.models import GPTConfig
from workbench._sharding.rules import Rules
from workbench._step import init_state, jit_train_step, lm_loss, make_train_step
from workbench._train_state import (TrainState, abstract_model, abstract_state,
                                    abstract_train_state, batch_shardings, state_shardings)

from _tolerance import assert_close_at_scale

CFG = GPTConfig.preset("tiny", n_layers=1, seq_len=32)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _numpy_state(tx, seed=0):
    """A TrainState with random numpy weights (no PRNG init to compile; init_state has its
    own test)."""
    graphdef, abstract, _ = abstract_model(CFG)
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda x: jnp.asarray(
        rng.standard_normal(x.shape) / np.sqrt(x.shape[0]), x.dtype), abstract)
    return graphdef, TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                opt_state=jax.jit(tx.init)(params))


def _batch(seed=1, b=8, t=32):
    tok = jax.random.randint(jax.random.key(seed), (b, t + 1), 0, CFG.vocab_size)
    return {"inputs": tok[:, :-1], "targets": tok[:, 1:]}


def test_abstract_state_allocates_nothing_and_carries_shardings(mesh):
    rules = Rules.preset("fsdp_tp", mesh)
    _graphdef, st = abstract_state(GPTConfig.preset("70b", scan_layers=False), optax.adamw(1e-4), rules, mesh)
    q = st.params["blocks"][0]["attn"]["q"]
    assert isinstance(q, jax.ShapeDtypeStruct) and q.shape == (8192, 64, 128)
    assert q.sharding.spec == P("data", "model", None)
    mu = st.opt_state[0].mu["blocks"][0]["attn"]["q"]
    assert mu.sharding.spec == P("data", "model", None)
    assert st.opt_state[0].count.sharding.spec == P()


def test_init_state_places_every_shard_and_matches_state_shardings(mesh):
    rules = Rules.preset("fsdp_tp", mesh)
    tx = optax.adamw(1e-3)
    _, state = init_state(CFG, tx, rules, mesh, seed=0)
    want = state_shardings(CFG, tx, rules, mesh)
    for got, w in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True):
        assert got.sharding.is_equivalent_to(w, got.ndim)
    up = state.params["blocks"][0]["mlp"]["up"]                     # (64, 256) on (data, model)
    assert {s.data.shape for s in up.addressable_shards} == {(16, 128)}
    # same values as an unsharded init with the same seed
    _, ref = init_state(CFG, tx, Rules.preset("dp", mesh), mesh, seed=0)
    np.testing.assert_array_equal(np.asarray(up), np.asarray(ref.params["blocks"][0]["mlp"]["up"]))


@pytest.mark.slow
def test_sharded_steps_match_single_device_steps(mesh):
    """3 AdamW steps under fsdp_tp on 8 devices vs plain jit on one: losses within 1e-5."""
    tx = optax.adamw(1e-2)
    one = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
    results = []
    for m, rules in ((mesh, Rules.preset("fsdp_tp", mesh)), (one, Rules.preset("dp", one))):
        graphdef, start = _numpy_state(tx)          # same seed: same weights (donated below)
        shardings = state_shardings(CFG, tx, rules, m)
        state = jax.device_put(start, shardings)
        step = jit_train_step(make_train_step(graphdef, tx, rules=rules, mesh=m),
                              shardings, batch_shardings(rules, m))
        losses = []
        for i in range(3):
            state, metrics = step(state, _batch())
            losses.append(float(metrics["loss"]))
        results.append((losses, float(metrics["grad_norm"]), state))
    (l8, g8, s8), (l1, g1, s1) = results
    # losses and the last gradient's norm (a sum of squares: positive terms, dominated by
    # the large gradients) after reordered sums compounding over 3 steps: 80 eps (see
    # _tolerance; seen: equal to 1e-9)
    np.testing.assert_allclose(l8, l1, rtol=1e-5)
    np.testing.assert_allclose(g8, g1, rtol=1e-5)
    assert l8[2] < l8[0]
    assert int(s8.step) == 3
    # Adam divides by sqrt(nu): reordered float32 reductions move near-zero grads by ~1e-6
    assert_close_at_scale(s8.params["embed"], s1.params["embed"], rtol=1e-4)


@pytest.mark.slow
def test_loss_and_grad_norm_match_optax_reference():
    graphdef, state = _numpy_state(optax.sgd(0.1))
    batch = _batch()
    _, metrics = jax.jit(make_train_step(graphdef, optax.sgd(0.1)))(state, batch)

    @jax.jit
    def reference(params, batch):
        model = nnx.merge(graphdef, params)
        logits = model(batch["inputs"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        grads = jax.grad(lambda p: lm_loss(nnx.merge(graphdef, p), batch))(params)
        sq = sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads))
        tok = jnp.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
        mask = jnp.zeros(batch["inputs"].shape).at[:, :4].set(1.0)
        return (ce.mean(), jnp.sqrt(sq), lm_loss(model, {"tokens": tok}),
                lm_loss(model, {**batch, "mask": mask}), ce[:, :4].mean())

    ce, norm, from_tokens, masked, ce_first4 = reference(state.params, batch)
    np.testing.assert_allclose(metrics["loss"], ce, rtol=1e-6)
    np.testing.assert_allclose(metrics["grad_norm"], norm, rtol=1e-5)
    np.testing.assert_allclose(from_tokens, ce, rtol=1e-6)
    np.testing.assert_allclose(masked, ce_first4, rtol=1e-6)


def _one():
    return jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])


def test_multisteps_state_is_sharded_like_params(mesh):
    rules = Rules.preset("fsdp", mesh)
    tx = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2)
    sh = state_shardings(CFG, tx, rules, mesh)
    assert isinstance(sh, TrainState)
    acc = sh.opt_state.acc_grads["blocks"][0]["mlp"]["down"]
    assert acc == NamedSharding(mesh, P(None, ("data", "model")))
    assert sh.opt_state.inner_opt_state[0].nu["embed"].spec == P(None, ("data", "model"))
    assert sh.opt_state.mini_step.spec == P()


def test_strict_rules_error_names_tensor(mesh):
    with pytest.raises(KeyError, match="'kv_heads' of 'blocks.0.attn.k'"):
        state_shardings(CFG, optax.sgd(0.1), Rules(batch="data", embed=None, heads="model",
                                                   mlp="model", vocab="model", head_dim=None),
                        mesh)


def test_batch_shardings_split_tokens_along_seq_and_features_never(mesh):
    """Tokens (int, rank >= 2) are (batch, seq); float features and labels only batch."""
    rules = Rules.preset("dp", mesh).replace(batch="data", seq="model")
    lm = batch_shardings(rules, mesh)
    assert lm == {k: NamedSharding(mesh, P("data", "model")) for k in ("inputs", "targets")}
    example = {"x": jax.ShapeDtypeStruct((16, 32), jnp.float32),
               "y": jax.ShapeDtypeStruct((16,), jnp.int32),
               "tokens": jax.ShapeDtypeStruct((16, 33), jnp.int32)}
    got = {k: v.spec for k, v in batch_shardings(rules, mesh, example=example).items()}
    assert got == {"x": P("data", None), "y": P("data"), "tokens": P("data", "model")}


def test_non_strict_state_replicates_and_lists_unmapped_axes(mesh):
    rules = Rules(batch="data", embed=None, heads="model", mlp="model", vocab="model",
                  head_dim=None)                                  # no rule for kv_heads
    st = abstract_train_state(CFG, optax.adam(1e-3), rules, mesh, strict=False)
    assert st.unmapped == {"kv_heads": ["blocks.0.attn.k", "blocks.0.attn.v"]}
    k = st.state.params["blocks"][0]["attn"]["k"]
    assert k.sharding.spec == P(None, None, None)
    assert st.logical["opt_state.0.mu.blocks.0.attn.q"] == ("embed", "heads", "head_dim")
    assert st.state.opt_state[0].mu["blocks"][0]["attn"]["q"].sharding.spec == \
        P(None, "model", None)
    assert "opt_state.0.count" not in st.logical and st.state.opt_state[0].count.sharding.spec == P()
