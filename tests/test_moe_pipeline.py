"""Mixture of experts under pipeline parallelism: the same step as without a pipeline.

Reference: the same MoE (``moe-tiny`` with 4 scanned layers) on the same batch without a
pipeline, whose router statistics the unpipelined tests (test_moe) check against one
device. The pipelined step must give the same loss, gradients and every ``moe_*`` metric
(per layer, in layer order: bubble iterations left out, micro-batches merged), to float32
rounding; and the plan of a pipelined MoE shows its all-to-alls in the compiled program.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import workbench as wb
from workbench import _runs as runs
from workbench.models import GPTConfig, _moe_stats as moe_stats

from _moe_steps import BATCH, mesh as _mesh, one_step
from _tolerance import assert_trees_close_at_scale

pytestmark = pytest.mark.usefixtures("wb_cache")

CFG = GPTConfig.preset("moe-tiny", n_layers=4, scan_layers=True, seq_len=16)
PIPE_MESH = {"stage": 2, "expert": 2, "data": 2}
FLAT_MESH = {"expert": 2, "data": 4}
MOE_KEYS = ("moe_router_loss", "moe_aux_loss", "moe_z_loss", "moe_entropy", "moe_dropped",
            "moe_tokens_per_expert")


def _one_step(axes, pipeline=None):
    """Metrics and gradients of one train step of CFG on the fixed batch (ep rules)."""
    return one_step(CFG, axes, "ep", pipeline)


@pytest.mark.slow
def test_merged_microbatch_stats_are_the_whole_batch_stats():
    """merge_microbatches of a batch's micro-batches = router_stats of the whole batch; the
    load-balance loss is not the micro-batches' mean (it multiplies two token averages)."""
    e, k, m = CFG.n_experts, CFG.experts_per_token, 4
    logits = 3.0 * jax.random.normal(jax.random.key(0), (m, 2, 16, e))   # (M, mb, T, E)

    def stats(lg):
        probs = jax.nn.softmax(lg, axis=-1)
        out = moe_stats.router_stats(lg, probs, jax.lax.top_k(probs, k)[1], e)
        out["router_loss"] = moe_stats.router_loss(CFG, out["aux_loss"], out["z_loss"])
        out["dropped"] = jnp.float32(1.0)
        return out

    whole = stats(logits.reshape(-1, 16, e))
    parts = jax.vmap(stats)(logits)
    merged = moe_stats.merge_microbatches(parts, CFG)
    assert set(merged) == set(whole) == set(moe_stats.STAT_KEYS)
    for key in moe_stats.STAT_KEYS:
        want = m * whole[key] if key == "dropped" else whole[key]
        # one mean over micro-batches instead of over all tokens: a few eps (8 allowed)
        np.testing.assert_allclose(merged[key], want, rtol=1e-6, err_msg=key)
    assert abs(float(jnp.mean(parts["aux_loss"])) - float(whole["aux_loss"])) > 1e-2


@pytest.fixture(scope="module")
def unpipelined():
    return _one_step(FLAT_MESH)


@pytest.mark.parametrize("pipeline", [
    {"microbatches": 4, "schedule": "gpipe"},
    {"microbatches": 2, "schedule": "circular", "repeats": 2},   # one layer per chunk
], ids=["gpipe", "circular"])
@pytest.mark.slow
def test_pipelined_step_has_the_unpipelined_loss_grads_and_router_stats(unpipelined,
                                                                        pipeline):
    ref_metrics, ref_grads = unpipelined
    metrics, grads = _one_step(PIPE_MESH, pipeline)
    assert set(metrics) == set(ref_metrics) == {"loss", "grad_norm", *MOE_KEYS}
    tpe = metrics["moe_tokens_per_expert"]
    # every layer's loads, in layer order, from the real micro-batches only (a bubble slot
    # counted would add B/M * T * k assignments to some layer)
    assert tpe.shape == (CFG.n_layers, CFG.n_experts) and tpe.dtype == np.int32
    assert (tpe.sum(axis=1) == BATCH * CFG.seq_len * CFG.experts_per_token).all()
    np.testing.assert_array_equal(tpe, ref_metrics["moe_tokens_per_expert"])
    assert metrics["moe_dropped"] == ref_metrics["moe_dropped"] == 0
    # scalars of one step, micro-batched sums in another order: 80 eps (see _tolerance)
    for k in ("loss", "grad_norm", "moe_router_loss", "moe_aux_loss", "moe_z_loss",
              "moe_entropy"):
        np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-5, err_msg=k)
    # micro-batches sum the gradients in another order: tolerance at each tensor's scale
    assert_trees_close_at_scale(grads, ref_grads, rtol=1e-5)


@pytest.mark.slow
def test_pipelined_moe_training_has_the_unpipelined_losses(tmp_path):
    """TrainConfig(pipeline=...) for 3 steps: the losses and expert loads of the same run
    without a pipeline."""
    common = dict(model="moe-tiny", model_overrides={"n_layers": 4, "scan_layers": True},
                  rules="ep", batch=8, seq=16, steps=3, checkpoint_every=3,
                  data=wb.data.TextData(max_bytes=100_000),
                  optimizer=wb.train.AdamW(lr=1e-2, warmup_steps=2))
    ref = wb.Trainer(wb.TrainConfig(**common, mesh=FLAT_MESH), run_dir=tmp_path / "ref",
                     progress=None)
    ref.run()
    pipe = wb.Trainer(wb.TrainConfig(**common, mesh=PIPE_MESH,
                                     pipeline={"microbatches": 2, "schedule": "gpipe"}),
                      run_dir=tmp_path / "pipe", progress=None)
    pipe.run()
    assert len(pipe.losses) == 3
    np.testing.assert_allclose(pipe.losses, ref.losses, rtol=1e-5)   # 3 steps: _tolerance
    got, want = runs.read_metrics(tmp_path / "pipe"), runs.read_metrics(tmp_path / "ref")
    for g, w in zip(got, want, strict=True):
        assert g["moe_tokens_per_expert"] == w["moe_tokens_per_expert"]
        assert g["moe_aux_loss"] == pytest.approx(w["moe_aux_loss"], rel=1e-5)


@pytest.mark.slow
def test_plan_of_a_pipelined_moe_shows_its_all_to_alls():
    """wb.plan(pipeline=...) of a MoE compiles; the program holds the pipeline's stage
    shifts and the dispatch's all-to-alls over the expert axis. Hand count: 4 per MoE layer
    (two forward, two backward) for each of a stage's layers in each of the M + S - 1
    iterations (SPMD: every stage computes in the bubble too), all inside the loop."""
    mesh = _mesh(PIPE_MESH)   # the dense path's buffers (grouped rows: test_moe_grouped)
    p = wb.plan(CFG.replace(moe_matmul="dense"), mesh=mesh, rules="ep", batch=BATCH,
                progress=False,
                pipeline={"microbatches": 4, "schedule": "gpipe"})
    assert p.source == "cpu-compiler" and p.pipeline["stages"] == 2
    a2a = [c for c in p.collectives if c.kind == "all-to-all"]
    assert a2a and all(c.axes == ("expert",) and c.in_loop for c in a2a)
    stages, micro = 2, 4
    assert sum(c.count for c in a2a) == 4 * (CFG.n_layers // stages) * (micro + stages - 1)
    # one micro-batch's (E, C, D) buffer per device group: dropless, C = its tokens
    g = BATCH // 4 * CFG.seq_len // 4          # tokens of a micro-batch per expert x data
    assert {c.bytes for c in a2a} == {CFG.n_experts * g * CFG.d_model * 4}
    assert "all-to-all" in p.compiled.as_text()
    assert any(c["axes"] == ["stage"] for c in p.pipeline["permutes"])
