"""A calibration's residuals: each profile it was fitted to, its measured step beside the
step the calibration predicts for it. The calibrated step is the profile's own
(uncalibrated) prediction with the calibration applied, as ``predict`` applies it: compute
and memory at the achieved rates and added, the collectives at their fitted latency and
bandwidth, the measured overlap. They are stored with the calibration
(``Calibration.residuals``) and are the basis of a calibrated prediction's error band
(``workbench.perf._band``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from workbench.perf._collective_time import CollectiveTime, calibrated_time
from workbench.perf._predict import local_seconds, overlap_of

__all__ = ["calibrated_step", "residuals"]

_FIELDS = {f.name for f in dataclasses.fields(CollectiveTime)}


def _collective(d: dict[str, Any]) -> CollectiveTime:
    fields = {k: v for k, v in d.items() if k in _FIELDS} | {"axes": tuple(d["axes"])}
    if "parts" in fields:   # the links' latency + bandwidth terms, a tuple as predicted
        fields["parts"] = tuple(dict(p) for p in fields["parts"] or ())
    return CollectiveTime(**fields)


def calibrated_step(prediction: dict[str, Any], cal: Any, spec: Any) -> float:
    """The step ``prediction`` (an uncalibrated ``Prediction.to_dict()`` made with
    ``spec``, the hardware entry ``cal`` is relative to) would have predicted with ``cal``:
    ``plan.predict(calibration=cal).step_seconds`` from the prediction's terms alone."""
    b = prediction["breakdown"]
    compiler = str(prediction["sources"].get("local", "")).startswith("the TPU compiler")
    _, t_local, _ = local_seconds(
        b["compute"] / cal.compute_factor, b["memory"] / cal.memory_factor, additive=True,
        compute_seconds=b["local"] if compiler else None, compute_source="")
    lat0 = spec.collective_latency or 0.0
    times = [calibrated_time(_collective(c), cal, lat0) for c in b["collectives"]]
    # an old prediction without ``exposed``: the ones it left unhidden while others were
    exposed = [c.get("exposed", c["overlap"] == 0.0 and any(
        o["overlap"] > 0 for o in b["collectives"])) for c in b["collectives"]]
    overlap, _ = overlap_of(None, cal, spec.platform)
    t_comm = sum(t.seconds for t in times)
    t_free = t_comm - sum(t.seconds for t, e in zip(times, exposed) if e)
    return t_local + t_comm - overlap * min(t_local, t_free) + b.get("host_transfers", 0.0)


def residuals(reports: Sequence[Any], cal: Any, spec: Any) -> list[dict[str, Any]]:
    """Per profile (``ProfileReport``): its measured step (``own_step_seconds``: the
    step less other processes' time on the host's cores) and the step ``cal`` predicts
    for it, in seconds; profiles without a measured or predicted step are left out."""
    out = []
    for r in reports:
        measured = float(r.own_step_seconds)
        predicted = float(calibrated_step(r.prediction, cal, spec))
        if measured > 0 and predicted > 0:
            out.append({"directory": r.directory, "plan_name": r.plan_name,
                        "mesh": dict(r.mesh), "measured": measured, "predicted": predicted})
    return out
