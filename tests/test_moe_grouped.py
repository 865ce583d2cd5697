"""Grouped-matmul MoE (``moe_matmul="grouped"``): the dense dropless path's step, without
the padding.

Reference: the same train step with ``moe_matmul="dense"`` and ``capacity_factor=None``
on the same mesh, rules and batch (test_moe checks that one against one device). Both run
the same router and the same SwiGLU on the same (token, expert) pairs; only the order of
the rows in the matmuls differs (sorted by expert vs one buffer per expert), so every row's
dot products are the same sums of the same terms and the step agrees to float32 rounding:
the loss of one step to rtol 1e-6 (8 eps, no cancellation: _tolerance), the gradients at
each tensor's scale to 1e-5, and the routing (an argmax of the same logits) exactly: the
integer loads per layer and expert, nothing dropped. A broken grouped path (a row sent to
the wrong expert or peer, a lost assignment, a weight applied twice) moves the loss by far
more. The exchange under expert parallelism carries ``n*G*min(k, E/n)`` rows per device
(``_moe_grouped.group_grouped``), checked in the compiled HLO. The TPU kernel (megablox) and its
TPU plans: test_moe_gmm.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

import workbench as wb
from workbench.models import GPTConfig
from workbench.perf import _analytic as analytic
from workbench.perf._analytic_collectives import moe_collectives
from workbench._sharding.rules import Rules

from _moe_steps import BATCH, MOE_KEYS, TINY, dense_step, mesh as _mesh, one_step as _one_step
from _tolerance import assert_trees_close_at_scale

pytestmark = pytest.mark.usefixtures("wb_cache")


def _assert_same_step(got, want, cfg):
    (m, g), (rm, rg) = got, want
    np.testing.assert_array_equal(m["moe_tokens_per_expert"], rm["moe_tokens_per_expert"])
    assert m["moe_tokens_per_expert"].sum() == \
        cfg.n_layers * BATCH * cfg.seq_len * cfg.experts_per_token
    assert m["moe_dropped"] == rm["moe_dropped"] == 0
    np.testing.assert_allclose(m["loss"], rm["loss"], rtol=1e-6)
    for k in MOE_KEYS:   # the router's statistics: computed before the experts run
        np.testing.assert_allclose(m[k], rm[k], rtol=1e-6, err_msg=k)
    np.testing.assert_allclose(m["grad_norm"], rm["grad_norm"], rtol=1e-5)
    assert_trees_close_at_scale(g, rg, rtol=1e-5)


# ----------------------------------------------------------------------------- config
def test_auto_is_grouped_when_dropless_and_dense_with_a_capacity():
    assert TINY.moe_matmul == "auto" and TINY.capacity_factor is None
    assert TINY.moe_matmul_resolved == "grouped"
    assert GPTConfig.preset("mixtral-8x7b").moe_matmul_resolved == "dense"   # cf 1.25
    assert GPTConfig.preset("mixtral-8x7b", capacity_factor=None).moe_matmul_resolved \
        == "grouped"
    assert TINY.replace(moe_matmul="dense").moe_matmul_resolved == "dense"
    with pytest.raises(ValueError, match=r"moe_matmul='grouped' is dropless.*"
                                         r"capacity_factor=1.25.*capacity_factor=None"):
        TINY.replace(moe_matmul="grouped", capacity_factor=1.25)
    with pytest.raises(ValueError, match=r"moe_matmul='ragged'; choose one of"):
        TINY.replace(moe_matmul="ragged")


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("axes,rules,changes", [
    ({"data": 8}, "fsdp", {}),
    ({"expert": 4, "data": 2}, "ep", {}),                      # k = E/n: S = G*E/n
    ({"expert": 2, "data": 4}, "fsdp_ep", {}),                 # k < E/n: S = G*k
    ({"expert": 8}, "ep", {"moe_dispatch": "all_gather"}),
], ids=["fsdp8", "ep4x2", "fsdp_ep2x4", "ep8-all_gather"])
@pytest.mark.slow
def test_grouped_step_equals_the_dense_dropless_step(axes, rules, changes):
    cfg = TINY.replace(**changes)
    got = _one_step(cfg.replace(moe_matmul="grouped"), axes, rules)
    want = dense_step(cfg, axes, rules)   # test_moe_gmm's reference too (_moe_steps)
    _assert_same_step(got, want, cfg)


@pytest.mark.slow
def test_grouped_pipelined_with_remat_equals_dense_unpipelined():
    """Pipeline (gpipe, 2 stages x 2 micro-batches) and remat="full" over scanned layers,
    grouped; reference: the dense dropless step without a pipeline or remat."""
    cfg = TINY.replace(n_layers=4, scan_layers=True)
    got = _one_step(cfg.replace(moe_matmul="grouped", remat="full"),
                    {"stage": 2, "expert": 2, "data": 2}, "ep",
                    pipeline={"microbatches": 2, "schedule": "gpipe"})
    want = dense_step(cfg, {"expert": 2, "data": 4}, "ep")
    (m, g), (rm, rg) = got, want
    np.testing.assert_array_equal(m["moe_tokens_per_expert"], rm["moe_tokens_per_expert"])
    assert m["moe_dropped"] == 0
    # micro-batched sums in another order (test_moe_pipeline's bounds)
    for k in ("loss", "grad_norm", *MOE_KEYS):
        np.testing.assert_allclose(m[k], rm[k], rtol=1e-5, err_msg=k)
    assert_trees_close_at_scale(g, rg, rtol=1e-5)


# ----------------------------------------------------------------------------- exchange
@pytest.mark.slow
def test_the_exchange_carries_n_g_min_k_local_experts_rows():
    """expert=2 x data=4, ep: n = 2 peers of E' = 4 experts, G = 32 tokens per device, k = 2.
    Dense sends the (E, G, D) buffer, E*G = 256 rows; grouped sends n blocks of
    S = G*min(k, E') = 64 rows, 128 rows (half), and the (n, E') int32 counts once per
    layer (forward only: integers have no gradient). Hand count from the HLO's
    all-to-alls over 'expert'."""
    batch, seq, d, L = BATCH, TINY.seq_len, TINY.d_model, TINY.n_layers
    n, e_local, k = 2, TINY.n_experts // 2, TINY.experts_per_token
    g = batch * seq // 8
    mesh = _mesh({"expert": 2, "data": 4})

    def a2a(matmul):
        cfg = TINY.replace(moe_matmul=matmul)
        p = wb.plan(cfg, mesh=mesh, rules="ep", batch=batch, progress=False)
        assert p.source == "cpu-compiler"
        out = {}
        for c in p.collectives:
            if c.kind == "all-to-all":
                assert c.axes == ("expert",)
                out[c.bytes] = out.get(c.bytes, 0) + c.count
        hand = moe_collectives(cfg, p.rules, p.mesh, batch, seq)
        assert out == {c.bytes: c.count for c in hand}   # the planner's formula says so
        return out

    assert a2a("dense") == {TINY.n_experts * g * d * 4: 4 * L}
    rows = n * g * min(k, e_local)
    assert rows == TINY.n_experts * g // 2
    assert a2a("grouped") == {rows * d * 4: 4 * L, n * e_local * 4: L}


def test_the_formulas_count_routed_rows_only():
    """The planner's formulas for grouped matmuls: no empty-slot FLOPs, k rows per token
    without expert parallelism and min(n*k, E) per token of a device with it (dense
    dropless: E slots per token)."""
    mesh = wb.abstract_mesh("v5p-64", data=-1)
    dense = GPTConfig.preset("mixtral-8x7b", capacity_factor=None, moe_matmul="dense")
    grouped = dense.replace(moe_matmul="grouped")
    rules = Rules.preset("fsdp", mesh)
    assert analytic.moe_padding_flops(grouped, 32, 4096, rules, mesh) == 0
    # dense: E - k empty slots per token, each 2*3*D*Fe FLOPs per layer, x3 + remat (none)
    assert analytic.moe_padding_flops(dense, 32, 4096, rules, mesh) == \
        3 * 2 * 3 * 4096 * 14336 * (8 - 2) * 32 * 4096 * 32
    assert analytic.moe_slots_per_token(grouped, 4096) == 2
    assert analytic.moe_slots_per_token(dense, 4096) == 8
    assert analytic.moe_slots_per_token(grouped, 4096, expert_shards=2) == 4
    assert analytic.moe_slots_per_token(grouped, 4096, expert_shards=8) == 8
    assert analytic.moe_slots_per_token(TINY, 64, expert_shards=8) == 8
    p = wb.plan(grouped.replace(remat="full"), mesh=mesh, rules="fsdp", batch=64,
                compile=False, progress=False)
    q = wb.plan(dense.replace(remat="full"), mesh=mesh, rules="fsdp", batch=64,
                compile=False, progress=False)
    assert p.model_flops == q.model_flops   # model FLOPs: the routed experts (flops.py)
    assert p.report.padding_flops == 0 < q.report.padding_flops
    capped = wb.plan(dense.replace(remat="full", capacity_factor=1.25), mesh=mesh,
                     rules="fsdp", batch=64, compile=False, progress=False)
    # k rows per token where capacity 1.25 keeps 1.25 k slots and dense dropless E
    assert p.report.memory_estimate["temp"] < capped.report.memory_estimate["temp"] \
        < q.report.memory_estimate["temp"]
