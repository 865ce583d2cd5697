"""One trace context for what the model reads; MoE router statistics returned as values.

References: the context's own fields before and after each ``with`` block; the unrolled
model's router statistics (each layer's, returned by its block) against the scanned and
the rematerialised scanned model with the same weights; a hand count (every token's ``k``
choices counted once per layer); and the package source (no other ``ContextVar``).
"""
from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import workbench as wb
from workbench import _step as S, _train_state as TS
from workbench._sharding import tracing
from workbench.models import GPT, GPTConfig, _moe_stats as moe_stats
from workbench.models._gpt import stack_blocks
from workbench.models._pipeline import Pipeline, activate
from workbench._sharding.rules import Rules, constrain, recording

from _tolerance import assert_close_at_scale

CFG = GPTConfig.preset("moe-tiny", seq_len=16)
TOKENS = jax.random.randint(jax.random.key(1), (4, 17), 0, CFG.vocab_size)


def test_setters_layer_on_one_context_and_restore_it():
    mesh = wb.make_mesh({"data": 2}, devices=jax.devices()[:2])
    rules = Rules.preset("dp", mesh)
    pipe = Pipeline(microbatches=2)
    assert tracing.current() == tracing.TraceContext()
    with rules.activate(mesh):
        with recording() as rec, activate(pipe, 4):
            ctx = tracing.current()
            assert (ctx.rules, ctx.mesh, ctx.record, ctx.pipeline, ctx.stages) == (
                rules, mesh, rec, pipe, 4)
            constrain(jnp.ones((2, 3)), ("batch", None), name="x")
        assert tracing.current().sharding == (rules, mesh)
        assert tracing.current().record is None and tracing.current().pipeline is None
    assert tracing.current() == tracing.TraceContext()
    assert [r[0] for r in rec] == ["x"]
    with pytest.raises(RuntimeError), tracing.scoped(stages=3):   # restored on errors too
        raise RuntimeError
    assert tracing.current().stages == 1


def test_the_trace_context_is_the_only_context_variable():
    package = pathlib.Path(wb.__file__).parent
    owners = {p.relative_to(package).as_posix() for p in package.rglob("*.py")
              if re.search(r"ContextVar\(", p.read_text())}
    assert owners == {"_sharding/tracing.py"}, owners


def _models():
    """moe-tiny unrolled, scanned, and scanned with full remat: the same weights."""
    unrolled = GPT(CFG, rngs=nnx.Rngs(0))
    params = stack_blocks(nnx.to_pure_dict(nnx.state(unrolled, nnx.Param)))
    out = [unrolled]
    for changes in ({"scan_layers": True}, {"scan_layers": True, "remat": "full"}):
        cfg = CFG.replace(**changes)
        graphdef, _ = nnx.split(nnx.eval_shape(lambda cfg=cfg: GPT(cfg, rngs=nnx.Rngs(0))))
        out.append(nnx.merge(graphdef, params))
    return out


@pytest.mark.slow
def test_router_statistics_leave_scan_and_remat_as_values():
    unrolled, *others = _models()
    inputs = TOKENS[:, :-1]
    x_ref, ref = jax.jit(lambda: unrolled.hidden_and_stats(inputs))()
    assert set(ref) == set(moe_stats.STAT_KEYS)
    assert ref["tokens_per_expert"].shape == (CFG.n_layers, CFG.n_experts)
    np.testing.assert_array_equal(ref["tokens_per_expert"].sum(axis=1),
                                  inputs.size * CFG.experts_per_token)   # hand count
    # each layer's entry is what that block returns for its own input
    h = unrolled.embed[...][inputs]
    for i, block in enumerate(unrolled.blocks):
        h, own = block(h)
        for k in moe_stats.STAT_KEYS:
            assert_close_at_scale(ref[k][i], own[k], rtol=1e-6)
    for model in others:
        x, stats = jax.jit(lambda model=model: model.hidden_and_stats(inputs))()
        assert_close_at_scale(x, x_ref, rtol=1e-5)
        for k in moe_stats.STAT_KEYS:
            assert_close_at_scale(stats[k], ref[k], rtol=1e-5)
    dense = GPT(GPTConfig.preset("tiny", seq_len=16), rngs=nnx.Rngs(0))
    assert dense.hidden_and_stats(inputs)[1] == {}


def test_a_custom_moe_loss_returns_the_statistics_beside_the_loss():
    model = GPT(CFG, rngs=nnx.Rngs(0))
    batch = {"tokens": TOKENS}

    def alone(m, b):
        return jnp.mean(m(b["tokens"][:, :-1]))

    with pytest.raises(ValueError, match=r"returned the loss alone .*n_experts=8.*"
                                         r"hidden_and_stats"):
        S.loss_and_stats(alone, model, batch)

    def with_stats(m, b):
        return S.lm_loss_and_stats(m, b)

    opt = optax.sgd(0.0)
    graphdef, params = nnx.split(model, nnx.Param)
    state = TS.TrainState(step=jnp.zeros((), jnp.int32), params=nnx.to_pure_dict(params),
                         opt_state=opt.init(nnx.to_pure_dict(params)))
    _, ours = jax.jit(S.make_train_step(graphdef, opt, loss_fn=with_stats))(state, batch)
    _, default = jax.jit(S.make_train_step(graphdef, opt))(state, batch)
    assert set(ours) == set(default) and "moe_router_loss" in ours
    for k in ours:
        np.testing.assert_array_equal(ours[k], default[k], err_msg=k)
