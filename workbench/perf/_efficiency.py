"""A GPU step's local work timed with measured efficiencies, and those efficiencies fitted
to profiles: matmul FLOP/s by shape class, the fused attention kernel's FLOP/s, the HBM
bytes per second of memory-bound fusions (``workbench.hardware._efficiency``).

The step's numbers (:class:`StepNumbers`) are the plan's own: the FLOPs it counts outside
the fused attention kernel, the kernel's FLOPs (``attention_cost.kernel_flops``) and its
HBM byte estimate. A profile splits the measured time the same way
(:func:`measured_split`: GEMM kernels, attention kernels, memory-bound fusions). Fitting
divides the one by the other; predicting multiplies back, the three terms added (a GPU's
stream runs them one after the other).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

from workbench.hardware._efficiency import Efficiency, shape_class

__all__ = ["StepNumbers", "efficient_local", "fit_efficiency", "measured_split"]

#: kernels of a fused attention (cuDNN's flash fprop/bprop and its helper kernels)
ATTENTION_KERNEL = re.compile(r"cudnn|fmha|sdpa|flash", re.I)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepNumbers:
    """What the plan counts for one step on one device.

    Attributes:
      matmul_flops: FLOPs outside the fused attention kernel.
      attention_flops: the fused attention kernel's FLOPs (0 for XLA attention).
      hbm_bytes: HBM bytes read and written (the plan's count or estimate).
      d_model: the model width (its matmul shape class).
      name: the case ("1b 8x2048 remat=minimal").
    """

    matmul_flops: float
    attention_flops: float
    hbm_bytes: float
    d_model: int
    name: str = ""

    @property
    def shape_class(self) -> str:
        return shape_class(self.d_model)


def measured_split(profile: Any) -> dict[str, float]:
    """A ``StepProfile``'s time per step: ``matmul`` (compute ops that are no attention
    kernel), ``attention`` (cuDNN / flash kernels), ``memory`` (memory-bound fusions),
    ``rest`` (collectives, other, idle, host, less the concurrent) and ``step``."""
    attention = sum(o.seconds for o in profile.ops
                    if o.category == "compute" and ATTENTION_KERNEL.search(o.name))
    c = profile.categories
    rest = c["collectives"] + c["other"] - c["concurrent"] + c["idle"] + c["host"]
    return {"matmul": c["compute"] - attention, "attention": attention,
            "memory": c["memory"], "rest": rest, "step": profile.step_seconds}


def fit_efficiency(cases: Sequence[tuple[StepNumbers, dict[str, float]]], *,
                   device_kind: str, peak_flops: float, run: str, date: str,
                   jax: str) -> Efficiency:
    """The efficiencies of ``cases`` (each the plan's :class:`StepNumbers` and the
    profile's :func:`measured_split`): per shape class, the matmul FLOPs over the GEMM
    kernels' time / ``peak_flops`` and the attention FLOPs over the attention kernels'
    time; over all cases, HBM bytes over memory-bound time.

    Raises:
      ValueError: no case, or a case whose measured matmul or memory time is not > 0.
    """
    if not cases:
        raise ValueError("fit_efficiency: no case to fit; pass (StepNumbers, "
                         "measured_split(profile)) pairs")
    sums: dict[str, list[float]] = {}
    att: dict[str, list[float]] = {}
    nbytes = seconds = 0.0
    for numbers, split in cases:
        for key in ("matmul", "memory"):
            if not split.get(key, 0) > 0:
                raise ValueError(f"fit_efficiency: case {numbers.name!r} measured "
                                 f"{key}={split.get(key)!r} s; profile a step on the GPU")
        s = sums.setdefault(numbers.shape_class, [0.0, 0.0])
        s[0] += numbers.matmul_flops
        s[1] += split["matmul"]
        if numbers.attention_flops > 0 and split.get("attention", 0) > 0:
            a = att.setdefault(numbers.shape_class, [0.0, 0.0])
            a[0] += numbers.attention_flops
            a[1] += split["attention"]
        nbytes += numbers.hbm_bytes
        seconds += split["memory"]
    return Efficiency(
        device_kind=device_kind,
        matmul_fraction={k: min(1.0, f / t / peak_flops) for k, (f, t) in sums.items()},
        attention_flops={k: f / t for k, (f, t) in att.items()},
        hbm_bandwidth=nbytes / seconds, run=run, date=date, jax=jax,
        fitted_on=tuple(n.name or f"d_model={n.d_model}" for n, _ in cases))


def efficient_local(numbers: StepNumbers, eff: Efficiency, peak_flops: float
                    ) -> tuple[float, dict[str, float], str]:
    """``(seconds, terms, source)``: the step's local work with ``eff``: matmuls at the
    fraction of ``peak_flops`` measured for their shape class (or the nearest class
    measured), the attention kernel at its measured FLOP/s, the HBM bytes at the measured
    rate; added."""
    cls = numbers.shape_class
    frac, frac_cls = eff.matmul(cls)
    terms = {"matmul": numbers.matmul_flops / (peak_flops * frac),
             "memory": numbers.hbm_bytes / eff.hbm_bandwidth, "attention": 0.0}
    why = [f"matmuls at {frac:.1%} of peak ({frac_cls} class"
           + ("" if frac_cls == cls else f", nearest measured to {cls}") + ")"]
    if numbers.attention_flops > 0:
        if eff.attention_flops:
            rate, att_cls = eff.attention(cls)
            why.append(f"fused attention at {rate / 1e12:.0f} TFLOP/s ({att_cls} class)")
        else:
            rate = peak_flops * frac
            why.append("fused attention at the matmul rate (none measured)")
        terms["attention"] = numbers.attention_flops / rate
    why.append(f"HBM estimate at {eff.hbm_bandwidth / 1e12:.3g} TB/s")
    seconds = terms["matmul"] + terms["attention"] + terms["memory"]
    source = (f"{eff.origin}: " + ", ".join(why) + f"; added (a GPU stream runs them one "
              f"after the other): matmul {terms['matmul'] * 1e3:.4g} ms + attention "
              f"{terms['attention'] * 1e3:.4g} ms + memory {terms['memory'] * 1e3:.4g} ms")
    return seconds, terms, source
