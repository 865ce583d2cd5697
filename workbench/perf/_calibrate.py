"""Calibration from profiles: achieved rates per device kind fitted to profiles and stored
with their provenance (``workbench.hardware._calibration``), which
``workbench.hardware.effective_spec`` applies to the predictions of that kind when asked
(``sources`` says "calibrated from profile ...").

From one or more :class:`~workbench.perf._profile.ProfileReport` of a device kind:

- achieved matmul FLOP/s = the hardware entry's peak x predicted / measured compute time;
- achieved HBM bandwidth = the entry's bandwidth x predicted / measured memory time;
- per collective kind and link (``kind@link``: ICI, DCN, NVLink, PCIe, InfiniBand; on CPU
  "memory" inside a process and "tcp" loopback between processes, gloo), a latency per
  message ``alpha`` and a bandwidth ``beta``: ``measured = count x sum over the links it
  crosses of (alpha x messages + bytes / beta)`` (``CollectiveTime.parts``: the ring's
  messages and bytes), non-negative least squares over every merged collective of every
  profile at once (``fit_collectives``). Several layouts tell alpha and beta apart; what
  the profiles do not identify keeps the table's value, and the entry's ``kept`` says so;
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
``calibration_dir``) is ``workbench.hardware._calibration``'s.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from workbench.hardware._calibration import Calibration
from workbench.perf._collective_time import ALPHA_BETA
from workbench.perf._residuals import residuals
from workbench._validate import check_bool

__all__ = ["calibrate", "fit_collectives"]


# -- fitting ----------------------------------------------------------------------------

def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _checked(reports: Any, spec: Any, *, resolve_spec: bool = True,
             where: str = "calibrate") -> tuple[list[Any], Any]:
    """``calibrate``'s arguments checked: the reports as a list, and the spec (default the
    table's entry of their device kind, or the measured CPU).

    Raises:
      ValueError, TypeError: as ``calibrate`` says.
    """
    from workbench.hardware import HardwareSpec, cpu_spec, hardware_spec

    many = isinstance(reports, (list, tuple))
    if many and not reports:
        raise ValueError(f"{where}: reports={reports!r} is empty; it needs at least one "
                         "ProfileReport (trainer.profile())")
    for i, r in enumerate(reports if many else [reports]):
        if not (hasattr(r, "device_kind") and hasattr(r, "prediction")):
            name = f"reports[{i}]" if many else "reports"
            raise TypeError(f"{where}: {name}={_short(r)} is a {type(r).__name__}, not a "
                            "ProfileReport; pass trainer.profile() or wb.profile_step(plan) "
                            "(or a list of them)")
    if spec is not None and not isinstance(spec, HardwareSpec):
        raise TypeError(f"{where}: spec={_short(spec)} is a {type(spec).__name__}, not a "
                        "HardwareSpec; pass wb.hardware.hardware_spec(kind), or leave spec "
                        "out for the reports' own device kind")
    reports = list(reports) if many else [reports]
    kinds = {r.device_kind for r in reports}
    if len(kinds) != 1:
        raise ValueError(f"{where}: the reports are of different device kinds {sorted(kinds)}"
                         "; calibrate each kind from its own profiles")
    for r in reports:
        if "calibration" in r.prediction.get("sources", {}):
            raise ValueError(f"{where}: the prediction of {r.directory} was already "
                             "calibrated; profile with wb.remove_calibration(kind) first, or "
                             "pass the uncalibrated prediction (plan.predict(calibration=False))")
    _check_times(reports, many, where)
    if spec is None and resolve_spec:
        kind = reports[0].device_kind
        spec = hardware_spec(kind) if kind and "cpu" not in kind.lower() else \
            cpu_spec(int(np.prod(list(reports[0].mesh.values()))) if reports[0].mesh
                     else reports[0].measured.devices)
    return reports, spec


# -- the collective model: alpha x messages + bytes / beta per kind and link ---------------

#: below this ratio of singular values (columns scaled to unit length) a parameter is not
#: told apart from the others by the profiles: it keeps the table's value
RCOND = 1e-6


def _rows_of(reports: list[Any]) -> list[tuple[int, dict[str, Any]]]:
    """``(report index, collective row)`` of every merged collective measured whose
    prediction says its parts (messages and bytes per link)."""
    return [(i, row) for i, r in enumerate(reports)
            for row in getattr(r, "collective_rows", ()) if row.get("parts")]


def _check_times(reports: list[Any], many: bool, where: str) -> None:
    """Every measured and predicted time of the reports is a finite number >= 0.

    Raises:
      ValueError: naming the report (``reports[i]``), the term or collective and its value.
    """
    for i, r in enumerate(reports):
        name = f"reports[{i}]" if many else "reports"
        rows = getattr(r, "collective_rows", ())
        checks = [(f"term {t.name!r}", v) for t in getattr(r, "terms", ())
                  for v in (t.measured, t.predicted)]
        checks += [(f"collective {row.get('kind')} over {','.join(row.get('axes', ())) or '-'}",
                    row.get(k)) for row in rows for k in ("measured", "predicted")]
        checks += [(f"collective {row.get('kind')} part {p.get('link')!r} {k}", p.get(k))
                   for row in rows for p in row.get("parts") or ()
                   for k in ("messages", "bytes", "latency", "bandwidth")]
        for what, v in checks:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < 0:
                raise ValueError(f"{where}: {name} ({getattr(r, 'directory', '')}) has {what}"
                                 f" = {v!r}, not a finite time >= 0: pass the report "
                                 "trainer.profile() or wb.profile_step(plan) returned, unedited")


def fit_collectives(reports: Any | Sequence[Any]) -> dict[str, dict[str, Any]]:
    """The latency and bandwidth of each collective kind over each link, fitted to the
    collectives measured in profiles (several layouts at once tell them apart).

    Every collective of a profiled step is timed, per link it crosses, as
    ``alpha x messages + bytes / beta`` (``CollectiveTime.parts``: the ring's messages and
    bytes per instruction, the table's alpha and beta). Over all the reports' measured
    collectives, ``measured = sum over parts of count x (alpha[kind@link] x messages +
    scale[kind@link] x bytes / beta_table)`` is solved by non-negative least squares, one
    (alpha, scale) per kind and link; fitted beta = the table's / scale. A parameter the
    profiles cannot tell apart from the others (a kind whose collectives' messages and bytes
    grow together in every profile: one layout, one size) keeps the table's value (alpha,
    or scale 1), and ``kept`` says so.

    Args:
      reports: ``ProfileReport``s (``trainer.profile()``, ``wb.profile_step(plan)``), of one
        device kind, of layouts whose collectives differ in size and group.

    Returns:
      ``{"all-reduce@tcp": {"model": "alpha-beta", "kind", "link", "latency" (alpha,
      s/message), "bandwidth" (beta, B/s per device), "scale" (the table's bandwidth /
      beta), "fitted" (the parameters the profiles identified), "kept" (why the others are
      the table's), "collectives" (measured rows), "table_latency", "table_bandwidth"}}``.

    Raises:
      TypeError: a report that is no ``ProfileReport`` (named ``reports[i]``).
      ValueError: no report; a report with no collective measured (a one-device layout: its
        step has none); a negative or non-finite time; reports of several device kinds.
    """
    reports, _ = _checked(reports, None, resolve_spec=False, where="fit_collectives")
    many = len(reports) > 1
    for i, r in enumerate(reports):
        if not any(row.get("parts") for row in getattr(r, "collective_rows", ())):
            name = f"reports[{i}]" if many else "reports"
            raise ValueError(f"fit_collectives: {name} ({r.plan_name or r.directory}) has no "
                             "collective measured (a layout whose step runs none, or a "
                             "profile from before collectives carried their parts): profile "
                             "layouts that communicate, e.g. fsdp and dp on several devices")
    return _fit_alpha_beta(_rows_of(reports))


def _alpha_beta_system(rows: list[tuple[int, dict[str, Any]]], names: list[str]
                       ) -> tuple[np.ndarray, np.ndarray]:
    """The least-squares system of :func:`_fit_alpha_beta`: one row per measured
    collective, columns the latency of each ``kind@link`` in ``names`` (seconds per
    message) and then its bandwidth scale; and the table's values of those columns."""
    a = np.zeros((len(rows), 2 * len(names)))
    table = np.zeros(2 * len(names))
    for r, (_, row) in enumerate(rows):
        for p in row["parts"]:
            j = names.index(f"{row['kind']}@{p['link']}")
            a[r, j] += row["count"] * p["messages"]
            a[r, len(names) + j] += row["count"] * (p["bytes"] / p["bandwidth"]
                                                    if p["bandwidth"] > 0 else 0.0)
            table[j] = p["latency"]
            table[len(names) + j] = 1.0
    return a, table


def _fit_alpha_beta(rows: list[tuple[int, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """``fit_collectives``'s least squares over ``(report, row)`` pairs (checked)."""
    keys: dict[str, dict[str, Any]] = {}
    for _, row in rows:
        for p in row["parts"]:
            k = f"{row['kind']}@{p['link']}"
            keys.setdefault(k, {"kind": row["kind"], "link": p["link"],
                                "table_latency": float(p["latency"]),
                                "table_bandwidth": float(p["bandwidth"]), "collectives": 0})
            keys[k]["collectives"] += 1
    names = list(keys)
    a, table = _alpha_beta_system(rows, names)
    y = np.array([float(row["measured"]) for _, row in rows])
    free = _identified(a)
    fixed = [j for j in range(a.shape[1]) if j not in free]
    theta = table.copy()
    if free:
        rest = y - a[:, fixed] @ table[fixed]
        cols = a[:, free]
        norm = np.linalg.norm(cols, axis=0)
        from scipy.optimize import nnls

        sol, _ = nnls(cols / norm, rest)
        theta[free] = sol / norm
    out = {}
    for j, k in enumerate(names):
        e = keys[k]
        s = float(theta[len(names) + j])
        fitted = [w for w, col in (("latency", j), ("bandwidth", len(names) + j)) if col in free]
        kept = [w for w in ("latency", "bandwidth") if w not in fitted]
        out[k] = {"model": ALPHA_BETA, "kind": e["kind"], "link": e["link"],
                  "latency": float(theta[j]), "scale": s,
                  "bandwidth": e["table_bandwidth"] / s if s > 0 else float("inf"),
                  "fitted": fitted,
                  "kept": (f"{' and '.join(kept)}: the table's; the profiles do not tell it "
                           f"apart (the {e['kind']}s over {e['link']} grow in messages and bytes "
                           "together): add a layout whose collectives of this kind differ in "
                           "size or group" if kept else ""),
                  "collectives": e["collectives"], "table_latency": e["table_latency"],
                  "table_bandwidth": e["table_bandwidth"]}
    return out


def _identified(a: np.ndarray) -> list[int]:
    """The columns of ``a`` the rows determine: those left after fixing, one at a time, the
    column that weighs most in the least determined direction (an alpha before a scale
    where both weigh alike), until the scaled columns have full rank."""
    norm = np.linalg.norm(a, axis=0)
    free = [j for j in range(a.shape[1]) if norm[j] > 0]
    half = a.shape[1] // 2
    while free:
        _, sv, vt = np.linalg.svd(a[:, free] / norm[free], full_matrices=False)
        if len(sv) == len(free) and sv[-1] > RCOND * sv[0]:
            break
        v = np.abs(vt[-1]) if len(sv) == len(free) else _null_direction(a[:, free] / norm[free])
        heavy = [i for i in range(len(free)) if v[i] >= 0.5 * v.max()]
        pick = min(heavy, key=lambda i: (free[i] >= half, -v[i]))
        free.pop(pick)
    return free


def _null_direction(m: np.ndarray) -> np.ndarray:
    """|components| of a direction ``m`` does not see (more columns than rows)."""
    _, _, vt = np.linalg.svd(m, full_matrices=True)
    return np.abs(vt[-1])


def calibrate(reports: Any | Sequence[Any], *, spec: Any = None, save: bool = True
              ) -> Calibration:
    """Fit a device kind's achieved rates to profiles and (by default) store them.

    Args:
      reports: one ``ProfileReport`` (``trainer.profile()``) or several of the same device
        kind, of one layout or several: the collectives' latency per message and bandwidth
        per kind and link are fitted to all of them at once (``fit_collectives``), which
        several layouts (collectives of other sizes and groups) tell apart; with one, what
        it cannot tell apart keeps the table's value (``collectives[key]["kept"]``).
      spec: the ``HardwareSpec`` the reports' predictions used (default: the table's
        entry, or for CPUs the measured ``cpu_spec``): its peak, bandwidth and latency are
        what the factors multiply.
      save: store it (``calibration_dir()``) so that predictions use it.

    Its ``residuals`` (each profile's measured step beside the step it predicts for it)
    are stored with it: the error band of the predictions it calibrates.

    Raises:
      ValueError: no report, reports of different device kinds, a report whose prediction
        was itself calibrated (calibrate from uncalibrated predictions), or a negative or
        non-finite time in one (named ``reports[i]``).
      TypeError: a report that is no ``ProfileReport``, or a ``spec`` that is no
        ``HardwareSpec``.
    """
    save = check_bool(save, "save", where="calibrate: ")
    reports, spec = _checked(reports, spec)
    pc = sum(r.term("compute").predicted for r in reports)
    mc = sum(r.term("compute").measured for r in reports)
    pm = sum(r.term("memory").predicted for r in reports)
    mm = sum(r.term("memory").measured for r in reports)
    cf = pc / mc if pc > 0 and mc > 0 else 1.0
    mf = pm / mm if pm > 0 and mm > 0 else 1.0
    rows = _rows_of(reports)
    colls = _fit_alpha_beta(rows) if rows else {}
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
