"""What a Trainer's ``run()`` call reports to: the run writer (``run.json``, whose hardware
and model fields are :meth:`Reporting.run_meta`, and ``metrics.jsonl``), the history, the
trackers (opened once for the Trainer, ``workbench.train._trackers``), the progress display
and the caller's sinks, and the events a call opens with (a config change, fork or
restart, the plan's prediction, the compile, the step it resumes from).

A mixin of ``workbench.train._trainer.Trainer``: it reads the Trainer's ``config``,
``parts``, ``mesh``, ``history`` and the one-off events its construction left.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import jax

from workbench import _runs as runs
from workbench.train._sinks import History, Sink, broadcast, progress_sink, run_sinks
from workbench.train._trackers import Trackers, open_trackers


class Reporting:
    """The sinks and ``run.json`` fields of a Trainer's ``run()`` calls."""

    _trackers: Trackers | None

    def run_meta(self, target: int) -> dict[str, Any]:
        """``run.json`` fields describing the hardware and the model."""
        devices = self.mesh.devices.flat
        p = self.parts
        return {
            "mesh": dict(self.mesh.shape), "devices": [int(d.id) for d in devices],
            "device_kind": p.device_kind, "peak_flops": p.peak, "peak_source": p.peak_source,
            "model_flops_per_step": p.model_flops, "target_steps": target,
            "memory_per_device": self.memory_per_device,
            "attention": p.attention, "dtype": p.dtype,
            "compiler_options": dict(p.compile_options),
            "data": p.data.info, "process_count": jax.process_count(),
            "placement": dict(p.placement),
        } | ({} if self.attempt == 1 else {"attempt": self.attempt}) | (
            {} if self._restart_event is None else {"step": 0}) | (
            {} if self.config.init is None else {"init": self._init_record()}) | (
            {} if self._recorded_prediction is None
             else {"prediction": self._recorded_prediction})

    def _reporters(self, target: int, extra: Sequence[Sink]) -> list[Sink]:
        """Compiles the step if needed (showing it), opens the run directory and builds the
        sinks of this call: history, run writer, trackers, message, progress, ``extra``."""
        for sink in extra:
            if not isinstance(sink, Sink):
                raise TypeError(f"sinks=[...] needs objects with event(kind, **fields), "
                                f"update(record) and finish(status, message); got "
                                f"{type(sink).__name__}")
        progress = progress_sink(self.progress if self.primary else None, target,
                                 panel=lambda: self.widget(target=target))
        shown = [s for s in (progress,) if s is not None] + list(extra)
        compiled_now = self._compiled is None
        if compiled_now:
            broadcast(shown, "compiling")
            self.compiled_step()
        writer = runs.RunWriter(self.run_dir, config=self.config.to_dict(),
                                meta=self.run_meta(target)) if self.primary else None
        reporters = [History(self.history, on_step=self._set_step),
                     *run_sinks(writer, progress, self._tracker_sink(writer)), *shown]
        self._opening_events(reporters, writer, compiled_now)
        return reporters

    def _set_step(self, step: int) -> None:
        self.step = step

    def _tracker_sink(self, writer: runs.RunWriter | None) -> Trackers | None:
        """The Trainer's trackers (``workbench.train._trackers``), opened at its first
        ``run()``: their runs stay open until :meth:`close` (or the Trainer is collected,
        or the interpreter exits); each call gives them its run writer."""
        if writer is None or not self.config.trackers:
            return None
        if self._trackers is None:
            # the steps readers have (a fork's from its source run): TensorBoard has them
            through = max((r["step"] for r in self.history), default=0)
            self._trackers = open_trackers(self.config.trackers, writer, through)
            weakref.finalize(self, self._trackers.close, wait=False).atexit = False
        self._trackers.attach(writer)
        return self._trackers

    def _close_trackers(self, *, wait: bool) -> None:
        """Sends the trackers' last steps and finishes their runs (a later ``run()`` opens
        them again)."""
        if self._trackers is not None:
            self._trackers, trackers = None, self._trackers
            trackers.close(wait=wait)

    def _opening_events(self, reporters: Sequence[Sink], writer: runs.RunWriter | None,
                        compiled_now: bool) -> None:
        """A config change, fork or restart (once; a fork's first run also copies the
        source's curve into the run directory), the plan's prediction (once), the compile,
        and the step a run resumes from."""
        for name in ("_config_event", "_data_event", "_restart_event"):
            if getattr(self, name) is not None:
                event = dict(getattr(self, name))
                broadcast(reporters, event.pop("kind"), **event, step=self.step)
                setattr(self, name, None)
        if writer is not None and self._inherited and not self.checkpoints.all_steps():
            for rec in self.history:
                writer.log(rec)
        if self._prediction_event is not None:
            broadcast(reporters, "prediction", **self._prediction_event, step=self.step)
            self._prediction_event = None
        if compiled_now:
            broadcast(reporters, "compile", seconds=self.compile_seconds,
                      cache=self.compile_cache, attention=self.parts.attention,
                      dtype=self.parts.dtype,
                      compiler_options=dict(self.parts.compile_options))
        if self.step > 0:
            broadcast(reporters, "resume", step=self.step)
