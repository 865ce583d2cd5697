"""Text, dict and notebook display of plans and of plan comparisons (no display imports here)."""
from __future__ import annotations

from typing import Any

from workbench._display import Displayable
from workbench.layouts import format_bytes

MEMORY_KEYS = ("params", "optimizer", "gradients", "activations", "batch")


def _flops(x: float | None) -> str:
    if x is None:
        return "-"
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} FLOP"


def _bytes(x: float | None) -> str:
    return "-" if x is None else format_bytes(x)


class PlanReport(Displayable):
    """Mixin: text report, ``to_dict`` and ``_repr_mimebundle_`` of a ``Plan``."""

    _view = "plan_view:plan_widget"

    def memory_rows(self) -> list[dict[str, Any]]:
        """One row per memory component: compiled (or estimate) and estimate bytes."""
        mem, est = self.memory, self.memory_estimate
        keys = [k for k in (*MEMORY_KEYS, "temp", "total", "limit") if k in mem or k in est]
        return [{"key": k, "bytes": mem.get(k), "estimate": est.get(k)} for k in keys]

    def summary(self) -> str:
        """A few lines: where, how much memory, FLOPs, communication, lints."""
        label = "ESTIMATE (analytic, nothing compiled)" if self.is_estimate else \
            f"compiled in {self.compile_seconds:.1f} s"
        mem = self.memory
        fits = {True: "fits", False: "DOES NOT FIT", None: "limit unknown"}[self.fits]
        lines = [
            (f"Plan {self.name!r}: batch {self.batch} x seq {self.seq} on {self.mesh.describe()}"
            f" — {label}"),
            f"  rules: {self.rules!r}",
            (f"  memory/device: total {_bytes(mem['total'])} of {_bytes(mem.get('limit'))} "
            f"({fits}): params {_bytes(mem['params'])}, optimizer {_bytes(mem['optimizer'])}, "
            f"temp {_bytes(mem['temp'])} (gradients {_bytes(mem.get('gradients'))})"),
            (f"  model FLOPs/step {_flops(self.model_flops)} (6N: {_flops(self.flops.six_n)}); "
            f"per device {_flops(self.flops_per_device)}"
            f"{'' if self.compiled_flops_per_device is not None else ' (estimate)'}; "
            f"replicated compute factor {self.replicated_compute_factor:.3g}"),
            (f"  communication/device/step {_bytes(self.comm_bytes_per_device)} in "
            f"{sum(c.count for c in self.collectives)} collective(s)"
            f"{' (estimate)' if self.is_estimate else ''}"),
        ]
        if self.warnings:
            counts = {}
            for w in self.warnings:
                counts[w.severity] = counts.get(w.severity, 0) + 1
            lines.append("  lints: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
        return "\n".join(lines)

    def __str__(self) -> str:
        lines = [self.summary(), "", "memory per device (bytes)  compiled/estimate"]
        for row in self.memory_rows():
            lines.append(f"  {row['key']:<12} {_bytes(row['bytes']):>12} {_bytes(row['estimate']):>12}")
        lines += ["", f"FLOPs: {self.flops}"]
        if self.collectives:
            lines += ["", "collectives (per device):"]
            for c in self.collectives[:12]:
                lines.append(f"  {c.kind:<18} over {','.join(c.axes) or '-':<12} x{c.count:<4} "
                             f"{_bytes(c.bytes):>10} each, sends {_bytes(c.total_wire_bytes)}  "
                             f"{' '.join(c.shapes[:2])}")
            if len(self.collectives) > 12:
                lines.append(f"  ... {len(self.collectives) - 12} more")
        for w in self.warnings:
            lines += ["", str(w)]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Plan {self.name!r}: {self.summary().splitlines()[2].strip()}>"

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly summary (for run.json and the compare table)."""
        return {
            "name": self.name, "is_estimate": self.is_estimate, "batch": self.batch,
            "seq": self.seq, "mesh": self.mesh.shape, "rules": self.rules.to_dict(),
            "memory": dict(self.memory), "memory_estimate": dict(self.memory_estimate),
            "model_flops": self.model_flops, "six_n": self.flops.six_n,
            "flops_formula": self.flops.formula,
            "compiled_flops_per_device": self.compiled_flops_per_device,
            "flops_per_device": self.flops_per_device,
            "replicated_compute_factor": self.replicated_compute_factor,
            "comm_bytes_per_device": self.comm_bytes_per_device, "fits": self.fits,
            "collectives": [c.to_dict() for c in self.collectives],
            "warnings": [w.to_dict() for w in self.warnings],
            "compile_seconds": self.compile_seconds,
        }


class Comparison(Displayable):
    """Plans side by side (``wb.compare``): ``rows``, ``table()``, ``figure()``."""

    _view = "plan_view:compare_widget"

    COLUMNS = ("name", "memory_per_device", "limit", "fits", "flops_per_device",
               "comm_bytes_per_device", "replicated_compute_factor", "n_warnings", "estimate")

    def __init__(self, plans: list) -> None:
        self.plans = plans

    @property
    def rows(self) -> list[dict[str, Any]]:
        """One dict per plan with the ``COLUMNS``."""
        return [{"name": p.name, "memory_per_device": p.memory["total"],
                 "limit": p.memory.get("limit"), "fits": p.fits,
                 "flops_per_device": p.flops_per_device,
                 "comm_bytes_per_device": p.comm_bytes_per_device,
                 "replicated_compute_factor": p.replicated_compute_factor,
                 "n_warnings": len(p.warnings), "estimate": p.is_estimate,
                 "memory": {k: p.memory.get(k) for k in (*MEMORY_KEYS, "temp")}}
                for p in self.plans]

    def table(self) -> str:
        """The comparison as aligned text."""
        head = (f"{'plan':<14}{'memory/dev':>12}{'fits':>8}{'FLOPs/dev':>13}{'comm/dev':>12}"
                f"{'compute x':>11}{'lints':>7}")
        lines = [head]
        for r in self.rows:
            fits = {True: "yes", False: "NO", None: "?"}[r["fits"]]
            lines.append(f"{r['name']:<14}{_bytes(r['memory_per_device']):>12}{fits:>8}"
                         f"{_flops(r['flops_per_device']):>13}"
                         f"{_bytes(r['comm_bytes_per_device']):>12}"
                         f"{r['replicated_compute_factor']:>11.3g}{r['n_warnings']:>7}"
                         + ("  (estimate)" if r["estimate"] else ""))
        return "\n".join(lines)

    __str__ = table

    def __repr__(self) -> str:
        return self.table()

    def figure(self) -> Any:
        """A plotly figure: memory per device (stacked, limit line), FLOPs and bytes per device."""
        from workbench.widgets.plan_view import compare_figure

        return compare_figure(self)


