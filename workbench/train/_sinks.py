"""Where a run reports: the sink protocol and the Trainer's own sinks.

The run loop never knows who listens: it calls ``event`` for things that happen once
(``compiling``, ``compile``, ``resume``, ``fork``, ``config_changed``), ``update`` with
each step's record (exactly once per step, in order) and ``finish`` when the call ends.
The Trainer builds the sinks: its history, the run writer (``run.json`` and
``metrics.jsonl``), the trackers of ``TrainConfig.trackers`` (``workbench.train._trackers``:
TensorBoard, W&B, MLflow), the progress line or the inline panel, the message on how
to continue, and any sinks passed to ``Trainer.run(sinks=...)``.

Example, a sink of one's own::

    class Losses:
        def __init__(self): self.losses = []
        def event(self, kind, **fields): pass
        def update(self, record): self.losses.append(record["loss"])
        def finish(self, status, message=None): print(status, self.losses[-1])

    trainer.run(steps=100, sinks=[Losses()])
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from workbench import _runs as runs
from workbench._notebook import in_notebook
from workbench.train._metrics import ProgressLine
from workbench.train._trackers import Trackers


@runtime_checkable
class Sink(Protocol):
    """What the run loop reports to.

    ``update`` is on the hot path (once per step, while the next step runs on the device):
    it should only store or buffer, never block.
    """

    def event(self, kind: str, **fields: Any) -> None:
        """Something that happens once: ``compiling``, ``compile`` (``seconds``,
        ``cache``), ``resume`` (``step``), ``fork`` / ``config_changed`` (``diff``, ``step``)."""

    def update(self, record: dict[str, Any]) -> None:
        """One step's record (``workbench.train._metrics.step_record``)."""

    def finish(self, status: str, message: str | None = None) -> None:
        """The call ended: ``finished``, ``interrupted`` or ``failed`` (then ``message`` is
        the error), with what happened and how to continue."""


def broadcast(sinks: Iterable[Sink], kind: str, **fields: Any) -> None:
    """Sends one event to every sink, in order."""
    for sink in sinks:
        sink.event(kind, **fields)


class History:
    """The Trainer's ``history``: appends every step record to ``records`` and, with
    ``on_step``, tells the owner the step each record completes (so ``trainer.step`` is live
    while ``run`` trains, for a thread or a widget that watches it)."""

    def __init__(self, records: list[dict[str, Any]],
                 on_step: Callable[[int], None] | None = None) -> None:
        self.records, self.on_step = records, on_step
        if on_step is None:
            self.update = records.append  # type: ignore[method-assign]

    def update(self, record: dict[str, Any]) -> None:
        """Appends ``record`` and reports its step."""
        self.records.append(record)
        self.on_step(record["step"])  # type: ignore[misc]

    def event(self, kind: str, **fields: Any) -> None:
        """Events are not history."""

    def finish(self, status: str, message: str | None = None) -> None:
        """Nothing to close."""


class RunSink:
    """The run directory: steps to ``metrics.jsonl``, events beside them, the final status
    (and a failure's error) to ``run.json``."""

    def __init__(self, writer: runs.RunWriter) -> None:
        self.writer = writer
        self.update = writer.log

    def event(self, kind: str, **fields: Any) -> None:
        """Appends ``{"event": kind, ...}`` to ``metrics.jsonl``."""
        self.writer.event(kind, **fields)

    def finish(self, status: str, message: str | None = None) -> None:
        """Closes the run with its status; a failed run keeps ``message`` as its error."""
        self.writer.close(status, error=message if status == "failed" else None)


class ContinueMessage:
    """Prints how to continue an interrupted run (where no progress line says it)."""

    def event(self, kind: str, **fields: Any) -> None:
        """Not shown."""

    def update(self, record: dict[str, Any]) -> None:
        """Not shown."""

    def finish(self, status: str, message: str | None = None) -> None:
        """Prints ``message`` to stderr when the run was interrupted."""
        if status == "interrupted" and message:
            print(message, file=sys.stderr, flush=True)


def progress_sink(mode: str | None, target: int, *, panel: Callable[[], Any]) -> Any:
    """What shows the run's progress: ``panel()`` (the Trainer's inline view, made through
    its display route) shown in a notebook, a :class:`ProgressLine` elsewhere, or None.

    Args:
      mode: "auto" (the panel in a notebook, else the line), "widget", "line" or None.
      target: the step the run trains to.
      panel: makes the inline panel (a sink with a ``display()`` method).
    """
    if mode is None:
        return None
    if mode == "auto":
        mode = "widget" if in_notebook() else "line"
    if mode == "widget":
        view = panel()
        view.display()
        return view
    if mode == "line":
        return ProgressLine(target)
    raise ValueError(f"progress={mode!r}; use 'auto', 'widget', 'line' or None")


def run_sinks(writer: runs.RunWriter | None, progress: Any,
              trackers: Trackers | None) -> list[Sink]:
    """Process 0's sinks (``writer`` is None elsewhere): the run directory, the Trainer's
    trackers (``workbench.train._trackers.open_trackers``, None without) and how to
    continue (unless the progress line says it)."""
    if writer is None:
        return []
    out: list[Sink] = [RunSink(writer), *([trackers] if trackers is not None else [])]
    if not isinstance(progress, ProgressLine):
        out.append(ContinueMessage())
    return out
