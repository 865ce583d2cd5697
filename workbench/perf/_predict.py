"""Predicted step time and MFU: a roofline over FLOPs, HBM bytes and collectives.

Formulas and their sources are in docs/predictions.md. In short, per device and step:

    compute   = FLOPs / peak FLOP/s
    memory    = bytes accessed / HBM bandwidth
    local     = max(compute, memory)                 (the roofline: they overlap; on
                                                      CPU compute + memory: shared cores;
                                                      calibrated, compute + memory: each is
                                                      then the time measured in its kernels)
                or, for a TPU-compiled plan, the TPU compiler's own cycle estimates of
                every fusion it scheduled (x loop trip counts) at the chip's clock, plus
                the Pallas kernels' FLOPs at the efficiency those cycles give the step's
                other FLOPs (``compute_seconds``)
    comm      = sum of collective times (the ring formulas of ``perf._collective_time``,
                per mesh axis bandwidth)
    exposed   = the collectives on the critical path (``exposed_axes``: tensor-parallel
                traffic, whose result the next matmul waits for)
    host      = the offloaded activations' trips to host memory and back that the compute
                scheduled beside them does not hide (``workbench.perf._host``: read from the
                compiled HLO, timed at the chip's host-link bandwidth)
    step      = local + exposed + (comm - exposed) - overlap * min(local, comm - exposed)
                + host

The result is a ``perf._prediction.Prediction``, each number with its source.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from workbench.hardware._calibration import Calibration
from workbench._validate import check_float
from workbench.hardware._catalogue import HardwareSpec
from workbench.hardware._effective import EffectiveSpec
from workbench.perf._band import prediction_band
from workbench.perf._bounds import implausible
from workbench.perf._collective_time import CollectiveTime, calibrated_time, collective_seconds
from workbench.perf._cost import StepCost
from workbench.perf._host import HostTime
from workbench.perf._prediction import Prediction

__all__ = ["predict"]

BOUNDS = ("compute", "memory", "communication")


# -- the roofline ---------------------------------------------------------------------------

def _default_overlap(platform: str) -> tuple[float, str]:
    if platform == "cpu":
        return 0.0, "assumed 0: XLA:CPU runs collectives synchronously"
    return 1.0, ("assumed 1: XLA's latency-hiding scheduler runs collectives asynchronously "
                 "beside independent compute (a lower bound on step time; "
                 "'no_overlap_step' is the upper bound)")


def local_seconds(t_compute: float, t_memory: float, *, additive: bool,
                   compute_seconds: float | None, compute_source: str) -> tuple[float, float, str]:
    """``(roofline, local, source)``: the roofline's local work (compute and memory added
    where they take turns, else the larger), and the local work the step uses: the
    compiler's own timing where given, never faster than the roofline (the source says
    when it was raised)."""
    t_roofline = t_compute + t_memory if additive else max(t_compute, t_memory)
    t_local = t_roofline if compute_seconds is None else float(compute_seconds)
    if compute_seconds is not None and t_local < t_roofline:   # faster than peak: impossible
        t_local, compute_source = t_roofline, compute_source + (
            f"; raised to the roofline ({t_roofline:.4g} s): the cycle estimates "
            f"({float(compute_seconds):.4g} s) are faster than the chip's peak")
    return t_roofline, t_local, compute_source


def _host_terms(host: HostTime | None) -> dict[str, float]:
    """The breakdown's host-transfer terms (zeros where nothing moves to host memory);
    ``host_link_total``: both directions' bytes at the link's bandwidth, none hidden."""
    if host is None:
        return {"host_transfers": 0.0, "host_link": 0.0, "host_bytes_to_host": 0.0,
                "host_bytes_to_device": 0.0, "host_link_total": 0.0}
    return {"host_transfers": host.exposed_seconds, "host_link": host.link_seconds,
            "host_bytes_to_host": host.to_host_bytes,
            "host_bytes_to_device": host.to_device_bytes,
            "host_link_total": (host.to_host_bytes + host.to_device_bytes) / host.bandwidth}


def predict(cost: StepCost, spec: EffectiveSpec, *, overlap: float | None = None
            ) -> Prediction:
    """Predict one training step's time, MFU and throughput (a roofline) of ``cost`` on
    ``spec``'s hardware.

    Args:
      cost: the step's numbers per device (``StepCost``: FLOPs, HBM bytes, collectives,
        the mesh, and where each comes from); ``perf.predict_plan`` makes it from a plan.
      spec: the ``EffectiveSpec`` to predict with (``wb.hardware.effective_spec(mesh,
        ...)``: the catalogue's entry or the CPU measured here, then a calibration, as the
        caller chose). ``predict`` never reads a stored calibration.
      overlap: fraction (0..1) of the shorter of local work and communication assumed
        hidden; default the calibration's measured one, else by platform (0 on CPU, 1 on
        TPU/GPU), said in ``sources``.

    Raises:
      TypeError: ``cost`` is not a ``StepCost`` or ``spec`` not an ``EffectiveSpec``.
      ValueError: ``overlap`` outside [0, 1], or the hardware table lacks a number the
        step needs (HBM bandwidth, a link's bandwidth).

    Example::

        ca = compiled.cost_analysis()
        cost = StepCost(flops=ca["flops"], bytes_accessed=ca["bytes accessed"],
                        collectives=parse_collectives(compiled.as_text(), names, sizes),
                        mesh=info, tokens_per_step=batch * seq, model_flops=model_flops)
        p = predict(cost, effective_spec(info, calibration=False))
    """
    if not isinstance(cost, StepCost):
        raise TypeError(f"predict: cost={cost!r:.80} is a {type(cost).__name__}, not a "
                        "StepCost; give perf.StepCost(flops=..., bytes_accessed=..., "
                        "mesh=...), or predict a plan with perf.predict_plan(plan.report, spec)")
    if not isinstance(spec, EffectiveSpec):
        raise TypeError(f"predict: spec={spec!r:.80} is a {type(spec).__name__}, not an "
                        "EffectiveSpec; give wb.hardware.effective_spec(mesh) (or "
                        "effective_spec(mesh, hardware='TPU v5p', calibration=False))")
    if overlap is not None:
        overlap = check_float(overlap, "overlap", minimum=0.0, where="predict: ")
    return _roofline(cost, spec, overlap)


def _roofline(cost: StepCost, eff: EffectiveSpec, overlap: float | None) -> Prediction:
    """``predict``'s roofline, its arguments checked."""
    compute_seconds, host = cost.compute_seconds, cost.host
    # spec: the entry with the achieved FLOP/s and bandwidth a profile measured, if any
    spec, cal = eff.spec, eff.calibration
    if not spec.hbm_bandwidth:
        raise ValueError(f"{spec.name} has no HBM bandwidth in the hardware table")
    t_compute = compute_seconds_at_peak(cost.flops, cost.fp8_flops, spec)
    t_memory = cost.bytes_accessed / spec.hbm_bandwidth
    overlap, overlap_src = overlap_of(overlap, cal, spec.platform)
    times, crit = _collective_times(cost, eff)
    cpu = spec.platform == "cpu"
    # XLA:CPU's devices share the host's cores: math and memory traffic take turns. A
    # calibration's factors turn the terms into the time a profile measured in matmul
    # kernels and in memory-bound fusions, which a device's stream runs one after the other
    # (the GPU and TPU traces' overlap is 0): calibrated terms add up as well.
    t_roofline, t_local, compute_source = local_seconds(
        t_compute, t_memory, additive=cpu or bool(cal), compute_seconds=compute_seconds,
        compute_source=cost.compute_source)
    t_comm = sum(t.seconds for t in times)
    t_exposed = sum(t.seconds for t, c in zip(times, crit) if c)
    t_free = t_comm - t_exposed
    hidden = overlap * min(t_local, t_free)
    step = t_local + t_comm - hidden + (host.exposed_seconds if host is not None else 0.0)
    frac = hidden / t_free if t_free else 0.0
    times = [dataclasses.replace(t, overlap=0.0 if c else frac, exposed=c)
             for t, c in zip(times, crit)]
    terms = {"compute": t_compute, "memory": t_memory, "communication": t_comm - hidden}
    mfu, mfu_fp8 = _mfus(cost, step, spec)
    flagged = _flagged(cost, spec, step=step, roofline=t_roofline, local=t_local, mfu=mfu,
                       t_compute=t_compute)
    host_terms = _host_terms(host)
    host_link_total = host_terms.pop("host_link_total")
    compiler_seconds, compiler_source = _compiler_estimate(cost.compiler_seconds)
    return Prediction(
        step_seconds=step, mfu=mfu,
        tokens_per_s=cost.tokens_per_step / step if cost.tokens_per_step and step > 0
        else None,
        bound=_bound(terms, t_local, compiler_timed=compute_seconds is not None),
        breakdown={**terms, "local": t_local, "roofline_local": t_roofline,
                   "communication_total": t_comm, **host_terms,
                   "no_overlap_step": t_local + t_comm + host_link_total,
                   "collectives": tuple(times)},
        sources=_sources(cost, eff, local=compute_source if compute_seconds is not None
                         else _local_source(cpu, bool(cal)),
                         overlap=_overlap_source(overlap_src, cost.exposed_axes if t_exposed
                                                 else (), cost.sync_exposed),
                         compiler=compiler_source, flagged=flagged),
        compiler_seconds=compiler_seconds, implausible=flagged, mfu_fp8=mfu_fp8,
        band=prediction_band(eff, compiler_timed=compute_seconds is not None))


def _bound(terms: dict[str, float], t_local: float, *, compiler_timed: bool) -> str:
    """The largest of the compute, memory and (not hidden) communication terms; where the
    compiler timed the local work (its schedule of math and HBM traffic), communication
    when it is longer than that work, else the larger of compute and memory."""
    if compiler_timed:
        return "communication" if terms["communication"] > t_local else \
            ("compute" if terms["compute"] >= terms["memory"] else "memory")
    return max(BOUNDS, key=lambda k: terms[k])


def _flagged(cost: StepCost, spec: HardwareSpec, *, step: float, roofline: float,
             local: float, mfu: float | None, t_compute: float) -> tuple[str, ...]:
    """Why the step breaks a physical bound (``perf._bounds.implausible``); empty when it
    holds. The envelope holds MFU against the peak the step's own matmuls run at (fp8 and
    bf16 FLOPs blended as ``t_compute`` times them): the bf16-peak MFU of an fp8 step can
    pass 80%."""
    flops = cost.flops
    blended = mfu * spec.peak_flops * t_compute / flops if mfu is not None and flops > 0 \
        else mfu
    return implausible(step=step, roofline=roofline, local=local, mfu=blended,
                       compiler_local=cost.compute_seconds is not None)


def _mfus(cost: StepCost, step: float, spec: HardwareSpec) -> tuple[float | None,
                                                                    float | None]:
    """MFU against the bf16 peak, and against the fp8 peak for a step with fp8 matmuls on
    a chip whose table has one; None without model FLOPs."""
    if cost.model_flops is None or step <= 0:
        return None, None
    devices = cost.mesh.size
    mfu = cost.model_flops / (step * devices * spec.peak_flops)
    fp8 = cost.model_flops / (step * devices * spec.fp8_flops) \
        if cost.fp8_flops > 0 and spec.fp8_flops else None
    return mfu, fp8


def _collective_times(cost: StepCost, eff: EffectiveSpec
                      ) -> tuple[list[CollectiveTime], list[bool]]:
    """Each collective of ``cost`` timed on ``eff``'s links (calibrated where it has a
    calibration), and whether it is on the critical path: over ``exposed_axes`` only, or
    run synchronously by a program that says (``sync_exposed``)."""
    times = [collective_seconds(c, cost.mesh, eff.spec) for c in cost.collectives]
    if eff.calibration:
        times = [calibrated_time(t, eff.calibration, eff.table_latency) for t in times]
    crit = [(bool(t.axes) and set(t.axes) <= set(cost.exposed_axes))
            or (cost.sync_exposed and not c.overlapped)
            for t, c in zip(times, cost.collectives)]
    return times, crit


def _compiler_estimate(seconds: float | None) -> tuple[float | None, str]:
    """The TPU compiler's estimate to show and its source, or None and why not (negative
    or NaN: the compiler's "unknown")."""
    if seconds is not None and not seconds >= 0:
        return None, f"none; its optimal_seconds was {seconds!r} (the compiler's " \
                     "'unknown'): not shown"
    return seconds, ("TPU compiler cost analysis (optimal_seconds)" if seconds is not None
                     else "none")


def _sources(cost: StepCost, eff: EffectiveSpec, *, local: str, overlap: str, compiler: str,
             flagged: tuple[str, ...]) -> dict[str, str]:
    """Where each number of the prediction comes from, by name."""
    spec = eff.spec
    return {"flops": cost.flops_source, "bytes": cost.bytes_source,
            "peak_flops": spec.source + _fp8_source(cost.flops, cost.fp8_flops, spec),
            "hbm_bandwidth": spec.source_of("hbm_bandwidth"), "local": local,
            "overlap": overlap,
            "mfu": "model FLOPs / (step time x devices x peak FLOP/s per device)",
            "host_transfers": _host_source(cost.host, cost.host_source),
            "compiler_seconds": compiler,
            "bounds": "; ".join(flagged) if flagged else (
                "within the physical bounds (workbench.perf._bounds): not below "
                "its own roofline, MFU at most the published envelope")} | (
        {"calibration": eff.calibration.source} if eff.calibration else {})


def compute_seconds_at_peak(flops: float, fp8_flops: float, spec: HardwareSpec) -> float:
    """Seconds of ``flops`` at the chip's peak: ``fp8_flops`` of them (at most ``flops``)
    at the fp8 peak (the bf16 one where the table has none), the rest at ``peak_flops``."""
    f8 = min(max(float(fp8_flops), 0.0), flops)
    return (flops - f8) / spec.peak_flops + f8 / (spec.fp8_flops or spec.peak_flops)



def _fp8_source(flops: float, fp8_flops: float, spec: HardwareSpec) -> str:
    if fp8_flops <= 0:
        return ""
    peak = spec.fp8_flops or spec.peak_flops
    why = spec.source_of("fp8_flops") if spec.fp8_flops else \
        "no fp8 peak in the table: the bf16 one"
    return (f"; {min(fp8_flops, flops) / flops:.0%} of the FLOPs in fp8 matmuls at "
            f"{peak / 1e12:.4g} TFLOP/s ({why})")


def _host_source(host: HostTime | None, why: str) -> str:
    """Where the host-transfer term comes from."""
    if host is None:
        return why or "none: the compiled step moves nothing to host memory"
    return (f"the compiled HLO's transfers to and from host memory (S(5)): "
            f"{host.transfers} instructions, {host.asynchronous} asynchronous; "
            f"{host.formula}; host-link bandwidth: {host.source}")


def overlap_of(overlap: float | None, cal: Calibration | None, platform: str
             ) -> tuple[float, str]:
    """The overlap fraction and its source: given, a calibration's measured one, or the
    platform's default."""
    if overlap is None and cal and cal.overlap is not None:
        overlap, source = cal.overlap, f"{cal.source}: measured overlap"
    elif overlap is None:
        overlap, source = _default_overlap(platform)
    else:
        source = "given"
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    return overlap, source


def _local_source(cpu: bool, calibrated: bool) -> str:
    """Why the local work is the sum or the max of compute and memory."""
    if cpu:
        return ("compute + memory: simulated CPU devices share the host's cores, so math and "
                "memory traffic do not overlap")
    if calibrated:
        return ("compute + memory: calibrated, each the time a profile measured in its kind "
                "of kernel, which the device runs one after the other")
    return "max(compute, memory): the roofline (HBM traffic overlaps math)"


def _overlap_source(source: str, exposed_axes: Sequence[str], sync_exposed: bool) -> str:
    """The overlap's source, and which collectives are never hidden (``exposed_axes``:
    those on the critical path that the step has)."""
    return source + (
        f"; collectives over {', '.join(exposed_axes)} only are on the critical path "
        "(tensor parallel: the next matmul waits for them), never hidden"
        if exposed_axes else "") + (
        "; collectives the compiled program runs synchronously (no async start or async "
        "collective fusion in its HLO) block it: never hidden" if sync_exposed else "")
