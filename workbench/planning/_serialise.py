"""A ``PlanReport`` as JSON and back: every field as plain data (the mesh as its description,
each layout as shape, dtype, spec and logical axes, the compiled program's numbers as read),
and the prediction made when the plan was made, so a report read back gives the same
summary, dict form and prediction (reading it predicts nothing again). Used by
``PlanReport.to_json`` / ``from_json`` (this module is below ``report``)."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
from jax.sharding import AbstractMesh

from workbench._flops import FlopCount
from workbench._sharding.layouts import Layout
from workbench._sharding.mesh import MeshInfo
from workbench.models import GPTConfig
from workbench._compiled.hlo import Collective
from workbench.perf._prediction import Prediction
from workbench.planning._lints import Lint
from workbench._sharding.rules import Rules

__all__ = ["FORMAT", "report_fields", "report_to_json"]

#: The format tag of ``report_to_json``'s dicts.
FORMAT = "workbench.plan-report/1"

_PLAIN = ("name", "batch", "seq", "is_estimate", "source", "source_reason",
          "hbm_bytes_estimate", "memory", "memory_estimate", "compile_seconds",
          "compile_cached", "plan_seconds", "pipeline", "compiler_options", "attention",
          "dtype", "placement", "prediction_error")
#: Fields a report written before they existed lacks, and their value then.
_ADDED = {"dtype": "", "placement": "",
          "prediction_error": "none stored (a report written before predictions were "
                              "kept): perf.predict_plan(report, "
                              "wb.hardware.effective_spec(report.mesh)) makes one"}


def report_to_json(report: Any) -> dict[str, Any]:
    """A ``PlanReport`` as JSON-friendly data (``json.dumps`` takes it)."""
    cfg = None if report.cfg is None else report.cfg.to_dict()
    cn = report.compiled_numbers
    return {
        "format": FORMAT, **{k: getattr(report, k) for k in _PLAIN}, "cfg": cfg,
        "mesh": _mesh_to_json(report.mesh), "rules": report.rules.to_dict(),
        "flops": dataclasses.asdict(report.flops),
        "collectives": [_listed(dataclasses.asdict(c)) for c in report.collectives],
        "warnings": [_listed(dataclasses.asdict(w)) for w in report.warnings],
        "layouts": {k: {"shape": list(v.shape), "dtype": v.dtype.name,
                        "spec": [list(a) for a in v.spec],
                        "logical": None if v.logical_axes is None else list(v.logical_axes)}
                    for k, v in report.layouts.items()},
        "logical": {k: list(v) for k, v in report.logical.items()},
        "compiled_numbers": None if cn is None else cn.to_dict(),
        "predicted": None if report.predicted is None else report.predicted.to_dict(),
    }


def report_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    """The ``PlanReport`` fields of ``report_to_json``'s data (after a JSON round trip);
    ``compiled_numbers`` as the values ``CompiledNumbers(values=...)`` takes.

    A plan of real devices reads back on the abstract mesh of the same devices (the
    report has nothing to run on); everything else is as it was.

    Raises:
        ValueError: ``data`` is not a plan report of this format.
    """
    if data.get("format") != FORMAT:
        raise ValueError(f"not a plan report of format {FORMAT!r} (format "
                         f"{data.get('format')!r}); write one with plan.report.to_json()")
    mesh = _mesh_from_json(data["mesh"])
    layouts = {k: Layout(shape=v["shape"], dtype=v["dtype"], spec=tuple(map(tuple, v["spec"])),
                         mesh=mesh, name=k,
                         logical_axes=None if v["logical"] is None else tuple(v["logical"]))
               for k, v in data["layouts"].items()}
    return dict(
        **{k: data[k] if k not in _ADDED else data.get(k, _ADDED[k]) for k in _PLAIN},
        mesh=mesh, layouts=layouts,
        cfg=None if data["cfg"] is None else GPTConfig(**_tupled(data["cfg"])),
        rules=Rules.from_dict(data["rules"]), flops=FlopCount(**data["flops"]),
        collectives=[Collective(**_tupled(c)) for c in data["collectives"]],
        warnings=[Lint(**_tupled(w)) for w in data["warnings"]],
        logical={k: tuple(v) for k, v in data["logical"].items()},
        compiled_numbers=data["compiled_numbers"],
        predicted=None if data.get("predicted") is None
        else Prediction.from_dict(data["predicted"]))


def _listed(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def _tupled(d: Mapping[str, Any]) -> dict[str, Any]:
    """Lists back to the tuples dataclass fields hold (JSON has no tuples)."""
    return {k: tuple(tuple(x) if isinstance(x, list) else x for x in v)
            if isinstance(v, list) else v for k, v in d.items()}


def _mesh_to_json(m: MeshInfo) -> dict[str, Any]:
    arrays = {k: None if getattr(m, k) is None else np.asarray(getattr(m, k)).tolist()
              for k in ("device_ids", "process_index", "coords")}
    return {"axis_names": list(m.axis_names), "axis_sizes": list(m.axis_sizes), **arrays,
            "device_kind": m.device_kind, "platform": m.platform,
            "memory_per_device": m.memory_per_device, "peak_flops": m.peak_flops,
            "peak_source": m.peak_source, "hardware": m.hardware,
            "dcn_axis_sizes": None if m.dcn_axis_sizes is None else list(m.dcn_axis_sizes)}


def _mesh_from_json(d: Mapping[str, Any]) -> MeshInfo:
    names, sizes = tuple(d["axis_names"]), tuple(d["axis_sizes"])
    arr = {k: None if d[k] is None else np.asarray(d[k], dtype=np.int64)
           for k in ("device_ids", "process_index", "coords")}
    return MeshInfo(axis_names=names, axis_sizes=sizes, **arr,
                    device_kind=d["device_kind"], platform=d["platform"],
                    memory_per_device=d["memory_per_device"], peak_flops=d["peak_flops"],
                    peak_source=d["peak_source"], hardware=d["hardware"],
                    dcn_axis_sizes=None if d["dcn_axis_sizes"] is None
                    else tuple(d["dcn_axis_sizes"]),
                    abstract=AbstractMesh(sizes, names))
