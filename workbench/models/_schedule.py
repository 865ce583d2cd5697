"""A pipeline's schedule: how the stacked layers are pipelined (:class:`Pipeline`: micro-batches,
schedule, repeats) and the timeline that follows, which stage runs which micro-batch when.

:mod:`workbench.models._pipeline` runs the trainable schedules; this module is pure Python
(no JAX), what the plan and the notebooks read: each schedule's operations as events in
time (:func:`timeline`), the idle fraction they leave (:func:`schedule_bubble`, against
``Pipeline.bubble_fraction``'s formula), and the micro-batches whose activations each
stage holds (:func:`in_flight`, which the plan's per-stage memory uses).
``Pipeline(...).on(stages)`` is a :class:`Schedule`, which a notebook draws::

    events = timeline(Pipeline(microbatches=8, schedule="1f1b"), stages=4)
    schedule_bubble(events, 4), in_flight(events, 4)     # 3/11, [4, 3, 2, 1]
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from workbench._display import Displayable

__all__ = ["BACKWARD_COST", "SCHEDULES", "TRAINABLE_SCHEDULES", "Event", "Pipeline", "Schedule",
           "in_flight", "schedule_bubble", "timeline"]

SCHEDULES: tuple[str, ...] = ("gpipe", "circular", "1f1b")
TRAINABLE_SCHEDULES: tuple[str, ...] = ("gpipe", "circular")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pipeline:
    """How the stacked layers are pipelined over the ``stage`` mesh axis.

    Attributes:
        microbatches: ``M``, micro-batches the batch is cut into (divides the batch).
        schedule: "gpipe", "circular" (``repeats > 1``) or "1f1b" (planned, not trained).
        repeats: ``R``, rounds of the stage ring per micro-batch (circular only); each
            stage holds ``R`` chunks of ``n_layers / (stages R)`` layers.
    """

    microbatches: int = 1
    schedule: str = "gpipe"
    repeats: int = 1

    def __post_init__(self) -> None:
        for f in ("microbatches", "repeats"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"pipeline {f}={v!r} must be a positive integer")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule={self.schedule!r}; choose one of {SCHEDULES}")
        if self.repeats > 1 and self.schedule != "circular":
            raise ValueError(
                f"pipeline repeats={self.repeats} needs schedule='circular' (got "
                f"{self.schedule!r}); use {{'schedule': 'circular', 'repeats': {self.repeats}}} "
                f"or repeats=1")

    @classmethod
    def of(cls, value: Pipeline | Mapping[str, Any] | None) -> Pipeline | None:
        """None, a ``Pipeline`` or a mapping ``{"microbatches", "schedule", "repeats"}``."""
        if value is None or isinstance(value, Pipeline):
            return value
        if isinstance(value, Mapping):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = set(value) - known
            if unknown:
                raise ValueError(f"unknown pipeline keys {sorted(unknown)}; known: "
                                 f"{sorted(known)}")
            return cls(**dict(value))
        raise TypeError(f"pipeline must be None, a Pipeline or a mapping like "
                        f"{{'microbatches': 4, 'schedule': 'gpipe'}}; got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (``Pipeline.of`` inverts it)."""
        return dataclasses.asdict(self)

    def iterations(self, stages: int) -> int:
        """Loop iterations of the SPMD program: ``R M + S - 1``."""
        return self.repeats * self.microbatches + stages - 1

    def on(self, stages: int) -> Schedule:
        """The timeline on ``stages`` stages (a notebook draws it: stages x time, forward
        and backward per micro-batch, the bubble shaded; micro-batches and repeats can be
        changed in the widget): :class:`Schedule`."""
        return Schedule(pipeline=self, stages=stages)

    def bubble_fraction(self, stages: int) -> float:
        """Idle fraction of every stage's time by formula: ``(S - 1) / (R M + S - 1)``
        (GPipe and 1F1B: Huang et al. 2019, Narayanan et al. 2021; circular divides the
        bubble's length by ``R``)."""
        return (stages - 1) / self.iterations(stages)


#: Time of one backward relative to one forward of the same layers (two matmuls per one).
BACKWARD_COST = 2.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Event:
    """One stage working on one micro-batch: forward ("F") or backward ("B") of one chunk.

    Attributes:
        stage: the stage (row of devices on the ``stage`` axis).
        start: start time in units of one full-stage forward of one micro-batch.
        end: end time.
        kind: "F" or "B".
        micro: the micro-batch.
        repeat: the round of the ring (circular), else 0.
    """

    stage: int
    start: float
    end: float
    kind: str
    micro: int
    repeat: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return dataclasses.asdict(self)


def _stage_orders(pipe: Pipeline, stages: int) -> list[list[tuple[str, int]]]:
    """Each stage's operations in order: ``(kind, item)`` with item ``r M + m``."""
    m_, items = pipe.microbatches, pipe.microbatches * pipe.repeats
    orders = []
    for s in range(stages):
        if pipe.schedule == "1f1b":
            warm = min(stages - s - 1, m_)
            ops = [("F", i) for i in range(warm)]
            for j in range(m_ - warm):
                ops += [("F", warm + j), ("B", j)]
            ops += [("B", j) for j in range(m_ - warm, m_)]
        else:   # GPipe / circular as the SPMD loop and its transpose run them
            ops = [("F", i) for i in range(items)] + [("B", i) for i in reversed(range(items))]
        orders.append(ops)
    return orders


def timeline(pipe: Pipeline, stages: int) -> list[Event]:
    """The schedule as events, each operation starting as soon as its stage is free and its
    input has arrived (forward from the previous stage, backward from the next).

    Times are in units of one stage's forward of one micro-batch through all its layers;
    a circular chunk takes ``1/R`` of that, a backward :data:`BACKWARD_COST` times its
    forward.
    """
    m_, r_ = pipe.microbatches, pipe.repeats
    f_cost, b_cost = 1.0 / r_, BACKWARD_COST / r_
    orders = _stage_orders(pipe, stages)
    end: dict[tuple[str, int, int], float] = {}
    pos, free = [0] * stages, [0.0] * stages
    events: list[Event] = []
    total = sum(len(o) for o in orders)
    while len(events) < total:
        progressed = False
        for s in range(stages):
            while pos[s] < len(orders[s]):
                kind, i = orders[s][pos[s]]
                if kind == "F":
                    dep = ("F", s - 1, i) if s > 0 else (("F", stages - 1, i - m_)
                                                         if i >= m_ else None)
                else:
                    dep = ("B", s + 1, i) if s < stages - 1 else (
                        ("B", 0, i + m_) if i + m_ < m_ * r_ else ("F", s, i))
                if dep is not None and dep not in end:
                    break
                start = max(free[s], end[dep] if dep is not None else 0.0)
                stop = start + (f_cost if kind == "F" else b_cost)
                end[(kind, s, i)] = free[s] = stop
                events.append(Event(stage=s, start=start, end=stop, kind=kind,
                                    micro=i % m_, repeat=i // m_))
                pos[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {pipe} deadlocks on {stages} stages")
    return sorted(events, key=lambda e: (e.stage, e.start))


def schedule_bubble(events: list[Event], stages: int) -> float:
    """Idle fraction of the stages' time in a timeline: ``1 - busy / (S x makespan)``."""
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return 1.0 - busy / (stages * span)


def in_flight(events: list[Event], stages: int) -> list[int]:
    """Per stage, the most chunks whose forward has finished and backward not yet started
    (their activations are held): ``R M`` for GPipe/circular, ``min(S - s, M)`` for 1F1B."""
    out = []
    for s in range(stages):
        level = peak = 0
        for e in sorted((e for e in events if e.stage == s), key=lambda e: e.start):
            level += 1 if e.kind == "F" else -1
            peak = max(peak, level)
        out.append(peak)
    return out


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class Schedule(Displayable):
    """One pipeline's schedule on ``stages`` stages (``Pipeline.on(stages)``).

    Attributes:
        pipeline: micro-batches, schedule and repeats.
        stages: ``S``.
    """

    pipeline: Pipeline
    stages: int

    @property
    def events(self) -> list[Event]:
        """:func:`timeline`."""
        return timeline(self.pipeline, self.stages)

    @property
    def bubble(self) -> float:
        """Idle fraction of the timeline (:func:`schedule_bubble`)."""
        return schedule_bubble(self.events, self.stages)

    @property
    def in_flight(self) -> list[int]:
        """Chunks whose activations each stage holds at its peak (:func:`in_flight`)."""
        return in_flight(self.events, self.stages)

    def __repr__(self) -> str:
        p = self.pipeline
        return (f"<Schedule {p.schedule} on {self.stages} stages x {p.microbatches} "
                f"micro-batches" + (f" x {p.repeats} repeats" if p.repeats > 1 else "")
                + f": bubble {self.bubble:.1%} (formula {p.bubble_fraction(self.stages):.1%}),"
                f" in flight {self.in_flight}>")
