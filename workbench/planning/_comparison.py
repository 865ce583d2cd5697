"""Plans side by side (``wb.compare``): ``Comparison``, one row of numbers per plan's
report (memory, fit, FLOPs and bytes per device, the predicted step), as text; notebooks
draw its widget and figure through the display hook (``workbench._display``)."""
from __future__ import annotations

from typing import Any

from workbench._display import Displayable, view
from workbench.planning._report import MEMORY_KEYS, PlanReport, bytes_text, flops_text

__all__ = ["Comparison"]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.4g} ms"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _predicted_columns(report: PlanReport) -> dict[str, Any]:
    pred = report.predicted
    if pred is None:
        return {"step_seconds": None, "mfu": None, "mfu_fp8": None, "bound": None}
    return {"step_seconds": pred.step_seconds, "mfu": pred.mfu, "mfu_fp8": pred.mfu_fp8,
            "bound": pred.bound}


def _row(r: PlanReport) -> dict[str, Any]:
    """One plan's row of ``Comparison.COLUMNS`` (and its memory parts)."""
    return {"name": r.name, "memory_per_device": r.memory["total"], **_predicted_columns(r),
            "source": r.source, "limit": r.memory.get("limit"), "fits": r.fits,
            "flops_per_device": r.flops_per_device,
            "comm_bytes_per_device": r.comm_bytes_per_device,
            "replicated_compute_factor": r.replicated_compute_factor,
            "n_warnings": len(r.warnings), "estimate": r.is_estimate,
            "memory": {k: r.memory.get(k) for k in (*MEMORY_KEYS, "temp")}}


class Comparison(Displayable):
    """Plans side by side (``wb.compare``): ``rows``, ``table()``, ``figure()``."""

    COLUMNS = ("name", "memory_per_device", "limit", "fits", "flops_per_device",
               "comm_bytes_per_device", "replicated_compute_factor", "step_seconds", "mfu",
               "mfu_fp8", "bound", "n_warnings", "estimate", "source")

    def __init__(self, plans: list) -> None:
        self.plans = plans

    @property
    def rows(self) -> list[dict[str, Any]]:
        """One dict per plan with the ``COLUMNS``."""
        return [_row(p.report) for p in self.plans]

    def table(self) -> str:
        """The comparison as aligned text."""
        head = (f"{'plan':<14}{'memory/dev':>12}{'fits':>8}{'FLOPs/dev':>13}{'comm/dev':>12}"
                f"{'compute x':>11}{'step (pred.)':>14}{'MFU':>7}{'lints':>7}  source")
        lines = [head]
        for r in self.rows:
            fits = {True: "yes", False: "NO", None: "?"}[r["fits"]]
            lines.append(f"{r['name']:<14}{bytes_text(r['memory_per_device']):>12}{fits:>8}"
                         f"{flops_text(r['flops_per_device']):>13}"
                         f"{bytes_text(r['comm_bytes_per_device']):>12}"
                         f"{r['replicated_compute_factor']:>11.3g}"
                         f"{_ms(r['step_seconds']):>14}{_pct(r['mfu']):>7}{r['n_warnings']:>7}"
                         f"  {r['source']}" + (f" (MFU {_pct(r['mfu_fp8'])} of the fp8 peak)"
                                               if r["mfu_fp8"] is not None else ""))
        return "\n".join(lines)

    __str__ = table

    def __repr__(self) -> str:
        return self.table()

    def figure(self) -> Any:
        """A plotly figure: memory per device (stacked, limit line), FLOPs and bytes per device."""
        return view(self, "figure")(self)
