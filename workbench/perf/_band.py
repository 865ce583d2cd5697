"""How sure a prediction is: its error band, from the residuals of the calibration it
used, or, for an uncalibrated TPU plan timed by the TPU compiler's cycles, from the
reference rows of its generation (``reference_rows.json``, written by
``benchmarks/bench_reference.py``); where there is neither, no band, and why.

A band is a pair of factors on the step time: the measured step was seen between
``low`` and ``high`` times the predicted one (each a ratio measured / predicted, over the
rows it comes from, widened to hold 1: the prediction itself). Tokens/s and MFU divide
by them: ``rate / high`` to ``rate / low``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, Sequence

__all__ = ["Band", "REFERENCE_ROWS", "calibration_band", "prediction_band", "reference_band",
           "reference_rows"]

#: The reference rows (MaxText's published TPU runs predicted by ``bench_reference``):
#: per row its generation, predicted and published tokens/s per chip, and source.
REFERENCE_ROWS = Path(__file__).with_name("reference_rows.json")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Band:
    """The range a measured step has been seen in, as factors of the predicted step.

    Attributes:
      low, high: the lowest and highest measured / predicted step-time ratio of the rows
        it comes from (widened to hold 1); None when there is no band.
      basis: ``"calibration"`` (the calibration's residuals), ``"reference rows"`` (the
        published runs of the chip's generation), ``"measured efficiencies"`` (a GPU's,
        from the catalogue: the steps they were checked on) or ``"none"``.
      source: where it comes from, or why there is none, in words.
      rows: the rows it comes from: ``{"name", "ratio"}`` (measured / predicted step).
    """

    low: float | None
    high: float | None
    basis: str
    source: str
    rows: tuple[dict[str, Any], ...] = ()

    @property
    def known(self) -> bool:
        """Whether there is a band (a basis for one)."""
        return self.low is not None and self.high is not None

    def seconds(self, step: float) -> tuple[float, float] | None:
        """The step-time band ``(low, high)`` of a predicted ``step``; None without one."""
        return (step * self.low, step * self.high) if self.known else None

    def rate(self, value: float | None) -> tuple[float, float] | None:
        """The band of a rate (tokens/s, MFU) predicted as ``value``: ``value / high`` to
        ``value / low``; None without a band or a value."""
        if not self.known or value is None:
            return None
        return value / self.high, value / self.low

    def describe(self, step: float) -> str:
        """``"band 1.18-1.31 s per step, from 3 calibration layouts ..."`` or ``"no band:
        why"``."""
        if not self.known:
            return f"no band: {self.source}"
        lo, hi = self.seconds(step)
        return f"band {_seconds(lo)}-{_seconds(hi)} per step, {self.summary()}"

    def summary(self) -> str:
        """Where the band comes from, briefly: ``"from 3 calibration layouts,
        measured/predicted 0.95-1.08x"``."""
        if not self.known:
            return "no band"
        n = len(self.rows)
        what = {"calibration": "calibration layout",
                "measured efficiencies": "checked step"}.get(self.basis, "reference row")
        ratios = [r["ratio"] for r in self.rows]
        seen = (f"{min(ratios):.2f}-{max(ratios):.2f}x" if n > 1 else f"{ratios[0]:.2f}x") \
            if ratios else "-"
        return f"from {n} {what}{'s' if n != 1 else ''}, measured/predicted {seen}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (run.json's prediction, the plan widget, the lab panel)."""
        return {"low": self.low, "high": self.high, "basis": self.basis,
                "source": self.source, "summary": self.summary(),
                "rows": [dict(r) for r in self.rows]}

    def __str__(self) -> str:
        if not self.known:
            return f"no band: {self.source}"
        return f"{self.low:.2f}-{self.high:.2f}x the predicted step, {self.summary()}"


def _seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"


def band_of(ratios: Sequence[tuple[str, float]], *, basis: str, source: str) -> Band:
    """The band of named measured / predicted ratios: their min and max, widened to
    hold 1 (the prediction itself)."""
    values = [r for _, r in ratios]
    return Band(low=min(1.0, *values), high=max(1.0, *values), basis=basis, source=source,
                rows=tuple({"name": n, "ratio": r} for n, r in ratios))


def calibration_band(cal: Any) -> Band:
    """The band of a calibrated prediction: the calibration's residuals, the measured step
    of each profile it was fitted to over the step it predicts for it
    (``Calibration.residuals``); none when the file predates them."""
    if not cal.residuals:
        return Band(low=None, high=None, basis="none", source=(
            f"calibrated for {cal.device_kind}, but the calibration has no residuals (stored "
            "before they were kept): calibrate again (wb.calibrate(trainer.profile())) for "
            "a band"))
    ratios = [(f"{r.get('plan_name') or 'step'} ({_mesh(r.get('mesh'))})",
               r["measured"] / r["predicted"]) for r in cal.residuals]
    return band_of(ratios, basis="calibration", source=(
        f"the calibration's residuals: measured / calibrated predicted step of the "
        f"{len(ratios)} profile(s) it was fitted to ({cal.source})"
        + ("; one layout: others may be further off" if len(ratios) == 1 else "")))


def _mesh(mesh: Any) -> str:
    if isinstance(mesh, dict):
        return " x ".join(f"{k}={v}" for k, v in mesh.items()) or "-"
    return str(mesh)


@functools.lru_cache(maxsize=1)
def _stored_rows() -> tuple[dict[str, Any], ...]:
    return tuple(json.loads(REFERENCE_ROWS.read_text())["rows"])


def reference_rows(hardware: str | None = None) -> list[dict[str, Any]]:
    """The stored reference rows, all or those of one generation (``"TPU v5p"``): each
    ``{"name", "hardware", "predicted_tokens_per_s_per_chip",
    "published_tokens_per_s_per_chip", "ratio", "source", "measured"}`` with ``ratio`` the
    measured / predicted step (predicted / published tokens/s)."""
    return [dict(r) for r in _stored_rows() if hardware is None or r["hardware"] == hardware]


def reference_band(hardware: str, *, compiler_timed: bool) -> Band:
    """The band of an uncalibrated prediction for ``hardware`` (its table name): the
    reference rows of that generation, when the prediction was timed as they were (the
    TPU compiler's cycle estimates of a TPU-compiled plan); else none, and why."""
    rows = reference_rows(hardware)
    if not rows:
        return Band(low=None, high=None, basis="none", source=(
            f"uncalibrated, and no reference rows for {hardware} (BENCHMARKS.md's "
            "bench_reference has none of this generation)"))
    if not compiler_timed:
        return Band(low=None, high=None, basis="none", source=(
            f"uncalibrated; the {hardware} reference rows are TPU-compiled plans timed by "
            "the compiler's cycle estimates, and this prediction is not (compile it for "
            "the slice: wb.plan(..., mesh=wb.abstract_mesh(...)))"))
    return band_of([(r["name"], r["ratio"]) for r in rows], basis="reference rows", source=(
        f"uncalibrated {hardware}: measured / predicted step of its reference rows "
        f"(published runs predicted by benchmarks/bench_reference.py, {REFERENCE_ROWS.name}): "
        + "; ".join(f"{r['name']} {r['ratio']:.2f}x ({r['source']})" for r in rows)))


def prediction_band(spec: Any, *, compiler_timed: bool) -> Band:
    """The band of a prediction made with ``spec`` (an ``EffectiveSpec``): the
    calibration's residuals when calibrated; the residuals of the measured efficiencies
    of a GPU the catalogue has them for; the reference rows of the generation for an
    uncalibrated TPU plan timed by the compiler's cycles; else none."""
    if spec.calibration is not None:
        return calibration_band(spec.calibration)
    eff = getattr(spec, "efficiency", None)
    if eff is not None and eff.residuals:   # a GPU's measured efficiencies, checked
        return band_of([(r["name"], float(r["ratio"])) for r in eff.residuals],
                       basis="measured efficiencies", source=(
                           f"the measured efficiencies' residuals: measured / predicted step "
                           f"of the {len(eff.residuals)} steps they were checked on "
                           f"({eff.origin})"))
    if spec.table.platform == "tpu":
        return reference_band(spec.table.name, compiler_timed=compiler_timed)
    return Band(low=None, high=None, basis="none", source=(
        f"uncalibrated {spec.table.name}: no measured basis for a band; calibrate from "
        "profiles (wb.calibrate([trainer.profile(), ...])) for one"))
