"""Attention implementations: splash (Pallas interpret mode on CPU) computes XLA attention;
sharded under rules presets; bad choices fail before compiling; TPU plans run the kernel."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import workbench as wb
from workbench.models import GPTConfig, _attention as A, _attention_choice as choice
from workbench.perf import _attention_cost as attention_cost
from workbench._sharding.rules import Rules
from workbench._step import init_state, make_train_step

from _tolerance import assert_close_at_scale

B, T, N, K, H = 2, 256, 4, 2, 32


def qkv(seed=0, dtype=jnp.float32, b=B, t=T, n=N, k=K, h=H):
    ks = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(kk, (b, t, heads, h), dtype)
                 for kk, heads in zip(ks, (n, k, k)))


def reference(q, k, v):
    """Causal GQA attention written out in jax.numpy (the textbook formula)."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool))
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", p, v)


@pytest.mark.parametrize("blocks", [(128, 128), (64, 128), (256, 256)])
@pytest.mark.slow
def test_splash_interpret_equals_xla_outputs_and_gradients(blocks):
    q, k, v = qkv()
    ys = A.attend(q, k, v, impl="splash", block_sizes=blocks)
    # blockwise online softmax sums T=256 keys in another order: 80 eps at the output's
    # scale, gradients too (seen: 2 and 4 eps)
    assert_close_at_scale(ys, A.attend(q, k, v, impl="xla"), rtol=1e-5)
    assert_close_at_scale(ys, reference(q, k, v), rtol=1e-5)

    def grads(impl):
        loss = lambda q, k, v: jnp.sum(jnp.sin(A.attend(q, k, v, impl=impl,
                                                        block_sizes=blocks)))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    for gs, gx in zip(grads("splash"), grads("xla"), strict=True):
        assert_close_at_scale(gs, gx, rtol=1e-5)


def test_splash_mqa_and_bfloat16():
    q, k, v = qkv(seed=1, dtype=jnp.bfloat16, k=1)
    ys = A.attend(q, k, v, impl="splash", block_sizes=(128, 128))
    assert ys.dtype == jnp.bfloat16
    ref = reference(*(x.astype(jnp.float32) for x in (q, k, v)))
    # bfloat16 scores, probabilities and output each round to 2^-8 of their value; the
    # weighted sums of up to T values of v err at v's scale, not the element's: one bfloat16
    # eps (2^-7 = 7.8e-3) at the output's scale (seen: 2e-3 of it)
    assert_close_at_scale(ys.astype(jnp.float32), ref, rtol=2 ** -7)


CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                d_ff=64, seq_len=128)


def losses(cfg, mesh, rules, steps=2):
    opt = optax.adam(1e-2)
    graphdef, state = init_state(cfg, opt, rules, mesh, seed=0)
    step = jax.jit(make_train_step(graphdef, opt, rules=rules, mesh=mesh))
    toks = jax.random.randint(jax.random.key(3), (8, cfg.seq_len + 1), 0, cfg.vocab_size)
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
    out = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        out.append(float(metrics["loss"]))
    return out


@pytest.mark.slow
def test_tiny_model_trains_the_same_with_splash():
    """The kernel runs inside shard_map over batch and heads (fsdp_tp)."""
    mesh = wb.make_mesh(data=4, model=2)
    rules = Rules.preset("fsdp_tp", mesh)
    ref = losses(CFG, mesh, rules)
    got = losses(CFG.replace(attention="splash", attention_block_sizes=(128, 128)), mesh,
                 rules)
    np.testing.assert_allclose(got, ref, rtol=2e-5)
    assert ref[-1] < ref[0]


def test_resolve_auto_by_platform():
    assert choice.resolve("auto", "tpu", seq=4096).impl == "splash"
    assert choice.resolve("auto", "gpu", seq=4096).impl == "cudnn"
    assert choice.resolve("auto", "cpu", seq=4096).impl == "xla"
    r = choice.resolve("auto", "tpu", seq=4096, block_sizes=(2048, 2048))
    assert (r.block_q, r.block_kv) == (2048, 2048)
    assert choice.resolve("auto", "tpu", seq=4000).impl == "xla"  # 512 does not divide 4000
    assert choice.resolve("splash", "cpu", seq=256).interpret


@pytest.mark.parametrize("dtype, want", [("float32", "xla"), (jnp.float32, "xla"),
                                         ("bfloat16", "cudnn"), (jnp.float16, "cudnn"),
                                         ("auto", "cudnn"), (None, "cudnn")])
def test_auto_on_gpu_takes_cudnn_only_for_the_dtypes_it_computes(dtype, want):
    """cuDNN's flash kernel takes bfloat16 and float16: a float32 GPU step (dtype="float32"
    given) runs XLA attention under "auto" and is refused under "cudnn", naming the fix."""
    r = choice.resolve("auto", "gpu", seq=2048, head_dim=64, dtype=dtype)
    assert r.impl == want
    if want == "xla":
        assert "computes in float32" in r.reason
        with pytest.raises(ValueError, match=r"cudnn'.*float32.*dtype='auto'"):
            choice.check("cudnn", "gpu", seq=2048, head_dim=64, n_heads=4, n_kv_heads=2,
                         dtype=dtype)
    else:
        assert choice.check("cudnn", "gpu", seq=2048, head_dim=64, n_heads=4, n_kv_heads=2,
                            dtype=dtype).impl == "cudnn"


def test_bad_choices_fail_before_compiling():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="does not divide the sequence length 256"):
        A.attend(q, k, v, impl="splash", block_sizes=(96, 128))
    with pytest.raises(ValueError, match="Pallas TPU kernel; gpu has none"):
        choice.check("splash", "gpu", seq=256, head_dim=32, n_heads=4, n_kv_heads=2)
    with pytest.raises(ValueError, match="GPUs only"):
        A.attend(q, k, v, impl="cudnn")
    with pytest.raises(ValueError, match="multiples of 128"):
        choice.check("splash", "tpu", seq=256, head_dim=32, n_heads=4, n_kv_heads=2,
                     block_sizes=(64, 128))
    with pytest.raises(ValueError, match="block_kv=64: the kernel tiles keys"):
        choice.check("splash", "cpu", seq=256, head_dim=32, n_heads=4, n_kv_heads=2,
                     block_sizes=(128, 64))
    with pytest.raises(ValueError, match="attention='flash'"):
        GPTConfig.preset("tiny", attention="flash")
    with pytest.raises(ValueError, match="two positive ints"):
        GPTConfig.preset("tiny", attention_block_sizes=(128,))


def test_splash_rejects_a_sharded_sequence():
    mesh = wb.make_mesh(data=4, model=2)
    rules = Rules.preset("fsdp", mesh).replace(seq="model")
    q, k, v = qkv(b=4)
    with rules.activate(mesh), pytest.raises(ValueError, match="sequence sharded"):
        jax.jit(lambda q, k, v: A.attend(q, k, v, impl="splash")).lower(q, k, v)


def test_kernel_flops_causal_blocks():
    """Splash runs the blocks on or below the diagonal: (nb+1)/(2nb) of T^2."""
    f = attention_cost.kernel_flops("splash", "tpu", batch=1, seq=1024, n_heads=1, head_dim=128,
                       n_layers=1, block_sizes=(256, 256))
    per = 2 * 1024 ** 2 * 128 * (5 / 8)
    assert f == pytest.approx((2 + 7) * per)
    assert attention_cost.kernel_flops("xla", "tpu", batch=1, seq=1024, n_heads=1, head_dim=128,
                          n_layers=1) == 0


@pytest.mark.tpu
def test_tpu_plan_runs_the_kernel_and_saves_memory():
    """The TPU compiler compiles the Mosaic kernel (a tpu_custom_call in the HLO) and the
    step needs fewer temporaries than with XLA attention's T x T scores. One 2048-token
    sequence per chip: 4 heads' scores are 64 MiB a layer, and the compiler's temp is 74
    MiB with XLA against 10 MiB with splash (libtpu 0.0.42.1); at 1024 tokens (16 MiB of
    scores) the compiler keeps them out of temp (6.3 MiB either way), so no shorter."""
    cfg = GPTConfig.preset("tiny", seq_len=2048, dtype="bfloat16")
    mesh = wb.abstract_mesh("v5e-4", data=-1)
    plans = {a: wb.plan(cfg.replace(attention=a), mesh=mesh, rules="fsdp", batch=4,
                        progress=False) for a in ("xla", "auto")}
    assert all(p.source == "tpu-compiler" for p in plans.values())
    assert "tpu_custom_call" in plans["auto"].compiled.as_text()
    assert "tpu_custom_call" not in plans["xla"].compiled.as_text()
    assert plans["auto"].memory["temp"] < plans["xla"].memory["temp"]
