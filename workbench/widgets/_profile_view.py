"""Predicted vs measured, term by term: one pair of bars per term of a profile report
(``trainer.profile()``), the largest disagreement named above them (anywidget)."""
from __future__ import annotations

from typing import Any

import anywidget
import traitlets

from workbench.widgets import _assets

__all__ = ["ProfileWidget", "profile_payload", "profile_widget"]


class ProfileWidget(anywidget.AnyWidget):
    """Bars of predicted and measured seconds per step for each term; display only."""

    _esm = _assets.esm("profile")
    _css = _assets.css("profile")
    payload = traitlets.Dict().tag(sync=True)


def profile_payload(report: Any) -> dict[str, Any]:
    """The widget's JSON payload (pure): the rows, the verdict, the top ops, the overhead."""
    m = report.measured
    return {"kind": "profile", "rows": report.rows(), "verdict": report.verdict(),
            "directory": report.directory, "plan_name": report.plan_name,
            "mesh": report.mesh, "steps": m.steps, "devices": m.devices,
            "calibrated": "calibration" in report.prediction.get("sources", {}),
            "tokens_per_s": dict(report.tokens_per_s),
            "top_ops": [{"name": o.name, "category": o.category, "seconds": o.seconds,
                         "source": o.source or o.op[:80]} for o in m.top(8)]}


def profile_widget(report: Any) -> ProfileWidget:
    """The widget of a ``ProfileReport``."""
    return ProfileWidget(payload=profile_payload(report))
