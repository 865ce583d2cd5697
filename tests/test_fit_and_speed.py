"""Fit and speed of large steps: the chunked (vocabulary-tiled) loss, and step-time
predictions from the TPU compiler's own cycle estimates.

References: the unchunked loss and its gradients (JAX's answer for the same model), the
unchunked step's compiled memory, the unrolled program's cycle count, and a matmul's FLOPs
at the chip's peak."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import workbench as wb
import workbench._flops  # noqa: F401 - wb._flops below
from workbench.hardware import hardware_spec
from workbench.models import GPT, GPTConfig
from workbench._compiled.loops import compiler_cycles, computation_multiplicity
from workbench._step import lm_loss, make_train_step
from workbench._sharding.topology import tpu_compiler_available

from _tolerance import assert_close_at_scale

needs_tpu = pytest.mark.skipif(not tpu_compiler_available(),
                               reason="the TPU compiler (libtpu) is not installed: "
                                      "pip install 'workbench[tpu-compile]'")
TINY = GPTConfig.preset("tiny")


def _loss_and_grads(cfg, batch):
    model = GPT(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    return jax.value_and_grad(lambda s: lm_loss(nnx.merge(graphdef, s), batch))(state)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.slow
def test_chunked_loss_equals_the_whole_loss(tie, mask):
    cfg = TINY.replace(tie_embeddings=tie)
    tokens = jax.random.randint(jax.random.key(1), (3, 33), 0, cfg.vocab_size)
    batch = {"tokens": tokens}
    if mask:
        batch["mask"] = jax.random.uniform(jax.random.key(2), (3, 32)) > 0.3
    ref_loss, ref_grads = _loss_and_grads(cfg, batch)
    for chunks in (2, 4, 32):
        loss, grads = _loss_and_grads(cfg.replace(loss_chunks=chunks), batch)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
            assert_close_at_scale(a, b, rtol=1e-5)   # chunked sums: at the tensor's scale


@pytest.mark.parametrize("rules", ["fsdp_tp", "fsdp_cp"])
@pytest.mark.slow
def test_chunked_loss_trains_like_the_whole_loss_on_a_sharded_mesh(rules):
    """Three sharded steps (vocab over the model axis, or the sequence over a context
    axis): the same losses and parameters as the unchunked step."""
    axes = {"data": 4, "model": 2} if rules == "fsdp_tp" else {"data": 4, "context": 2}
    mesh = wb.make_mesh(**axes)
    tokens = jax.random.randint(jax.random.key(3), (8, 65), 0, TINY.vocab_size)
    out = {}
    for chunks in (1, 4):
        cfg = TINY.replace(loss_chunks=chunks)
        plan = wb.plan(cfg, mesh=mesh, rules=rules, batch=8, seq=64, progress=False)
        state = plan.init_state(seed=0)
        step = plan.train_step()
        losses = []
        for _ in range(3):
            state, metrics = step(state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
            losses.append(float(metrics["loss"]))
        out[chunks] = (losses, jax.tree.leaves(state.params))
    np.testing.assert_allclose(out[4][0], out[1][0], rtol=1e-5)   # 3 steps: see _tolerance
    for a, b in zip(out[4][1], out[1][1]):
        # Adam divides by sqrt(nu): reordered last bits of tiny gradients move parameters
        assert_close_at_scale(a, b, rtol=1e-4)


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "4"])
def test_bad_loss_chunks_fail_in_the_config(bad):
    with pytest.raises((TypeError, ValueError), match="loss_chunks"):
        TINY.replace(loss_chunks=bad)


def test_loss_chunks_that_do_not_divide_the_sequence_fail_before_compiling():
    with pytest.raises(ValueError, match=r"loss_chunks=5 does not divide the sequence "
                                         r"length 64"):
        wb.plan(TINY.replace(loss_chunks=5), mesh=wb.make_mesh(data=8), rules="fsdp",
                batch=8, seq=64, progress=False)


def test_loss_chunks_add_one_logits_matmul_to_the_recompute():
    whole = wb._flops.gpt_flops(TINY, batch=4, seq=64)
    chunked = wb._flops.gpt_flops(TINY.replace(loss_chunks=4), batch=4, seq=64)
    assert chunked.total == whole.total   # model FLOPs are the model's
    assert chunked.recompute - whole.recompute == pytest.approx(
        whole.breakdown["logits"] / 3)    # one forward logits matmul
    assert "loss_chunks=4 recomputes the logits" in chunked.formula


@pytest.mark.tpu
@needs_tpu
def test_loss_chunks_lower_the_tpu_compiled_memory_by_the_float32_logits():
    """The TPU compiler's temp for a large-vocabulary float32 step drops by at least the
    float32 logits the chunks no longer hold, and the analytic estimate moves the same way.
    One 1024-token sequence per chip: 128 MiB of logits, 136 MiB of temp unchunked against
    8.5 MiB with 8 chunks (libtpu 0.0.42.1). Smaller logits are no test: the compiler keeps
    32 or 64 MiB of them out of temp (vocab 8192, or 512 tokens per chip)."""
    cfg = TINY.replace(vocab_size=32768, d_model=128, dtype="float32", seq_len=1024)
    mesh = wb.abstract_mesh("v5e-4", fsdp=-1)
    plans = {c: wb.plan(cfg.replace(loss_chunks=c), mesh=mesh, rules="fsdp", batch=4,
                        seq=1024, progress=False) for c in (1, 8)}
    assert {p.source for p in plans.values()} == {"tpu-compiler"}
    logits_f32 = 4 // 4 * 1024 * cfg.vocab_size * 4           # per device: 128 MiB
    saved = plans[1].memory["temp"] - plans[8].memory["temp"]
    assert saved >= 0.75 * logits_f32, (saved, logits_f32)
    est = {c: p.report.memory_estimate["temp"] for c, p in plans.items()}
    assert est[1] - est[8] >= 0.75 * logits_f32


@pytest.mark.tpu
def test_bf16_loss_holds_no_float32_logits_on_the_tpu():
    """With bf16 logits the loss (workbench.models._xent) keeps no float32 copy and no
    float32 gradient of them: the TPU compiler's unchunked temp is within a quarter of the
    bf16 logits of the 8-chunk program's (optax's loss on float32 logits held 143 MiB
    against 8.5 MiB here, libtpu 0.0.42.1). The estimate stays an upper bound."""
    cfg = TINY.replace(vocab_size=32768, d_model=128, dtype="bfloat16", seq_len=1024)
    mesh = wb.abstract_mesh("v5e-4", fsdp=-1)
    plans = {c: wb.plan(cfg.replace(loss_chunks=c), mesh=mesh, rules="fsdp", batch=4,
                        seq=1024, progress=False) for c in (1, 8)}
    logits_bf16 = 4 // 4 * 1024 * cfg.vocab_size * 2          # per device: 64 MiB
    assert plans[1].memory["temp"] - plans[8].memory["temp"] <= 0.25 * logits_bf16
    assert plans[1].report.memory_estimate["temp"] >= plans[1].memory["temp"]


def test_computation_multiplicity_follows_loops_and_calls():
    text = """HloModule m

%inner (p: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  ROOT %f = f32[] fusion(%p), kind=kLoop, calls=%leaf, backend_config={"estimated_cycles":"7"}
}

%leaf (q: f32[]) -> f32[] {
  ROOT %q = f32[] parameter(0)
}

%cond (c: (s32[], f32[])) -> pred[] {
  %c = (s32[], f32[]) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (b: (s32[], f32[])) -> (s32[], f32[]) {
  %b = (s32[], f32[]) parameter(0)
  %x = f32[] get-tuple-element(%b), index=1
  %y = f32[] call(%x), to_apply=%inner
  %z = f32[] fusion(%y), kind=kLoop, calls=%leaf, backend_config={"estimated_cycles":"100"}
  %i = s32[] get-tuple-element(%b), index=0
  ROOT %t = (s32[], f32[]) tuple(%i, %z)
}

ENTRY %main (a: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %zero = s32[] constant(0)
  %t = (s32[], f32[]) tuple(%zero, %a)
  %w = (s32[], f32[]) while(%t), condition=%cond, body=%body
  %r = f32[] get-tuple-element(%w), index=1
  ROOT %o = f32[] fusion(%r), kind=kLoop, calls=%leaf, backend_config={"estimated_cycles":"5"}
}
"""
    mult = computation_multiplicity(text)
    assert mult["main"] == 1 and mult["body"] == 6 and mult["inner"] == 6
    assert mult["leaf"] == 6 + 6 + 1        # called from inner, body and main
    assert compiler_cycles(text) == (6 * 7 + 6 * 100 + 5, 3)


@pytest.mark.tpu
@needs_tpu
@pytest.mark.parametrize("topology,kind", [("v5e:2x2", "TPU v5e"), ("v5p:2x2x1", "TPU v5p"),
                                           ("v6e:2x2", "TPU v6e"), ("v4:2x2x1", "TPU v4"),
                                           ("tpu7x:2x2x1", "TPU7x")])
def test_a_matmuls_estimated_cycles_at_the_clock_stay_within_its_flops_at_peak(topology,
                                                                                kind):
    """The clock in the hardware table turns the compiler's cycles into seconds: for one
    large bf16 matmul on one chip, the estimate at that clock is no faster than the
    matmul's FLOPs at the chip's published peak, and within 2x of it."""
    from workbench._sharding.topology import _topology_devices

    dev = _topology_devices(topology, 1)[0]   # the devices plans compile for (v4: megacore)
    n = 4096
    sds = jax.ShapeDtypeStruct((n, n), jnp.bfloat16,
                               sharding=jax.sharding.SingleDeviceSharding(dev))
    text = jax.jit(lambda a, b: a @ b).lower(sds, sds).compile().as_text()
    cycles, count = compiler_cycles(text)
    spec = hardware_spec(kind)
    ideal = 2 * n**3 / spec.peak_flops
    assert count >= 1 and spec.clock_hz
    assert ideal <= cycles / spec.clock_hz <= 2 * ideal, (cycles / spec.clock_hz, ideal)


@pytest.mark.tpu
@needs_tpu
def test_tpu_plans_time_local_work_with_the_compilers_cycles():
    """A scanned TPU plan: local work is the compiler's cycles (loop bodies x trips) at the
    clock, plus the splash kernel's FLOPs at the efficiency those cycles give the rest of
    the step's FLOPs; the unrolled program (no loop) is the
    reference for the loop's multiplication; the roofline stays in the breakdown as the
    ideal."""
    cfg = TINY.replace(n_layers=4, dtype="bfloat16", attention="splash", n_heads=4,
                       n_kv_heads=4, head_dim=128, d_model=256, d_ff=512, seq_len=256)
    mesh = wb.abstract_mesh("v5e-4", fsdp=-1)
    plans = {s: wb.plan(cfg.replace(scan_layers=s), mesh=mesh, rules="fsdp", batch=4,
                        seq=256, progress=False) for s in (False, True)}
    spec = hardware_spec("TPU v5e")
    cyc = {s: p.report.compiler_cycles[0] for s, p in plans.items()}
    # the same matmuls plus the loop's slicing of stacked weights and gradients (1.58x on
    # this tiny model, one 256-token sequence per chip); the loop body counted once would
    # give 0.56x, every computation twice 3.2x (libtpu 0.0.42.1)
    assert 0.9 * cyc[False] <= cyc[True] <= 2 * cyc[False], cyc
    p = plans[True]
    pred = p.predicted
    kernel = p.kernel_flops / p.report.compute_split / spec.peak_flops   # at peak
    t_cycles = cyc[True] / spec.clock_hz
    other = pred.breakdown["compute"] - kernel     # the rest of the step's FLOPs at peak
    efficiency = min(1.0, other / t_cycles)
    assert kernel > 0 and 0 < efficiency <= 1
    assert pred.breakdown["local"] == pytest.approx(t_cycles + kernel / efficiency)
    assert pred.breakdown["roofline_local"] <= pred.breakdown["local"]
    assert re.search(r"cycle estimates: \d+ instructions", pred.sources["local"])
    assert f"{efficiency:.0%} of peak FLOP/s" in pred.sources["local"]
    assert "splash kernel's FLOPs at that efficiency" in pred.sources["local"]
    assert "by the compiler's estimates" in str(pred)
    # another chip's table: the cycles are this chip's, so the roofline is used
    other = p.predict(hardware="TPU v5p")
    assert other.breakdown["local"] == other.breakdown["roofline_local"]
    # an estimate (no TPU program) predicts from the roofline
    cpu = wb.plan(cfg, mesh=wb.make_mesh(fsdp=8), rules="fsdp", batch=8, seq=128,
                  progress=False)
    assert cpu.report.compiler_cycles == (0, 0)
    assert cpu.predicted.breakdown["local"] == cpu.predicted.breakdown["roofline_local"]


@pytest.mark.multiprocess
def test_gpu_mfu_script_runs_its_step_on_cpu_devices_and_says_when_there_is_no_gpu():
    """benchmarks/gpu_mfu.py (the H100 row) needs GPUs; ``--smoke`` runs its own code path
    on 2 CPU devices: the JSON line's MFU is model FLOPs over the timed step and the
    CPU's measured peak, and the same batch trained 13 times lowers the loss below the
    uniform guess ln(256). Without ``--smoke`` and without a GPU it says so and exits 0."""
    import json
    import math
    import os
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parents[1] / "benchmarks" / "gpu_mfu.py"
    env = dict(os.environ, XLA_FLAGS=re.sub(r"device_count=\d+", "device_count=2",
                                            os.environ["XLA_FLAGS"]))
    out = subprocess.run([sys.executable, str(script), "--smoke"], env=env, text=True,
                         capture_output=True, timeout=600)
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["gpus"] == 2 and row["batch"] == 8 and row["seq"] == 64
    flops = wb._flops.gpt_flops(TINY.replace(seq_len=64), 8, 64).total
    assert row["mfu_causal_halved"] == pytest.approx(
        flops / (row["step_seconds"] * 2 * row["peak_flops"]))
    assert 0 < row["loss"] < math.log(256)
    none = subprocess.run([sys.executable, str(script), "--only", "1b"], env=env, text=True,
                          capture_output=True, timeout=600)
    if not any(d.platform == "gpu" for d in jax.devices()):
        assert none.returncode == 0 and "no GPU here" in none.stderr and not none.stdout


def test_a_plan_over_memory_with_large_logits_names_loss_chunks_and_it_fits():
    """A large-vocabulary step that does not fit (estimate on an abstract H100 mesh): the
    memory lint's fix names a loss_chunks value; that config's plan fits. With XLA
    attention the recomputed scores outweigh the logits and no loss_chunks is named."""
    cfg = GPTConfig.preset("1b", vocab_size=256_000, seq_len=8192, dtype="bfloat16",
                           remat="full", attention="cudnn")
    mesh = wb.abstract_mesh("8xH100", fsdp=-1)
    big = wb.plan(cfg, mesh=mesh, rules="fsdp", batch=128, seq=8192, progress=False)
    assert big.fits is False
    (lint,) = [w for w in big.warnings if w.kind == "memory"]
    k = int(re.search(r"GPTConfig\(loss_chunks=(\d+)\)", lint.fix).group(1))
    fixed = wb.plan(cfg.replace(loss_chunks=k), mesh=mesh, rules="fsdp", batch=128,
                    seq=8192, progress=False)
    assert fixed.fits and not [w for w in fixed.warnings if w.kind == "memory"]
    assert fixed.memory["total"] < big.memory["total"]
    xla = wb.plan(cfg.replace(attention="xla"), mesh=mesh, rules="fsdp", batch=128,
                  seq=8192, progress=False)
    (lint,) = [w for w in xla.warnings if w.kind == "memory"]
    assert "loss_chunks" not in lint.fix


@pytest.mark.tpu
@needs_tpu
def test_a_tpu_compiler_failure_on_an_abstract_slice_is_an_estimate_that_says_why():
    """libtpu 0.0.42 fails ("Can't deep copy instruction tuple") on zig-zag ring attention
    in bfloat16 with unscanned layers: the plan falls back to the formulas and names the
    compiler's error instead of raising; the scanned model compiles (the reference)."""
    cfg = TINY.replace(dtype="bfloat16", context_attention="ring", context_zigzag=True,
                       seq_len=256)
    mesh = wb.abstract_mesh("v5e-8", data=2, context=4)
    p = wb.plan(cfg, mesh=mesh, rules="cp", batch=4, seq=256, progress=False)
    if p.source == "tpu-compiler":
        pytest.skip("this libtpu compiles the step: nothing to fall back from")
    assert p.source == "estimate" and p.report.is_estimate
    assert p.source_reason.startswith("the tpu compiler failed on this step (")
    assert p.memory["total"] > 0 and p.predicted.step_seconds > 0
    scanned = wb.plan(cfg.replace(scan_layers=True), mesh=mesh, rules="cp", batch=4,
                      seq=256, progress=False)
    assert scanned.source == "tpu-compiler"
