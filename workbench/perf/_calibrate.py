"""Calibration from profiles: achieved rates per device kind fitted to profiles and stored
with their provenance (``workbench.hardware._calibration``), which
``workbench.hardware.effective_spec`` applies to the predictions of that kind when asked
(``sources`` says "calibrated from profile ...").

From one or more :class:`~workbench.perf._profile.ProfileReport` of a device kind:

- achieved matmul FLOP/s = the hardware entry's peak x predicted / measured compute time;
- achieved HBM bandwidth = the entry's bandwidth x predicted / measured memory time;
- per collective kind (and whether it crosses processes), latency ``L`` and a bandwidth
  factor ``s``: ``measured = n x L + s x (predicted - n x L_table)``, least squares over
  the profiles' merged collectives of that kind (``n``: the latencies each pays per step,
  instructions, or on XLA:CPU instructions x arrays; ``s`` alone where their sizes do not
  tell the two apart); achieved bandwidth = the entry's link bandwidth / ``s``;
- overlap: op time measured running beside other ops of the same device (XLA:CPU's
  thunk executor runs independent ops side by side) / min(local, communication), in
  [0, 1]. On GPUs and TPUs the trace's collective time is what the device's op stream
  spent in the collectives (start and done ops), i.e. the exposed part, and ops run one
  at a time: the overlap measures 0 and the collective factors carry what is hidden.
  XLA:CPU profiles are read as the host's time (``StepProfile.shared``): a collective's
  is only what local work left unused, the exposed part, so their overlap is 0 as well.

The factors are stored relative to the hardware entry (``cpu_spec`` divides one host's
peak among its simulated devices: a calibration from 8 devices applies to 4). Storing,
reading and removing them (``Calibration``, ``load_calibration``, ``remove_calibration``,
``calibration_dir``) is ``workbench.hardware._calibration``'s; the names are here too.
"""
from __future__ import annotations

import dataclasses
import datetime
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from workbench.hardware._calibration import (Calibration, CalibrationWarning, calibration_dir,
                                            check_calibration, load_calibration,
                                            remove_calibration)
from workbench.perf._residuals import residuals

__all__ = ["Calibration", "CalibrationWarning", "calibrate", "calibration_dir",
           "check_calibration", "load_calibration", "remove_calibration"]


# -- fitting ----------------------------------------------------------------------------

def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fit(rows: list[tuple[float, float, float]], latency0: float) -> tuple[float, float]:
    """(latency, scale) with measured ~ count x latency + scale x bandwidth_part, both
    >= 0, from rows of (count, predicted seconds, measured seconds)."""
    n = np.array([r[0] for r in rows], float)
    x = np.array([max(0.0, r[1] - r[0] * latency0) for r in rows], float)
    m = np.array([r[2] for r in rows], float)
    cands = []
    if len(rows) >= 2 and np.linalg.matrix_rank(np.stack([n, x], 1)) == 2:
        (lat, s), *_ = np.linalg.lstsq(np.stack([n, x], 1), m, rcond=None)
        if lat >= 0 and s >= 0:
            cands.append((lat, s))
    if x.sum() > 0:   # bandwidth only, the table's latency kept (scaled like the rest)
        s = float(m.sum() / (x.sum() + n.sum() * latency0)) if latency0 else \
            float(m.sum() / x.sum())
        cands.append((latency0 * s, s))
    if n.sum() > 0:
        cands.append((float(m.sum() / n.sum()), 0.0))
    if not cands:
        return latency0, 1.0
    return min(cands, key=lambda c: float(((n * c[0] + x * c[1] - m) ** 2).sum()))


def _checked(reports: Any, spec: Any) -> tuple[list[Any], Any]:
    """``calibrate``'s arguments checked: the reports as a list, and the spec (default the
    table's entry of their device kind, or the measured CPU).

    Raises:
      ValueError, TypeError: as ``calibrate`` says.
    """
    from workbench.hardware import HardwareSpec, cpu_spec, hardware_spec

    many = isinstance(reports, (list, tuple))
    if many and not reports:
        raise ValueError(f"calibrate: reports={reports!r} is empty; it needs at least one "
                         "ProfileReport (trainer.profile())")
    for i, r in enumerate(reports if many else [reports]):
        if not (hasattr(r, "device_kind") and hasattr(r, "prediction")):
            name = f"reports[{i}]" if many else "reports"
            raise TypeError(f"calibrate: {name}={_short(r)} is a {type(r).__name__}, not a "
                            "ProfileReport; pass trainer.profile() or wb.profile_step(plan) "
                            "(or a list of them)")
    if spec is not None and not isinstance(spec, HardwareSpec):
        raise TypeError(f"calibrate: spec={_short(spec)} is a {type(spec).__name__}, not a "
                        "HardwareSpec; pass wb.hardware.hardware_spec(kind), or leave spec "
                        "out for the reports' own device kind")
    reports = list(reports) if many else [reports]
    kinds = {r.device_kind for r in reports}
    if len(kinds) != 1:
        raise ValueError(f"calibrate: the reports are of different device kinds {sorted(kinds)}"
                         "; calibrate each kind from its own profiles")
    for r in reports:
        if "calibration" in r.prediction.get("sources", {}):
            raise ValueError(f"calibrate: the prediction of {r.directory} was already "
                             "calibrated; profile with wb.remove_calibration(kind) first, or "
                             "pass the uncalibrated prediction (plan.predict(calibration=False))")
    if spec is None:
        kind = reports[0].device_kind
        spec = hardware_spec(kind) if kind and "cpu" not in kind.lower() else \
            cpu_spec(int(np.prod(list(reports[0].mesh.values()))) if reports[0].mesh
                     else reports[0].measured.devices)
    return reports, spec


def calibrate(reports: Any | Sequence[Any], *, spec: Any = None, save: bool = True
              ) -> Calibration:
    """Fit a device kind's achieved rates to profiles and (by default) store them.

    Args:
      reports: one ``ProfileReport`` (``trainer.profile()``) or several of the same device
        kind (several layouts pin the collectives' latency and bandwidth apart).
      spec: the ``HardwareSpec`` the reports' predictions used (default: the table's
        entry, or for CPUs the measured ``cpu_spec``): its peak, bandwidth and latency are
        what the factors multiply.
      save: store it (``calibration_dir()``) so that predictions use it.

    Its ``residuals`` (each profile's measured step beside the step it predicts for it)
    are stored with it: the error band of the predictions it calibrates.

    Raises:
      ValueError: no report, reports of different device kinds, or a report whose
        prediction was itself calibrated (calibrate from uncalibrated predictions).
    """
    reports, spec = _checked(reports, spec)
    pc = sum(r.term("compute").predicted for r in reports)
    mc = sum(r.term("compute").measured for r in reports)
    pm = sum(r.term("memory").predicted for r in reports)
    mm = sum(r.term("memory").measured for r in reports)
    cf = pc / mc if pc > 0 and mc > 0 else 1.0
    mf = pm / mm if pm > 0 and mm > 0 else 1.0
    rows: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for r in reports:
        # one row per merged collective where the report has them (their sizes and array
        # counts differ, which pins latency and bandwidth apart), else one per term
        for t in r.collective_rows or [
                {"kind": t.kind, "axes": t.axes, "latencies": t.latencies or t.count,
                 "predicted": t.predicted, "measured": t.measured} for t in r.terms if t.kind]:
            network = r.processes > 1 and _crosses_processes(r, t["axes"])
            rows[f"{t['kind']}@network" if network else t["kind"]].append(
                (float(t["latencies"]), float(t["predicted"]), float(t["measured"])))
    lat0 = spec.collective_latency or 0.0
    link = spec.nvlink_bandwidth or spec.ici_link_bandwidth or spec.hbm_bandwidth or 0.0
    colls = {}
    for key, rr in rows.items():
        lat, s = _fit(rr, lat0)
        bw = (spec.network_bandwidth if key.endswith("@network") else link) or 0.0
        colls[key] = {"latency": float(lat), "scale": float(s),
                      "bandwidth": float(bw / s) if s > 0 else float("inf"),
                      "instructions": float(sum(x[0] for x in rr))}
    overlaps = []
    for r in reports:
        local = r.term("compute").measured + r.term("memory").measured
        comm = sum(t.measured for t in r.terms if t.kind)
        hidden = r.term("overlap (hidden)").measured
        if min(local, comm) > 0:
            overlaps.append(min(1.0, max(0.0, hidden / min(local, comm))))
    import jax

    prov = [{"directory": r.directory, "plan_name": r.plan_name, "mesh": r.mesh,
             "processes": r.processes, "steps": r.measured.steps,
             "step_seconds": r.term("step").measured,
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
             "jax": jax.__version__} for r in reports]
    cal = Calibration(device_kind=spec.name, compute_factor=cf, memory_factor=mf,
                      matmul_flops=spec.peak_flops * cf,
                      hbm_bandwidth=(spec.hbm_bandwidth or 0.0) * mf, collectives=colls,
                      overlap=float(np.mean(overlaps)) if overlaps else None, provenance=prov)
    cal = dataclasses.replace(cal, residuals=residuals(reports, cal, spec))
    if save:
        cal.save()
    return cal


def _crosses_processes(report: Any, axes: Sequence[str]) -> bool:
    """Whether collectives over ``axes`` of the report's mesh span processes: mesh axes in
    order, processes holding contiguous blocks of the devices (``jax.make_mesh``)."""
    sizes = list(report.mesh.values())
    names = list(report.mesh)
    per_process = int(np.prod(sizes)) // max(1, report.processes)
    inner = 1
    for name, size in zip(reversed(names), reversed(sizes)):   # minor axes first
        if name in axes and inner * size > per_process:
            return True
        inner *= size
    return False
