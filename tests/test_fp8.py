"""fp8 training (issue 58 item 1): ``GPTConfig(quantization="fp8")`` puts the blocks'
projections in fp8 through qwix (e4m3 forward, e5m2 gradients, current absmax scales).

References: jnp.einsum in float32 (the fp8 matmul's error bound from e4m3's 3 mantissa
bits), a hand count of the projections' matmuls in the jaxpr and in the TPU compiler's HLO
(tpu7x, v6e, v5p), the bf16 run of the same seed and data (30 steps of tiny), the roofline
by hand at the catalogue's fp8 peak.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import workbench as wb
from workbench._compiled.graph import dot_dtypes
from workbench.hardware import effective_spec, hardware_spec
from workbench.models import GPT, GPTConfig
from workbench.models import _fp8 as fp8
from workbench.perf import StepCost
from workbench.perf._predict import predict
from workbench._sharding.mesh import mesh_info
from workbench.train._metrics import step_record

from _tpu import tpu

TINY = GPTConfig.preset("tiny")
FP8 = TINY.replace(quantization="fp8")
#: the projections of a block: q, k, v, o and the SwiGLU's gate, up, down
PROJECTIONS = 7
#: tiny with heads and widths of the TPU's 128 lanes: libtpu 0.0.50 aborts the process
#: compiling tiny's 16-wide heads in fp8 for v6e (fusion_emitter: "Cannot find a valid
#: window" for an f8e5m2 gradient fusion); at 128 it compiles on tpu7x, v6e and v5p
TPU_FP8 = FP8.replace(d_model=256, n_heads=2, n_kv_heads=2, head_dim=128, d_ff=512)
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)


# --- the field --------------------------------------------------------------------------

def test_the_field_defaults_to_none_and_keeps_old_hashes() -> None:
    assert TINY.quantization is None and "quantization" not in TINY.to_dict()
    assert FP8.to_dict()["quantization"] == "fp8"
    assert GPTConfig(**FP8.to_dict()) == FP8                  # JSON round trip
    cfg = wb.TrainConfig(model="tiny", model_overrides={"quantization": "fp8"})
    assert wb.TrainConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize(("value", "error"), [
    ("int8", ValueError), ("FP8", ValueError), ("fp8 ", ValueError), ("", ValueError),
    (8, TypeError), (True, TypeError), (["fp8"], TypeError), (jnp.float8_e4m3fn, TypeError)])
def test_bad_values_are_refused_with_the_choices(value, error) -> None:
    with pytest.raises(error, match=r"GPTConfig\.quantization=.*choose None .*\['fp8'\]"):
        TINY.replace(quantization=value)


def test_mixture_of_experts_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"quantization='fp8' with n_experts=8.*set "
                                         r"quantization=None.*or n_experts=0"):
        GPTConfig.preset("moe-tiny", quantization="fp8")


def test_lora_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"quantization='fp8' with lora=.*set "
                                         r"quantization=None to train adapters, or lora=None"):
        FP8.replace(lora={"rank": 2, "alpha": 4})
    with pytest.raises(ValueError, match=r"GPTConfig\.quantization='fp8' with lora="):
        wb.TrainConfig(model="tiny", model_overrides={"quantization": "fp8"},
                       lora={"rank": 2, "alpha": 4}).check()


def test_no_scale_is_state() -> None:
    """Current scaling: the fp8 model has exactly the bf16 model's state (nothing new in the
    checkpoint, so a resume restores everything the step reads)."""
    def paths(cfg):
        return {p: x.shape for p, x in nnx.to_flat_state(nnx.state(
            nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))))}
    assert paths(FP8) == paths(TINY)


# --- the numbers ------------------------------------------------------------------------

def test_an_fp8_matmul_is_within_e4m3s_rounding_of_float32() -> None:
    """Each operand rounded to e4m3 (3 mantissa bits: relative error <= 2**-4 after its
    absmax scale) gives |y - y32| <= (2 * 2**-4 + 2**-8) * (|x| @ |w|); and it is not the
    float32 product (fp8 really ran)."""
    x = jax.random.normal(jax.random.key(0), (2, 8, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (64, 32), jnp.float32)
    y = fp8.einsum("btd,df->btf", x, w, "fp8")
    y32 = jnp.einsum("btd,df->btf", x, w, precision="highest")
    bound = (2 * 2**-4 + 2**-8) * jnp.einsum("btd,df->btf", jnp.abs(x), jnp.abs(w),
                                             precision="highest")
    assert y.dtype == jnp.float32 and bool(jnp.all(jnp.abs(y - y32) <= bound))
    assert float(jnp.max(jnp.abs(y - y32))) > 1e-3 * float(jnp.max(jnp.abs(y32)))
    assert fp8.einsum("btd,df->btf", x, w, None).tolist() == jnp.einsum(
        "btd,df->btf", x, w).tolist()


def _dots(jaxpr, out):
    """Operand dtypes of every dot_general of ``jaxpr``, its sub-jaxprs' included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(tuple(v.aval.dtype for v in eqn.invars[:2]))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)          # a ClosedJaxpr's jaxpr
                if hasattr(sub, "eqns"):
                    _dots(sub, out)
    return out


@pytest.mark.parametrize("scan", [False, True])
def test_the_projections_run_in_fp8_and_attention_and_logits_do_not(scan) -> None:
    """Hand count, per layer: 7 forward e4m3 x e4m3 matmuls, 7 x 2 backward ones with an
    e5m2 gradient; the attention's score and value matmuls and the logits in the compute
    dtype (float32 on CPU)."""
    cfg = FP8.replace(scan_layers=scan, attention="xla")
    model = GPT(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jnp.zeros((2, 16), jnp.int32)

    def loss(p):
        return nnx.merge(graphdef, p)(tokens).astype(jnp.float32).mean()

    dots = _dots(jax.make_jaxpr(jax.grad(loss))(params).jaxpr, [])
    layers = 1 if scan else cfg.n_layers           # a scan body is traced once
    f32 = jnp.dtype(jnp.float32)
    assert dots.count((E4M3, E4M3)) == PROJECTIONS * layers
    assert dots.count((E5M2, E4M3)) + dots.count((E4M3, E5M2)) == 2 * PROJECTIONS * layers
    assert all(d in {(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2), (f32, f32)} for d in dots)
    # attention: q.k and p.v forward, 2 each backward; logits: 1 forward, 2 backward
    assert dots.count((f32, f32)) == 6 * layers + 3


def _losses(cfg_overrides, steps=30):
    cfg = wb.TrainConfig(model="tiny", model_overrides=cfg_overrides, mesh={"data": 8},
                         rules="fsdp", batch=8, seq=64, steps=steps, seed=0,
                         data=wb.data.TextData(max_bytes=200_000),
                         optimizer=wb.train.AdamW(lr=3e-3, warmup_steps=5))
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        tr = wb.Trainer(cfg, run_dir=f"{d}/run", progress=None)
        tr.run()
        return tr.losses


def test_30_steps_of_tiny_in_fp8_end_within_3_percent_of_the_bf16_loss() -> None:
    """Same seed, same data: the loss falls as in the compute dtype's run and ends within
    3% of it; the runs differ (the fp8 one quantized its matmuls)."""
    ref, ours = _losses({}), _losses({"quantization": "fp8"})
    assert len(ref) == len(ours) == 30 and ref[-1] < 0.8 * ref[0]
    assert abs(ours[-1] - ref[-1]) <= 0.03 * ref[-1], (ref[-1], ours[-1])
    assert ours != ref


# --- plans and MFU ----------------------------------------------------------------------

def test_the_roofline_times_fp8_flops_at_the_fp8_peak_and_mfu_is_given_against_both() -> None:
    mesh = wb.abstract_mesh("tpu7x-8", data=-1)
    spec = hardware_spec("TPU7x")
    flops, f8, model = 4e12, 3e12, 3e13
    base = dict(flops=flops, bytes_accessed=1e9, mesh=mesh, model_flops=model,
                tokens_per_step=1024)
    on = effective_spec(mesh_info(mesh), hardware=spec)
    p, p0 = predict(StepCost(**base, fp8_flops=f8), on), predict(StepCost(**base), on)
    assert p.breakdown["compute"] == pytest.approx((flops - f8) / spec.peak_flops
                                                   + f8 / spec.fp8_flops, rel=1e-12)
    assert p0.breakdown["compute"] == pytest.approx(flops / spec.peak_flops, rel=1e-12)
    n = mesh_size = 8
    assert p.mfu == pytest.approx(model / (p.step_seconds * n * spec.peak_flops))
    assert p.mfu_fp8 == pytest.approx(model / (p.step_seconds * mesh_size * spec.fp8_flops))
    assert p0.mfu_fp8 is None and p.to_dict()["mfu_fp8"] == p.mfu_fp8
    assert f"{p.mfu:.1%} of the bf16 peak, {p.mfu_fp8:.1%} of the fp8 peak" in str(p)
    assert "75% of the FLOPs in fp8 matmuls" in p.sources["peak_flops"]
    # a chip without an fp8 peak (A100) runs them at its bf16 rate and has one MFU
    a100 = hardware_spec("NVIDIA A100-SXM4-80GB")
    pa = predict(StepCost(**base, fp8_flops=f8), effective_spec(mesh_info(mesh), hardware=a100))
    assert pa.breakdown["compute"] == pytest.approx(flops / a100.peak_flops, rel=1e-12)
    assert pa.mfu_fp8 is None


def test_the_mfu_envelope_holds_against_the_peak_the_matmuls_run_at() -> None:
    """An fp8 step at 85% of the bf16 peak is 42.5% of the fp8 one: plausible (MaxText's
    Ironwood fp8 70B row is 80% of the bf16 peak); the same step in bf16 is flagged."""
    mesh, spec = wb.abstract_mesh("tpu7x-8", data=-1), hardware_spec("TPU7x")
    step = 1.0
    model = 0.85 * step * 8 * spec.peak_flops
    base = dict(bytes_accessed=0.0, mesh=mesh, model_flops=model, compute_seconds=step)
    on = effective_spec(mesh_info(mesh), hardware=spec)
    fp8_step = predict(StepCost(flops=model / 8, fp8_flops=model / 8, **base), on)
    assert fp8_step.mfu == pytest.approx(0.85) and not fp8_step.implausible
    assert any("MFU 85%" in w for w in predict(StepCost(flops=model / 8, **base), on).implausible)


def test_a_run_reports_mfu_against_both_peaks() -> None:
    args = dict(step=1, loss=2.0, grad_norm=1.0, lr=1e-3, step_time=2.0, data_time=0.0,
                ckpt_time=0.0, tokens=1024, model_flops=8e15, n_devices=4, peak=1e15,
                peak_source="table", compiled_flops=None)
    rec = step_record(**args, fp8_peak=2e15)
    assert rec["mfu"] == pytest.approx(1.0) and rec["mfu_fp8"] == pytest.approx(0.5)
    assert "mfu_fp8" not in step_record(**args)


@tpu
@pytest.mark.parametrize("preset", ["tpu7x-8", "v6e-8", "v5p-8"])
def test_a_tpu_compiled_plan_holds_fp8_dots_and_predicts_at_the_fp8_peak(preset) -> None:
    """The TPU compiler's HLO of the fp8 step: per layer 7 e4m3 x e4m3 matmuls, 14 with an
    e5m2 gradient; the logits (forward, 2 backward) in bf16; attention in the splash kernel.
    v6e and v5p take fp8 at their bf16 rate (the catalogue's fp8 peak is their bf16 one)."""
    plan = wb.plan(TPU_FP8, mesh=wb.abstract_mesh(preset, data=-1), rules="fsdp", batch=8,
                   seq=128, progress=False, overlap=False)   # the matmuls need no flags
    assert plan.source == "tpu-compiler"
    dots = dot_dtypes(plan.compiled.as_text())
    layers = TPU_FP8.n_layers
    assert dots.get(("f8e4m3fn", "f8e4m3fn"), 0) == PROJECTIONS * layers, dots
    assert dots.get(("f8e5m2", "f8e4m3fn"), 0) + dots.get(("f8e4m3fn", "f8e5m2"), 0) \
        == 2 * PROJECTIONS * layers, dots
    assert dots.get(("bf16", "bf16"), 0) == 3, dots
    p, spec = plan.predicted, hardware_spec(plan.mesh.device_kind)
    fp8_model = plan.report.flops.fp8
    proj = plan.report.flops.breakdown
    assert fp8_model == proj["qkv"] + proj["out_proj"] + proj["mlp"] > 0
    assert p.mfu_fp8 == pytest.approx(p.mfu * spec.peak_flops / spec.fp8_flops, rel=1e-9)
    assert ("of the fp8 peak" in str(plan.report)) and math.isfinite(p.step_seconds)
    bf16 = wb.plan(TPU_FP8.replace(quantization=None), mesh=wb.abstract_mesh(preset, data=-1), rules="fsdp", batch=8,
                   seq=128, progress=False, overlap=False)
    assert not any(k[0].startswith("f8") for k in dot_dtypes(bf16.compiled.as_text()))
    assert bf16.predicted.mfu_fp8 is None and bf16.report.flops.fp8 == 0


def test_fp8_plans_count_the_same_model_flops() -> None:
    """MFU's numerator is the model's FLOPs whatever the matmuls run in."""
    from workbench._flops import gpt_flops

    a, b = gpt_flops(TINY, 8, 128), gpt_flops(FP8, 8, 128)
    assert a.total == b.total and a.fp8 == 0
    assert b.fp8 == pytest.approx(b.total - b.breakdown["attention"] - b.breakdown["logits"])
    assert np.isclose(b.fp8 / b.total, 1 - (a.breakdown["attention"] + a.breakdown["logits"])
                      / a.total)


def test_the_views_show_mfu_against_both_peaks(tmp_path) -> None:
    """A run's line, its run-list summary (the lab panel's) and a plan's recorded
    prediction carry ``mfu_fp8`` beside ``mfu``; a bf16 run's have no fp8 figure."""
    from workbench import _runs as runs
    from workbench.server._watch import RunWatch
    from workbench.train._metrics import summary_line

    rec = {"step": 3, "loss": 2.0, "step_time": 0.5, "mfu": 0.4, "mfu_fp8": 0.2}
    assert "MFU 40.00% (fp8 peak 20.00%)" in summary_line(rec, 10, None)
    assert "fp8" not in summary_line({**rec, "mfu_fp8": None}, 10, None)
    with runs.RunWriter(tmp_path / "run", config={"model": "tiny"},
                        meta={"prediction": {"step_seconds": 0.4, "mfu": 0.5,
                                             "mfu_fp8": 0.25}}) as w:
        w.log(rec)
    watch = RunWatch("run", tmp_path / "run")
    watch.refresh()
    summary = watch.summary()
    assert summary["mfu"] == 0.4 and summary["mfu_fp8"] == 0.2
    assert summary["prediction"]["mfu_fp8"] == 0.25
