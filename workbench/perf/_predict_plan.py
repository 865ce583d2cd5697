"""A plan's predicted step: the report's numbers (the compiled program's where they can be
trusted, else the formulas') fed to the roofline (``workbench.perf._predict``) with one
effective hardware spec (``workbench.hardware.effective_spec``), passed in by the caller.

This is the one predictor of a plan: ``wb.plan`` calls it once, when the plan is made,
with ``effective_spec(mesh)`` (the mesh's device kind, the calibration stored then) and
stores the prediction in the report (``PlanReport.predicted``); ``Plan.predict`` calls it
again for another chip, overlap or calibration. Nothing here reads a file or looks a
calibration up.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from workbench.hardware._effective import EffectiveSpec
from workbench.models._remat import resolve_remat
from workbench.perf._analytic import batch_axes, weight_axes
from workbench.perf._efficiency import StepNumbers, efficient_local
from workbench.perf._host import HostTime, host_seconds
from workbench.perf._bounds import implausible
from workbench.perf._cost import StepCost
from workbench.perf._predict import compute_seconds_at_peak, predict
from workbench.perf._prediction import Prediction
from workbench.perf._refit import FIT_SET, refit_factor

__all__ = ["UNDERCOUNT", "predict_plan", "step_numbers"]

#: A compiled step whose cost analysis counts less than this fraction of the model's own
#: FLOPs per device left work out (custom-call GEMMs): its prediction uses the analytic
#: FLOPs. The compiled count is otherwise >= the model's (it adds recompute, softmax,
#: norms and the optimizer), so 0.9 leaves room only for rounding of the model's count.
UNDERCOUNT = 0.9


def predict_plan(report: Any, spec: EffectiveSpec, *, overlap: float | None = None
                 ) -> Prediction:
    """A prediction of one step of ``report`` (a ``PlanReport``) on ``spec``'s hardware.

    The FLOPs and HBM bytes are the compiled program's cost analysis, unless the program
    loops over layers (XLA counts a loop body once) or its FLOPs fall short of the model's
    own (:func:`_undercounted_flops`): then the formulas'. A fused attention kernel's FLOPs
    (``report.kernel_flops``) are added by formula. A TPU-compiled plan on its own chip
    (``spec.for_mesh``) times its local work with the TPU compiler's cycle estimates at
    the chip's clock; the roofline stays in the breakdown. Activations offloaded to host
    memory (``report.host_traffic``, read from the compiled HLO) add what their trips over
    the chip's host link (``host_bandwidth``) leave exposed beside the compute the
    compiler scheduled around them (``workbench.perf._host.host_seconds``).

    Args:
      report: the plan's ``PlanReport``.
      spec: the effective hardware spec (``workbench.hardware.effective_spec``).
      overlap: fraction of communication hidden behind compute (default by platform, or
        the calibration's measured one).
    """
    _check(report, spec)
    flops, kernel_dev, nbytes, compiled, why = _counts(report)
    label = f"{report.source} cost analysis"
    kernel, cfg = report.kernel_flops, report.cfg
    fp8 = _fp8_flops(report, flops - kernel_dev)
    compute_seconds, compute_source, t_kernel = _compiler_compute(
        report, spec, kernel, flops - kernel_dev, fp8) if spec.for_mesh \
        else (None, "", 0.0)
    if compute_seconds is None and spec.efficiency is not None and cfg is not None:
        # a GPU measured on a lent run, no calibration: its efficiencies time the local work
        compute_seconds, _, compute_source = efficient_local(StepNumbers(
            matmul_flops=flops - kernel_dev, attention_flops=kernel_dev, hbm_bytes=nbytes,
            d_model=cfg.d_model), spec.efficiency, spec.spec.peak_flops)
    host, host_why = _host_time(report, spec, t_kernel)
    cost = StepCost(
        flops=flops, bytes_accessed=nbytes, collectives=report.collectives, mesh=report.mesh,
        tokens_per_step=report.batch * report.seq if cfg is not None
        or report.flops.tokens == report.batch * report.seq else None,
        model_flops=report.model_flops, fp8_flops=fp8,
        compiler_seconds=report.cost.get("optimal_seconds") if compiled else None,
        compute_seconds=compute_seconds, compute_source=compute_source,
        exposed_axes=_weight_only_axes(report), sync_exposed=report.source == "tpu-compiler",
        host=host, host_source=host_why,
        flops_source=_flops_source(report, compiled, why, kernel),
        bytes_source=label if compiled else why + "estimate (analytic.hbm_bytes)")
    pred = predict(cost, spec, overlap=overlap)
    if report.source == "estimate" and compute_seconds is None:
        pred = _refitted(pred, refit_factor(report), flops, spec)
    return pred


def _check(report: Any, spec: Any) -> None:
    """A ``TypeError`` naming the argument that is not a plan's report or a spec."""
    if not all(hasattr(report, a) for a in ("compiled_numbers", "collectives", "layouts")):
        hint = " (a Plan: give plan.report)" if hasattr(report, "report") else ""
        raise TypeError(f"predict_plan: report={report!r:.80} is a {type(report).__name__}, "
                        f"not a PlanReport{hint}; give wb.plan(...).report")
    if not isinstance(spec, EffectiveSpec):
        raise TypeError(f"predict_plan: spec={spec!r:.80} is a {type(spec).__name__}, not "
                        "an EffectiveSpec; give wb.hardware.effective_spec(report.mesh) (the "
                        "stored calibration, if any), or with calibration=False, or "
                        "hardware='TPU v5p' for another chip")


def _flops_source(report: Any, compiled: bool, why: str, kernel: float) -> str:
    """Where the prediction's FLOPs come from."""
    label = f"{report.source} cost analysis"
    return (label if compiled else why + "model FLOPs (+ remat"
            + (", + the experts' empty slots: analytic.moe_padding_flops"
               if report.padding_flops else "") + ") / compute split") + (
        f"; + the {report.attention.split(':')[0]} kernel's FLOPs by formula "
        "(attention_cost.kernel_flops: cost analysis does not count Pallas kernels)"
        if kernel else "")


def _refitted(pred: Prediction, k: float, flops: float, spec: EffectiveSpec) -> Prediction:
    """``pred`` (a formula plan's) with its step times ``k``, the refit's compiled/formula
    ratio for its layout (``workbench.perf._refit``); MFU and tokens/s follow, the
    physical bounds are checked again, and the roofline's own terms stay as they were
    (``breakdown["refit"]`` is ``k``)."""
    if k == 1.0:
        return pred
    b = pred.breakdown
    step = pred.step_seconds * k
    mfu = None if pred.mfu is None else pred.mfu / k
    blended = mfu * spec.spec.peak_flops * b["compute"] / flops \
        if mfu is not None and flops > 0 else mfu
    flagged = implausible(step=step, roofline=b["roofline_local"], local=b["local"],
                          mfu=blended, compiler_local=False)
    return dataclasses.replace(
        pred, step_seconds=step, mfu=mfu,
        mfu_fp8=None if pred.mfu_fp8 is None else pred.mfu_fp8 / k,
        tokens_per_s=None if pred.tokens_per_s is None else pred.tokens_per_s / k,
        breakdown={**b, "refit": k, "formula_step": pred.step_seconds,
                   "no_overlap_step": b["no_overlap_step"] * k},
        sources={**pred.sources, "refit": f"x{k:.3f}: the formula's step refitted to the "
                 "TPU compiler's for this layout (workbench.perf._refit, fitted on "
                 + FIT_SET + ")",
                 "bounds": "; ".join(flagged) if flagged else (
                     "within the physical bounds (workbench.perf._bounds): not below "
                     "its own roofline, MFU at most the published envelope")},
        implausible=flagged)


def _counts(report: Any) -> tuple[float, float, float, bool, str]:
    """``(flops, kernel, bytes, compiled, why)`` of one step on one device: the FLOPs the
    prediction divides by the peak (the fused kernel's included), the fused attention
    kernel's share of them, the HBM bytes, whether both are the compiled program's, and
    why not."""
    cost = report.cost
    compiled = "bytes accessed" in cost and cost.get("flops", 0) > 0 and not report.loops
    why = ("analytic: the compiled program loops over layers and XLA's cost analysis "
           "counts a loop body once; " if report.loops else "")
    undercount = _undercounted_flops(report) if compiled else None
    if undercount:
        compiled, why = False, undercount
    kernel, attn = report.kernel_flops, 0.0
    cfg = report.cfg
    if kernel and not compiled:   # the formula's attention gives way to the kernel's
        fwd_attn = report.flops.breakdown["attention"] / 3
        attn = 3 * fwd_attn + (fwd_attn if cfg is not None and cfg.remat != "none"
                               and "context" not in _kept(cfg.remat) else 0.0)
    split = report.compute_split
    flops = (cost["flops"] + kernel / split) if compiled else \
        (report.model_flops + report.flops.recompute - attn + kernel + report.padding_flops) \
        / split * report.pipeline_factor
    nbytes = cost["bytes accessed"] if compiled else report.hbm_bytes_estimate
    return flops, kernel / split, nbytes, compiled, why


def step_numbers(report: Any, name: str = "") -> StepNumbers:
    """What :func:`predict_plan` counts for one step of ``report`` (a GPT plan's
    ``PlanReport``) on one device: the FLOPs outside the fused attention kernel, the
    kernel's FLOPs and the HBM bytes (what ``workbench.perf._efficiency`` fits to a
    profile and predicts with).

    Raises:
      ValueError: the plan is of a model factory (no model width).
    """
    if report.cfg is None:
        raise ValueError("step_numbers: the plan is of a model factory, not a GPTConfig; "
                         "the efficiencies' shape classes need the model width")
    flops, kernel, nbytes, _, _ = _counts(report)
    return StepNumbers(matmul_flops=flops - kernel, attention_flops=kernel, hbm_bytes=nbytes,
                       d_model=report.cfg.d_model, name=name)


def _host_time(report: Any, spec: EffectiveSpec, kernel_seconds: float
               ) -> tuple[HostTime | None, str]:
    """The step's host transfers timed at the chip's host-link bandwidth, or (None, why)
    when nothing moves to host memory or the table has no host link. ``kernel_seconds``:
    the Pallas kernels' time per step, spread evenly over their calls as compute the
    transfers can hide behind."""
    traffic = getattr(report, "host_traffic", None)
    if not traffic:
        return None, ""
    chip = spec.spec
    up, down = traffic.to_host_bytes, traffic.to_device_bytes
    if not chip.host_bandwidth:
        return None, (f"not timed: {chip.name} has no host-link bandwidth in the hardware "
                      f"table ({up / 1e9:.3g} GB to host and {down / 1e9:.3g} GB back per "
                      "step)")
    clock = chip.clock_hz or spec.table.clock_hz
    per_call = kernel_seconds / traffic.kernel_calls if traffic.kernel_calls else 0.0
    # the traffic is one device's; a chip's devices (TPU7x: 2 TensorCores) share its link
    bandwidth = chip.host_bandwidth / max(1, chip.cores_per_chip)
    source = chip.source_of("host_bandwidth") + (
        f"; shared by the chip's {chip.cores_per_chip} devices" if chip.cores_per_chip > 1
        else "")
    if not clock:   # no cycles to place the compute: nothing is assumed hidden
        t = host_seconds(traffic, bandwidth=bandwidth, clock_hz=1.0, source=source)
        return dataclasses.replace(t, exposed_seconds=t.link_seconds, hidden_seconds=0.0,
                                   formula=t.formula + "; no clock: counted in full"), ""
    return host_seconds(traffic, bandwidth=bandwidth, clock_hz=clock,
                        kernel_seconds=per_call, source=source), ""


def _fp8_flops(report: Any, flops: float) -> float:
    """FLOPs per device of the step's fp8 matmuls (``GPTConfig.quantization``): the
    projections' model FLOPs (``FlopCount.fp8``) divided as the step's compute is, at most
    ``flops`` (the step's FLOPs besides any Pallas kernel); remat's recompute of them is
    counted at the bf16 rate."""
    fp8 = getattr(report.flops, "fp8", 0.0)
    if not fp8:
        return 0.0
    return min(flops, fp8 / report.compute_split * report.pipeline_factor)


def _compiler_compute(report: Any, spec: EffectiveSpec, kernel: float, other_flops: float,
                      fp8_flops: float = 0.0) -> tuple[float | None, str, float]:
    """The local work of a step timed by the TPU compiler's cycle estimates at the chip's
    clock (the uncalibrated entry's: ``spec.table``), plus the Pallas kernels' FLOPs
    (``kernel``, all devices) at the efficiency the compiler's cycles give the rest of the
    step's FLOPs (``other_flops``, per device; ``fp8_flops`` of them at the fp8 peak),
    and the kernels' seconds alone;
    (None, "", 0.0) when there are no cycles (not TPU-compiled, or no clock for this chip
    in the hardware table)."""
    cycles, n = report.compiler_cycles
    chip = spec.table if cycles else None
    if chip is None or not chip.clock_hz:
        return None, "", 0.0
    t_cycles = cycles / chip.clock_hz
    t_unknown, unknown_why = _unestimated_seconds(report, chip)
    t_cycles += t_unknown
    efficiency = min(1.0, compute_seconds_at_peak(other_flops, fp8_flops, chip) / t_cycles) \
        if other_flops > 0 else 1.0
    t_kernel = kernel / report.compute_split / chip.peak_flops / efficiency
    why = (f"the TPU compiler's own cycle estimates: {n} instructions, {cycles:.4g} "
           f"cycles per step (loop bodies x trip count) at {chip.clock_hz / 1e9:.3g} GHz "
           f"({chip.source_of('clock_hz')}) = {t_cycles:.4g} s, {efficiency:.0%} of "
           f"peak FLOP/s for the step's other FLOPs") + unknown_why
    if kernel:
        why += (f"; + the {report.attention.split(':')[0]} kernel's FLOPs at that "
                f"efficiency, {t_kernel:.3g} s (the compiler does not model Pallas "
                "kernels)")
    return t_cycles + t_kernel, why, t_kernel


def _unestimated_seconds(report: Any, chip: Any) -> tuple[float, str]:
    """Seconds per step of the instructions the TPU compiler marks unknown
    (``hlo.unestimated_instructions``), each timed by its roofline: the bytes it reads
    and writes at the HBM bandwidth; and the sentence that says so."""
    numbers = report.compiled_numbers
    unknown = numbers.unknown if numbers is not None else []
    if not unknown:
        return 0.0, ""
    nbytes = sum(b * n for _, b, n in unknown)
    seconds = nbytes / chip.hbm_bandwidth
    names = ", ".join(sorted({name for name, _, _ in unknown})[:4])
    return seconds, (
        f"; {len(unknown)} instruction(s) the compiler marks unknown (estimated_cycles "
        f"2**63-1: {names}) timed by their roofline instead: {nbytes:.4g} bytes read and "
        f"written at {chip.hbm_bandwidth / 1e12:.3g} TB/s = {seconds:.3g} s")


def _undercounted_flops(report: Any) -> str:
    """Why the compiler's FLOP count cannot be the step's, or "": below the model's own
    FLOPs per device (``6 N T`` and attention, without remat or kernels) it left work out.
    XLA:GPU's cost analysis does not count the cuBLAS / cuDNN GEMMs its custom calls run
    (on an H200, GPT "small" in bfloat16: about a fifth of 6 N T); the analytic FLOPs are
    used instead and the sources say so."""
    if report.cfg is None or not report.model_flops:
        return ""
    floor = report.model_flops / report.compute_split
    counted = float(report.cost.get("flops", 0.0)) + report.kernel_flops / report.compute_split
    if counted >= UNDERCOUNT * floor:
        return ""
    return (f"analytic: the {report.source} cost analysis counts {counted:.4g} FLOPs per "
            f"device, {counted / floor:.0%} of the model's own {floor:.4g} (it leaves "
            "out the matmuls of custom calls, e.g. cuBLAS GEMMs on GPUs); ")


def _weight_only_axes(report: Any) -> tuple[str, ...]:
    """Mesh axes (size > 1) that shard weights but split neither batch nor sequence:
    their collectives carry activations between the matmuls of one layer."""
    params = {k: v for k, v in report.layouts.items() if k.startswith("params.")}
    bat = set(batch_axes(report.rules, report.mesh))
    return tuple(a for a in report.mesh.axis_names
                 if a in weight_axes(params) and a not in bat and report.mesh.shape[a] > 1)


def _kept(remat: Any) -> set[str]:
    """Checkpoint names a remat policy saves or offloads."""
    p = resolve_remat(remat)
    return set(p.saved) | set(p.offloaded)
