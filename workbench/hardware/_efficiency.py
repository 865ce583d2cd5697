"""Efficiencies measured on lent GPUs, per catalogue entry: the fraction of the peak that
matmul kernels reach by shape class, the fused-attention kernel's FLOP/s and the HBM bytes
per second of the memory-bound fusions, each record with its run and date.

A plan of a step on such a GPU, before any run on the machine at hand (no stored
calibration), times its local work with them (``workbench.perf._efficiency``) instead of
the datasheet's peaks; an entry with no record says so (``efficiency_origin``: "table").
The H200 record is fitted to the stored traces of ``benchmarks/gpu_runs`` (how:
``workbench.perf._efficiency.fit_efficiency``); the H100 has no measured run yet.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

__all__ = ["CLASSES", "EFFICIENCIES", "Efficiency", "check_efficiency", "efficiency_origin",
           "measured_efficiency", "shape_class"]

#: Matmul shape classes by the model width (the GEMMs' inner and outer sizes follow it):
#: name -> (lowest d_model, first d_model above the class).
CLASSES: dict[str, tuple[int, float]] = {"narrow": (0, 1024), "medium": (1024, 4096),
                                         "wide": (4096, math.inf)}


def shape_class(d_model: int) -> str:
    """The matmul shape class of a model width (``CLASSES``)."""
    for name, (low, high) in CLASSES.items():
        if low <= d_model < high:
            return name
    raise ValueError(f"d_model={d_model!r} is not a positive width")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Efficiency:
    """What one GPU kind achieved in measured train steps.

    Attributes:
      device_kind: the catalogue entry's name ("H200").
      matmul_fraction: shape class -> achieved matmul FLOP/s / the entry's peak (the
        plan's FLOPs outside fused attention over the time of the trace's GEMM kernels).
      attention_flops: shape class -> FLOP/s of the fused attention kernel (cuDNN flash:
        ``attention_cost.kernel_flops`` over its kernels' time).
      hbm_bandwidth: the plan's HBM byte estimate (``analytic.hbm_bytes``) per second of
        memory-bound fusions: above the datasheet's where the estimate counts more than the
        fusions move.
      run: the run folder the traces come from.
      date: when it ran (YYYY-MM-DD).
      jax: the JAX version it ran on.
      fitted_on: the cases fitted ("1b 8x2048 remat=minimal").
      residuals: measured steps of cases it was checked on, beside what it predicted:
        ``{"name", "ratio"}`` (measured / predicted step), the error band of the
        predictions it makes (``workbench.perf._band``); () where none was checked.
    """

    device_kind: str
    matmul_fraction: Mapping[str, float]
    attention_flops: Mapping[str, float]
    hbm_bandwidth: float
    run: str
    date: str
    jax: str
    fitted_on: tuple[str, ...]
    residuals: tuple[Mapping[str, Any], ...] = ()

    @property
    def origin(self) -> str:
        """``"measured on <run> (<date>, JAX <version>; fitted on ...)"``."""
        return (f"measured on {self.run} ({self.date}, JAX {self.jax}; fitted on "
                f"{', '.join(self.fitted_on)})")

    def matmul(self, cls: str) -> tuple[float, str]:
        """The matmul fraction of a shape class, and which class it is: the nearest one
        measured where this class was not."""
        return _nearest(self.matmul_fraction, cls)

    def attention(self, cls: str) -> tuple[float, str]:
        """The fused attention kernel's FLOP/s for a shape class (nearest measured)."""
        return _nearest(self.attention_flops, cls)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["matmul_fraction"], d["attention_flops"] = dict(self.matmul_fraction), \
            dict(self.attention_flops)
        d["fitted_on"] = list(self.fitted_on)
        d["residuals"] = [dict(r) for r in self.residuals]
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Efficiency:
        """A record read back (a run's ``efficiency-*.json``), checked
        (:func:`check_efficiency`)."""
        return cls(**check_efficiency(d))


def _nearest(values: Mapping[str, float], cls: str) -> tuple[float, str]:
    order = list(CLASSES)
    if cls not in order:
        raise ValueError(f"shape class {cls!r} is not one of {order}")
    if not values:
        raise ValueError("the record has no measured value for any shape class")
    best = min(values, key=lambda k: (abs(order.index(k) - order.index(cls)), order.index(k)))
    return values[best], best


def _positive(v: Any, name: str, high: float = math.inf) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or not 0 < v <= high:
        bound = f"in (0, {high:g}]" if math.isfinite(high) else "> 0"
        raise ValueError(f"efficiency record: {name} is {v!r}, not a finite number {bound}; "
                         "fit it again from a profile (workbench.perf._efficiency."
                         "fit_efficiency)")
    return float(v)


def _by_class(v: Any, name: str, high: float) -> dict[str, float]:
    if not isinstance(v, Mapping):
        raise ValueError(f"efficiency record: {name} is {v!r:.60}, not an object of shape "
                         f"class ({', '.join(CLASSES)}) -> number")
    bad = [k for k in v if k not in CLASSES]
    if bad:
        raise ValueError(f"efficiency record: {name} has shape class {bad[0]!r}; the classes "
                         f"are {list(CLASSES)}")
    return {k: _positive(x, f"{name}[{k!r}]", high) for k, x in v.items()}


def check_efficiency(d: Any) -> dict[str, Any]:
    """The fields of an efficiency record, checked: every field present and no other,
    fractions in (0, 1], rates finite and > 0, at least one matmul class, a date
    YYYY-MM-DD, strings where strings go.

    Raises:
      ValueError: naming the first bad field and its value.
    """
    if not isinstance(d, Mapping):
        raise ValueError(f"efficiency record is a {type(d).__name__}, not an object")
    names = [f.name for f in dataclasses.fields(Efficiency)]
    missing = [n for n in names if n not in d and n != "residuals"]
    extra = [k for k in d if k not in names]
    if missing or extra:
        raise ValueError(f"efficiency record: fields {missing} missing, {extra} unknown; "
                         f"it has exactly {names}")
    out: dict[str, Any] = {}
    for key in ("device_kind", "run", "jax"):
        if not isinstance(d[key], str) or not d[key].strip():
            raise ValueError(f"efficiency record: {key} is {d[key]!r}, not a non-empty string")
        out[key] = d[key]
    if not isinstance(d["date"], str) or not re.fullmatch(r"\d{4}-\d{2}-\d{2}", d["date"]):
        raise ValueError(f"efficiency record: date is {d['date']!r}, not YYYY-MM-DD")
    out["date"] = d["date"]
    out["matmul_fraction"] = _by_class(d["matmul_fraction"], "matmul_fraction", 1.0)
    if not out["matmul_fraction"]:
        raise ValueError("efficiency record: matmul_fraction is empty; it needs the shape "
                         "class of at least one measured step")
    out["attention_flops"] = _by_class(d["attention_flops"], "attention_flops", math.inf)
    out["hbm_bandwidth"] = _positive(d["hbm_bandwidth"], "hbm_bandwidth")
    fitted = d["fitted_on"]
    if not isinstance(fitted, (list, tuple)) or not fitted or \
            not all(isinstance(x, str) and x for x in fitted):
        raise ValueError(f"efficiency record: fitted_on is {fitted!r:.60}, not a non-empty "
                         "list of the cases' names")
    out["fitted_on"] = tuple(fitted)
    res = d.get("residuals", ())
    if not isinstance(res, (list, tuple)) or not all(
            isinstance(r, Mapping) and isinstance(r.get("name"), str) for r in res):
        raise ValueError(f"efficiency record: residuals is {res!r:.60}, not a list of "
                         "{'name', 'ratio'} objects")
    out["residuals"] = tuple({"name": r["name"], "ratio": _positive(
        r.get("ratio"), f"residuals[{i}].ratio")} for i, r in enumerate(res))
    return out


_RUN = "benchmarks/gpu_runs/2026-11-28-h200-e-xent"
#: The measured records, by catalogue entry name. H200: fitted to the two traces of
#: ``_RUN`` (profiles.tgz: the 1b step with remat="minimal" and the small step unscanned,
#: cuDNN attention, bfloat16, loss_chunks=1), with the plans of the workbench at hand
#: (tests/test_gpu_predictions.py fits them again from ``efficiency-inputs.json``).
EFFICIENCIES: dict[str, Efficiency] = {
    "H200": Efficiency(
        device_kind="H200", matmul_fraction={"medium": 0.7485, "narrow": 0.7525},
        attention_flops={"medium": 2.912e14, "narrow": 2.355e14}, hbm_bandwidth=6.396e12,
        run=_RUN, date="2026-11-28", jax="0.11.2",
        fitted_on=("1b 8x2048 remat=minimal", "small 32x1024 scan_layers=False"),
        # measured / predicted step: the Trainer's default steps of the run (configurations
        # neither trace had) with this record, and each trace with the other's fit alone
        residuals=({"name": "1b 8x2048 remat=none (Trainer default)", "ratio": 1.0898},
                   {"name": "small 32x1024 (Trainer default)", "ratio": 0.9419},
                   {"name": "1b 8x2048 remat=minimal, fitted on small alone", "ratio": 1.0045},
                   {"name": "small 32x1024 unscanned, fitted on 1b alone", "ratio": 0.9879})),
}


def measured_efficiency(name: str) -> Efficiency | None:
    """The measured record of a catalogue entry ("H200"), or None."""
    return EFFICIENCIES.get(name)


def efficiency_origin(name: str) -> str:
    """Where the local work of a step on this entry is timed from: ``"measured on ..."``,
    or ``"table: ..."`` where no lent run measured it."""
    eff = measured_efficiency(name)
    if eff is not None:
        return eff.origin
    return (f"table: no measured run for {name} (the datasheet's peak FLOP/s and HBM "
            "bandwidth, a roofline: lower than a measured step)")
