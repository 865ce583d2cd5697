"""The grouped MoE path through megablox's Pallas grouped matmul (``moe_kernel="megablox"``,
the default on TPU): the dense dropless path's step, on CPU in Pallas' interpret mode.

Reference: the same train step with ``moe_matmul="dense"`` and ``capacity_factor=None`` on
the same mesh, rules and batch. Both run the same router and SwiGLU on the same (token,
expert) pairs; the kernel sums each row's dot products in tiles of up to 1024 terms
(``grouped.GMM_TILE``), the einsum in its own order, and the weight gradient (``tgmm``) sums
each expert's rows tile by tile, so the step agrees to float32 reordering: the loss to
rtol 1e-6 (8 eps of a sum of positive terms), gradients at each tensor's scale to 1e-5
(tests/_tolerance.py), the routing exactly. A row in the wrong group, a padded row read as
a token, or an uninitialized row (the kernel leaves rows outside every group unwritten;
interpret mode fills them with NaN) moves them by far more. Interpret mode runs each grid
step in Python, so the shapes are tiny: moe-tiny at test_moe_grouped's 16-token sequences
(the same dense reference steps, computed once per process: tests/_moe_steps.py).

On TPU: the compiled step's FLOPs and temporaries against the capacity-1.25 and dense
dropless plans (libtpu, marked ``tpu``; plans in tests/tpu_plans).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import workbench as wb
from workbench.models import GPTConfig
from workbench.models import _moe_choice as moe_choice, _moe_grouped as grouped
from workbench._sharding.topology import tpu_compiler_available

from _moe_steps import MOE_KEYS, TINY, dense_step, one_step as _one_step
from _tolerance import assert_close_at_scale

pytestmark = pytest.mark.usefixtures("wb_cache")


def _assert_same_step(got, want, cfg, batch=16):
    (m, g), (rm, rg) = got, want
    np.testing.assert_array_equal(m["moe_tokens_per_expert"], rm["moe_tokens_per_expert"])
    assert m["moe_tokens_per_expert"].sum() == \
        cfg.n_layers * batch * cfg.seq_len * cfg.experts_per_token
    assert m["moe_dropped"] == rm["moe_dropped"] == 0
    for k in ("loss", *MOE_KEYS):
        np.testing.assert_allclose(m[k], rm[k], rtol=1e-6, err_msg=k)
    np.testing.assert_allclose(m["grad_norm"], rm["grad_norm"], rtol=1e-5)
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(rg), jax.tree.leaves(g),
                          jax.tree.leaves(rg), strict=True):
        assert np.all(np.isfinite(a)), jax.tree_util.keystr(path[0])
        assert_close_at_scale(a, b, rtol=1e-5, err_msg=jax.tree_util.keystr(path[0]))


# ----------------------------------------------------------------------------- kernel
def test_auto_is_megablox_on_tpu_and_ragged_dot_elsewhere():
    assert TINY.moe_kernel == "auto"
    # megablox's blocks are whole lane tiles: widths that are multiples of 128 take it,
    # moe-tiny's 64 (Pallas refuses its blocks) stays on ragged_dot
    wide = TINY.replace(d_model=128, expert_d_ff=256)
    assert moe_choice.grouped_kernel(wide, "tpu") == "megablox"
    assert moe_choice.grouped_kernel(TINY, "tpu") == "ragged_dot" and TINY.d_model % 128
    assert moe_choice.grouped_kernel(TINY, "gpu") == moe_choice.grouped_kernel(TINY, "cpu") \
        == "ragged_dot"
    assert moe_choice.grouped_kernel(TINY.replace(moe_kernel="ragged_dot"), "tpu") == "ragged_dot"
    assert moe_choice.grouped_kernel(TINY.replace(moe_kernel="megablox"), "cpu") == "megablox"


@pytest.mark.parametrize("value,error,match", [
    ("pallas", ValueError, r"moe_kernel='pallas'; choose one of \('auto', 'megablox'"),
    (1, ValueError, r"moe_kernel=1; choose one of"),
    (None, ValueError, r"moe_kernel=None; choose one of"),
])
def test_unknown_kernels_are_refused_by_name(value, error, match):
    with pytest.raises(error, match=match):
        TINY.replace(moe_kernel=value)


def test_a_kernel_with_dense_buffers_is_refused():
    with pytest.raises(ValueError, match=r"moe_kernel='megablox' is a grouped matmul's "
                                         r"kernel.*capacity_factor=1.25.*moe_kernel='auto'"):
        GPTConfig.preset("mixtral-8x7b", moe_kernel="megablox")   # capacity 1.25: dense
    with pytest.raises(ValueError, match=r"moe_matmul='dense'"):
        TINY.replace(moe_matmul="dense", moe_kernel="ragged_dot")


@pytest.mark.parametrize("sizes", [(10, 0, 30, 24), (0, 0, 5, 0), (3, 1, 4, 1)],
                         ids=["full", "one-group", "rows-left-over"])
def test_megablox_equals_ragged_dot_and_zeroes_rows_past_the_groups(sizes):
    """One projection and its gradients (lhs and weights) against ``jax.lax.ragged_dot``
    (JAX's reference grouped matmul): 64 rows of which ``sum(sizes)`` are grouped. Rows
    past the groups come out zero in the output and the input gradient, never the
    kernel's uninitialized (NaN in interpret mode) memory."""
    x = jax.random.normal(jax.random.key(0), (64, 40))
    w = jax.random.normal(jax.random.key(1), (4, 40, 24))
    s = jnp.array(sizes, jnp.int32)
    mine = lambda a, b: grouped._megablox(a, b, s, interpret=True)
    ref = lambda a, b: jax.lax.ragged_dot(a, b, s)
    loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b)))
    got, want = mine(x, w), ref(x, w)
    assert_close_at_scale(got, want, rtol=1e-6)
    np.testing.assert_array_equal(got[sum(sizes):], 0.0)
    for a, b in zip(jax.grad(loss(mine), (0, 1))(x, w), jax.grad(loss(ref), (0, 1))(x, w)):
        assert np.all(np.isfinite(a))
        assert_close_at_scale(a, b, rtol=1e-5)


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("axes,rules,changes", [
    ({"data": 8}, "fsdp", {}),
    ({"expert": 4, "data": 2}, "ep", {}),                      # k = E/n: S = G*E/n
    ({"expert": 2, "data": 4}, "fsdp_ep", {}),                 # k < E/n: S = G*k
    ({"expert": 8}, "ep", {"moe_dispatch": "all_gather"}),
], ids=["fsdp8", "ep4x2", "fsdp_ep2x4", "ep8-all_gather"])
@pytest.mark.slow
def test_megablox_step_equals_the_dense_dropless_step(axes, rules, changes):
    cfg = TINY.replace(**changes)
    got = _one_step(cfg.replace(moe_matmul="grouped", moe_kernel="megablox"), axes, rules)
    want = dense_step(cfg, axes, rules)   # test_moe_grouped's reference too (_moe_steps)
    _assert_same_step(got, want, cfg)


@pytest.mark.slow
def test_megablox_pipelined_with_remat_equals_dense_unpipelined():
    """Pipeline (gpipe, 2 stages x 2 micro-batches: the kernel under the stages' vmap) and
    remat="full" over scanned layers; reference: the dense dropless step without either."""
    cfg = TINY.replace(n_layers=4, scan_layers=True)
    got = _one_step(cfg.replace(moe_matmul="grouped", moe_kernel="megablox", remat="full"),
                    {"stage": 2, "expert": 2, "data": 2}, "ep",
                    pipeline={"microbatches": 2, "schedule": "gpipe"})
    want = dense_step(cfg, {"expert": 2, "data": 4}, "ep")
    (m, g), (rm, rg) = got, want
    np.testing.assert_array_equal(m["moe_tokens_per_expert"], rm["moe_tokens_per_expert"])
    assert m["moe_dropped"] == 0
    # micro-batched sums in another order (test_moe_pipeline's bounds)
    for k in ("loss", "grad_norm", *MOE_KEYS):
        np.testing.assert_allclose(m[k], rm[k], rtol=1e-5, err_msg=k)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(rg), strict=True):
        assert_close_at_scale(a, b, rtol=1e-5)


# ----------------------------------------------------------------------------- TPU plans
needs_tpu = pytest.mark.skipif(not tpu_compiler_available(),
                               reason="the TPU compiler (libtpu) is not installed")
PLANNED = ("grouped megablox", "capacity 1.25", "dense dropless")


@needs_tpu
@pytest.mark.tpu
@pytest.mark.slow   # three TPU compiles each (2-3 minutes apiece on 2 cores)
@pytest.mark.timeout(2400)   # compiled live only by `make tpu-plans` (tests/tpu_plans after)
@pytest.mark.parametrize("model", ["moe-small", "mixtral-2-layers"])
def test_megablox_plan_computes_no_more_than_capacity_1_25(model):
    """TPU-compiled dropless plans with megablox experts (the default on TPU) against
    capacity 1.25's and dense dropless's at the same batch (benchmarks/bench_moe_plans.py):
    moe-small on v5p-32 (fsdp, 8192 tokens per chip) and Mixtral-8x7B's layer shapes (2
    scanned layers, fsdp on v5p-64, remat full, 8192 tokens per chip). The kernels compute
    the k routed rows per token (rounded up to 512-row tiles per expert) where capacity
    1.25 pads to 1.25 k slots and dense dropless to E; the compiler's FLOPs count the
    kernels' own cost estimates (2 M K N each, tgmm included), so an expansion over every
    expert (ragged_dot's weight gradient under libtpu 0.0.42.1: 3.3x the routed FLOPs of a
    projection, bench_moe_plans' kernel rows) would fail this."""
    from benchmarks.bench_moe_plans import mixtral_plans, moe_small_plans

    plans = moe_small_plans(cases=PLANNED) if model == "moe-small" else \
        mixtral_plans(n_layers=2, tokens_per_chip=8192, cases=PLANNED)
    gmm, capped, dense = (plans[c] for c in PLANNED)
    assert all(r["source"] == "tpu-compiler" for r in plans.values()), plans
    assert gmm["flops"] <= capped["flops"] < dense["flops"], plans
    assert gmm["temp"] < dense["temp"], plans


@needs_tpu
@pytest.mark.tpu
@pytest.mark.slow   # one TPU compile of the whole Mixtral-8x7B at 147,456 tokens per chip
@pytest.mark.timeout(3600)
def test_published_dropless_mixtral_fits_per_chip():
    """MaxText's published dropless Mixtral-8x7B step (v5p-128, per_device_batch_size=36
    of 4096 tokens, bfloat16 weights, megablox experts: tpu-recipes
    training/v5p/Mixtral-8X7B-Maxtext) planned with megablox experts, remat full and the
    loss in 4 slices: the TPU compiler's memory per chip is within the chip's HBM (its own
    limit). libtpu 0.0.50.1: 88.4 GiB of 95 (84.3 GiB temp); with each group's experts
    whole (moe_choice.expert_chunks at 1) 127.9 GiB, and with the loss whole 105.7 GiB
    (docs/performance.md)."""
    from benchmarks.bench_moe_plans import PUBLISHED, published_mixtral_plan

    p = published_mixtral_plan()
    assert p["source"] == "tpu-compiler", p
    assert p["batch"] == PUBLISHED["per_device_batch"] * 64
    assert p["limit"] == 95 * 2**30, p   # v5p's HBM per chip
    assert p["fits"] is True and p["total"] <= p["limit"], p
