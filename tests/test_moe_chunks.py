"""Dropless grouped experts in slices of the group (``_moe_choice.expert_chunks``, ``in_chunks``).

Under remat a group whose ``k*G`` routed rows exceed ``GROUPED_CHUNK_ROWS`` runs the
experts over equal slices of its tokens in a checkpointed scan, so the recomputed layer's
backward holds one slice's ``(k*G/c, F)`` tensors instead of the whole group's (Mixtral-8x7B
at MaxText's published 147,456 tokens per chip: 7.9 GiB each; docs/performance.md).

Reference: the same train step unchunked (the row budget at its default, which these tiny
groups never reach). A token's output depends on its own routes only, so the slices compute
the same rows with the same sums; only the weight gradients are summed over slices in
another order: the loss to rtol 1e-6, gradients at each tensor's scale to 1e-5 (float32,
test_moe_grouped's bounds), the routing exactly. A slice that lost or reordered tokens,
or a weight gradient counted from one slice only, moves them by far more. The counts of
``expert_chunks`` are checked by hand.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import workbench as wb
from workbench import _step as S, _train_state as TS
from workbench.models import GPTConfig
from workbench.models import _moe as moe, _moe_choice as moe_choice
from workbench._sharding.rules import Rules

from _tolerance import assert_trees_close_at_scale

pytestmark = pytest.mark.usefixtures("wb_cache")

TINY = GPTConfig.preset("moe-tiny", seq_len=16, capacity_factor=None, moe_matmul="grouped",
                        remat="full")
BATCH = 16
MIXTRAL = GPTConfig.preset("mixtral-8x7b", remat="full", capacity_factor=None,
                           moe_matmul="grouped")


def _keep_grads() -> optax.GradientTransformation:
    """An optimizer whose state is the last gradients and whose updates are zero."""
    return optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


def _one_step(cfg, axes, rules):
    """Metrics and gradients of one train step of ``cfg`` on a fixed batch."""
    opt = _keep_grads()
    mesh = wb.make_mesh(axes, devices=jax.devices()[:math.prod(axes.values())])
    rules = Rules.preset(rules, mesh)
    tokens = jax.random.randint(jax.random.key(1), (BATCH, cfg.seq_len + 1), 0,
                                cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    graphdef, state = S.init_state(cfg, opt, rules, mesh, seed=0)
    step = S.jit_train_step(S.make_train_step(graphdef, opt, rules=rules, mesh=mesh),
                            TS.state_shardings(cfg, opt, rules, mesh),
                            TS.batch_shardings(rules, mesh))
    state, metrics = step(state, batch)
    return jax.device_get(metrics), jax.device_get(state.opt_state)


def test_expert_chunks_by_hand():
    """The fewest equal slices within the row budget, and 1 where slicing would change
    the result (a capacity factor, dense experts) or save nothing (remat keeps them)."""
    # MaxText's published Mixtral step: 147,456 tokens per chip, k=2 -> 294,912 rows;
    # 65,536 rows a slice needs >= 5 slices, and 6 is the first divisor of 147,456
    assert moe_choice.GROUPED_CHUNK_ROWS == 65536
    assert moe_choice.expert_chunks(MIXTRAL, 36 * 4096) == 6
    assert moe_choice.expert_chunks(MIXTRAL, 2 * 4096) == 1                 # 16,384 rows: whole
    assert moe_choice.expert_chunks(MIXTRAL, 32768) == 1                    # 65,536 rows: whole
    assert moe_choice.expert_chunks(MIXTRAL, 32769) == 3                    # 3 * 3 * 11 * 331
    assert moe_choice.expert_chunks(MIXTRAL, 32771) == 1                    # a prime: no slices
    assert moe_choice.expert_chunks(MIXTRAL, 17 * 2053) == 1                # 2 needed, 17 > 8 * 2
    assert moe_choice.expert_chunks(MIXTRAL, 65536) == 2                    # 131,072 rows
    assert moe_choice.expert_chunks(MIXTRAL.replace(moe_matmul="dense"), 36 * 4096) == 1
    assert moe_choice.expert_chunks(MIXTRAL.replace(moe_matmul="dense", capacity_factor=1.25),
                             36 * 4096) == 1
    assert moe_choice.expert_chunks(MIXTRAL.replace(remat="none"), 36 * 4096) == 1
    assert moe_choice.expert_chunks(MIXTRAL.replace(remat={"save": ["mlpwi_0"]}), 36 * 4096) == 1
    assert moe_choice.expert_chunks(MIXTRAL.replace(remat="save_qkv_proj"), 36 * 4096) == 6


@pytest.mark.parametrize("axes,rules", [({"data": 4}, "fsdp"), ({"expert": 4}, "ep"),
                                        ({"data": 2, "expert": 2}, "fsdp_ep")])
def test_chunked_step_equals_whole_group(monkeypatch, axes, rules):
    """One train step of moe-tiny with each device's group in slices equals the step with
    whole groups: fsdp (4 tokens x 16 per device, k=2: 128 rows, 4 slices of 32 rows),
    ep and fsdp_ep (the all-to-all exchange runs once per slice)."""
    want = _one_step(TINY, axes, rules)
    group = BATCH * TINY.seq_len // math.prod(v for a, v in axes.items() if a == "data") \
        // (axes.get("expert", 1))
    monkeypatch.setattr(moe_choice, "GROUPED_CHUNK_ROWS", TINY.experts_per_token * group // 4)
    assert moe_choice.expert_chunks(TINY, group) == 4
    (m, g), (rm, rg) = _one_step(TINY, axes, rules), want
    np.testing.assert_array_equal(m["moe_tokens_per_expert"], rm["moe_tokens_per_expert"])
    assert m["moe_dropped"] == rm["moe_dropped"] == 0
    np.testing.assert_allclose(m["loss"], rm["loss"], rtol=1e-6)
    np.testing.assert_allclose(m["grad_norm"], rm["grad_norm"], rtol=1e-5)
    assert_trees_close_at_scale(g, rg, rtol=1e-5)


def test_chunked_group_without_rules(monkeypatch):
    """Without active rules the whole batch is one group (64 tokens, k=2): in 8 slices its
    outputs and its gradients (tokens, routing weights, every expert weight) are the whole
    group's."""
    cfg = TINY.resolved()
    e, d, f = cfg.n_experts, cfg.d_model, cfg.moe_d_ff
    ks = jax.random.split(jax.random.key(2), 5)
    x = jax.random.normal(ks[0], (4, 16, d), jnp.float32)
    weights, idx = jax.lax.top_k(jax.nn.softmax(jax.random.normal(ks[1], (4, 16, e))),
                                 cfg.experts_per_token)
    gate, up = (jax.random.normal(k, (e, d, f)) / d ** 0.5 for k in ks[2:4])
    down = jax.random.normal(ks[4], (e, f, d)) / f ** 0.5
    probe = jax.random.normal(jax.random.key(3), x.shape)   # each token its own weight

    def run():
        def loss(x, w, gate, up, down):
            y, _ = moe.dispatch_combine(cfg, x, idx, w, gate, up, down)
            return jnp.sum(jnp.sin(y) * probe)
        return jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3, 4)))(x, weights, gate, up, down)

    want = run()
    monkeypatch.setattr(moe_choice, "GROUPED_CHUNK_ROWS", 2 * 64 // 8)
    assert moe_choice.expert_chunks(cfg, 64) == 8
    got = run()
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert_trees_close_at_scale(got[1], want[1], rtol=1e-5)
