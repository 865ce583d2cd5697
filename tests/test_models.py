"""GPT and MLP models: forward vs a plain jax.numpy reference, sharded vs unsharded."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding

from workbench.any_model import MLPClassifier
from workbench.models import GPT, PRESETS, GPTConfig
from workbench._sharding.rules import Rules
from workbench._train_state import abstract_model, param_specs

from _tolerance import assert_close_at_scale, assert_trees_close_at_scale


def build(cfg: GPTConfig, seed: int = 0) -> GPT:
    """The model with random numpy weights: the graph from ``nnx.eval_shape``, values from
    numpy (compiling the PRNG init of every test model would dominate these tests' time)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def fill(path, x):
        if path[-1].key == "scale":                           # RMSNorm scales around 1
            return jnp.asarray(1 + 0.2 * rng.standard_normal(x.shape), x.dtype)
        return jnp.asarray(rng.standard_normal(x.shape) / np.sqrt(x.shape[0]), x.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, nnx.to_pure_dict(abstract)))


CFG = GPTConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                d_ff=32, seq_len=8)


def _ref_forward(p: dict, tokens: np.ndarray, cfg: GPTConfig) -> np.ndarray:
    """Plain jax.numpy Llama forward written independently of workbench.models."""
    def rms(x, s):
        return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * s

    def rot(x):  # x: (B, T, n, H); pairs (i, i + H/2) rotate by angle t * theta^(-2i/H)
        h = x.shape[-1]
        ang = jnp.arange(x.shape[1])[:, None] * cfg.rope_theta ** (-jnp.arange(h // 2) * 2 / h)
        c, s = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
        a, b = x[..., : h // 2], x[..., h // 2:]
        return jnp.concatenate([a * c - b * s, a * s + b * c], -1)

    x = p["embed"][tokens]  # (B, T, D)
    t = tokens.shape[1]
    group = cfg.n_heads // cfg.n_kv_heads
    for blk in p["blocks"].values():
        a = blk["attn"]
        h = rms(x, blk["attn_norm"]["scale"])
        q = rot(jnp.einsum("btd,dnh->btnh", h, a["q"]))
        k = jnp.repeat(rot(jnp.einsum("btd,dkh->btkh", h, a["k"])), group, axis=2)
        v = jnp.repeat(jnp.einsum("btd,dkh->btkh", h, a["v"]), group, axis=2)
        s = jnp.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(cfg.head_dim)
        s = jnp.where(np.tril(np.ones((t, t), bool)), s, -jnp.inf)
        y = jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(s, -1), v)
        x = x + jnp.einsum("btnh,nhd->btd", y, a["o"])
        m = blk["mlp"]
        h = rms(x, blk["mlp_norm"]["scale"])
        x = x + (jax.nn.silu(h @ m["gate"]) * (h @ m["up"])) @ m["down"]
    x = rms(x, p["final_norm"]["scale"])
    return x @ (p["embed"].T if cfg.tie_embeddings else p["lm_head"])


@pytest.mark.parametrize("tie", [False, True])
def test_forward_matches_plain_jnp_reference(tie):
    cfg = CFG.replace(tie_embeddings=tie)
    model = build(cfg, 3)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tokens = np.array(jax.random.randint(jax.random.key(0), (2, 8), 0, cfg.vocab_size))
    got = nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens, jnp.int32))
    want = jax.jit(lambda p, t: _ref_forward(p, t, cfg))(params, tokens)
    assert got.shape == (2, 8, cfg.vocab_size)
    assert_close_at_scale(got, want, rtol=1e-5)   # another implementation: another order


def test_causal_logits_ignore_future_tokens():
    model = build(CFG)
    a = jnp.array([[1, 2, 3, 4, 5, 6, 7, 8]], jnp.int32)
    b = a.at[0, 5:].set(9)
    fwd = nnx.jit(lambda m, t: m(t))
    # the same program on rows that see only the same tokens (masked scores weigh exactly
    # 0): equal here bitwise; 1e-6 at the logits' scale only allows ~8 eps of XLA retiling,
    # while a leaking future token moves a logit by a large fraction of that scale
    assert_close_at_scale(fwd(model, a)[0, :5], fwd(model, b)[0, :5], rtol=1e-6)


def test_every_param_names_logical_axes_only():
    _, params, logical = abstract_model(GPTConfig.preset("tiny"))
    known = {"batch", "seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", None}
    assert set(logical) == {".".join(map(str, k)) for k in _flat_keys(params)}
    for name, axes in logical.items():
        assert set(axes) <= known, (name, axes)
    assert logical["blocks.0.attn.q"] == ("embed", "heads", "head_dim")
    assert logical["lm_head"] == ("embed", "vocab")


def _flat_keys(tree, prefix=()):
    for k, v in tree.items():
        yield from (_flat_keys(v, prefix + (k,)) if isinstance(v, dict) else [prefix + (k,)])


def test_presets_param_counts_match_published():
    # published totals: Llama 3.2 1B 1.24B, Llama 2 7B 6.74B, Llama 3 70B 70.6B; GPT-2 small 124M
    counts = {n: GPTConfig.preset(n).n_params for n in PRESETS}
    assert abs(counts["small"] / 124e6 - 1) < 0.01
    assert abs(counts["1b"] / 1.236e9 - 1) < 0.01
    assert abs(counts["7b"] / 6.738e9 - 1) < 0.001
    assert abs(counts["70b"] / 70.554e9 - 1) < 0.001
    model = nnx.eval_shape(lambda: GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0)))
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model))) == counts["tiny"]


def test_config_validation_errors():
    with pytest.raises(ValueError, match="n_heads=6 is not a multiple of n_kv_heads=4"):
        CFG.replace(n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match="unknown GPT preset 'huge'"):
        GPTConfig.preset("huge")
    with pytest.raises(ValueError, match="remat='some'"):
        CFG.replace(remat="some")
    assert GPTConfig.preset("tiny", n_layers=3).n_layers == 3


def test_remat_gives_same_gradients():
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % CFG.vocab_size

    def grads(cfg):
        model = build(cfg)
        return nnx.jit(nnx.grad(lambda m: jnp.mean(m(tokens) ** 2)))(model)

    g0, g1 = grads(CFG), grads(CFG.replace(remat="full"))
    assert_trees_close_at_scale(g1, g0, rtol=1e-5)


def test_sharded_forward_equals_unsharded():
    """fsdp_tp on a 4x2 mesh vs one device: float32 logits agree to 1e-5 (reduction order)."""
    cfg = GPTConfig.preset("tiny")
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    rules = Rules.preset("fsdp_tp", mesh)
    model = build(cfg)
    graphdef, params = nnx.split(model)
    pure = nnx.to_pure_dict(params)
    _, _, logical = abstract_model(cfg)
    specs = param_specs(pure, logical, rules)
    sharded = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), pure, specs)
    tokens = jax.random.randint(jax.random.key(1), (8, 32), 0, cfg.vocab_size)

    def fwd(p, t):
        with rules.activate(mesh):
            return nnx.merge(graphdef, p)(t)

    want = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(pure, tokens)
    got = jax.jit(fwd)(sharded, jax.device_put(tokens, NamedSharding(mesh, rules.spec(
        ("batch", "seq")))))
    assert got.sharding.spec == rules.spec(("batch", "seq", "vocab"))
    assert_close_at_scale(got, want, rtol=1e-5)   # sharded sums: another order


def test_mlp_classifier_learns_and_shards():
    x = jax.random.normal(jax.random.key(0), (64, 8))
    y = (x[:, 0] > 0).astype(jnp.int32)
    clf = nnx.jit(lambda: MLPClassifier(8, (16,), 2, rngs=nnx.Rngs(0)))()
    assert clf(x).shape == (64, 2)
    import optax

    from workbench.any_model import classifier_loss
    opt = nnx.Optimizer(clf, optax.adam(1e-2), wrt=nnx.Param)
    loss0 = classifier_loss(clf, {"x": x, "y": y})
    @nnx.jit
    def step(clf, opt, batch):
        opt.update(clf, nnx.grad(classifier_loss)(clf, batch))

    for _ in range(50):
        step(clf, opt, {"x": x, "y": y})
    assert classifier_loss(clf, {"x": x, "y": y}) < 0.3 * loss0
    logical = {k: v.get_metadata()["out_sharding"] for k, v in nnx.to_flat_state(nnx.state(clf))}
    assert logical[("weights", 0)] == ("embed", "mlp")
