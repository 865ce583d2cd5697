"""Pipeline schedule view: stages x time, forward and backward per micro-batch, the bubble
shaded; micro-batches, repeats and the schedule can be changed in the widget (anywidget)."""
from __future__ import annotations

from typing import Any

import anywidget
import traitlets

from workbench.widgets import _assets

__all__ = ["ScheduleWidget", "schedule_payload", "schedule_widget"]


class ScheduleWidget(anywidget.AnyWidget):
    """The timeline of one pipeline schedule; ``payload`` follows the widget's controls
    (the front end recomputes the timeline as ``workbench.models._schedule.timeline``)."""

    _esm = _assets.esm("schedule")
    _css = _assets.css("schedule")
    payload = traitlets.Dict().tag(sync=True)


def schedule_payload(schedule: Any) -> dict[str, Any]:
    """The widget's JSON payload (pure): the pipeline, the events of its timeline, the
    bubble by formula and from the timeline, the chunks each stage holds."""
    from workbench.models._schedule import BACKWARD_COST, SCHEDULES

    p, s = schedule.pipeline, schedule.stages
    return {
        "kind": "schedule", "stages": s, "microbatches": p.microbatches,
        "schedule": p.schedule, "repeats": p.repeats, "schedules": list(SCHEDULES),
        "backward_cost": BACKWARD_COST, "events": [e.to_dict() for e in schedule.events],
        "bubble_formula": p.bubble_fraction(s), "bubble_schedule": schedule.bubble,
        "in_flight": schedule.in_flight,
    }


def schedule_widget(schedule: Any) -> ScheduleWidget:
    """The widget of a ``Schedule`` (``Pipeline(...).on(stages)``)."""
    return ScheduleWidget(payload=schedule_payload(schedule))
