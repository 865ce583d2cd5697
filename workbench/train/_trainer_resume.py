"""Where a Trainer continues from: the newest readable checkpoint of its run directory
(or, for a fork, of its source run), the steps recorded beyond it, a restart when the
checkpoints are gone, and another writer that trained the run directory since.

A mixin of ``workbench.train._trainer.Trainer``: it reads the Trainer's ``config``,
``parts``, ``checkpoints`` and ``run_dir``, and sets its state, step, history and attempt.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from workbench import _runs as runs
from workbench.train._checkpoint import CheckpointError, Checkpoints
from workbench.train._setup import (
    attempt_curve,
    missing_checkpoints,
    recorded_steps,
    start_over_refused,
)


class Resume:
    """Restoring a Trainer's run, and noticing when its run directory changed under it."""

    def _stored_prediction(self) -> dict[str, Any] | None:
        """The prediction an earlier run in ``run_dir`` recorded (checked), if any."""
        try:
            return runs.clean_prediction(runs.read_run(self.run_dir).get("prediction"))
        except (OSError, ValueError, TypeError):
            return None

    def _load(self, source: Checkpoints | None) -> None:
        """Restores the newest readable checkpoint (of ``source`` for a fork), else inits."""
        ckpts = self.checkpoints
        if source is not None and not ckpts.all_steps():
            ckpts = source
        recorded, self.attempt, saved = recorded_steps(self.run_dir)
        if ckpts.all_steps():
            t0 = time.perf_counter()
            lora = self._lora
            train = self.parts.abstract_state
            target = {"train": lora.saved_state(train) if lora else train,
                      "rng": self._abstract_rng()}
            restored = ckpts.restore(target, data=self.parts.data)
            self._state, self._rng = restored.state["train"], restored.state["rng"]
            if lora:   # the checkpoint holds the adapters: the frozen base comes back
                self._state = self._state._replace(params=lora.combine(
                    self._base_params(), self._state.params))
            self.step = self.restored_from = restored.step
            done = int(self._state.step)
            want = restored.step * self.config.optimizer.accumulate
            if done != want:
                raise RuntimeError(f"checkpoint step {restored.step} holds state.step={done}, "
                                   f"expected {want} micro-steps; the checkpoint does not "
                                   "belong to this config")
            again = (f"; {runs.METRICS} records steps up to {recorded}: steps "
                     f"{restored.step + 1}-{recorded} are trained again from it (readers keep "
                     "their first records)") \
                if recorded > restored.step and ckpts is not source else ""
            self._say(f"restored checkpoint step {restored.step} from {ckpts.directory} "
                      f"({time.perf_counter() - t0:.1f} s){again}")
        else:
            self._start_over(ckpts, recorded, saved)
            self._init_state()
        # A fork starts with the history of its source run, up to the step it starts from.
        history_dir = ckpts.directory.parent if ckpts is source else self.run_dir
        self._inherited = ckpts is source
        if (history_dir / runs.METRICS).exists():
            self.history = [r for r in runs.read_metrics(history_dir) if r["step"] <= self.step]
        else:
            self.history = []
        self._disk_mark = self._mark()

    def _start_over(self, ckpts: Checkpoints, recorded: int, saved: int) -> None:
        """Before starting from step 0: refuses when the run directory records a saved
        checkpoint (step ``saved`` > 0) that is gone, or steps moved aside as unreadable,
        unless ``restart="ok"``, which makes this start a new attempt (logged when
        training). Steps recorded before any save (``recorded`` > 0: a run killed before
        its first checkpoint) are trained again from step 0, as a resume would, and said."""
        aside = ckpts.set_aside_steps()
        folder = ckpts.directory
        blocked = os.path.lexists(folder) and not folder.is_dir()   # nothing can be saved
        missing = self._found or missing_checkpoints(folder)
        self._found = None   # a later start (after a failure) looks again
        if not (saved or aside or blocked):
            if recorded:
                self._say(f"{self.run_dir} records {recorded} step(s) but no checkpoint was "
                          f"saved yet: steps 1-{recorded} are trained again from step 0 "
                          "(readers keep their first records)")
            return
        if blocked:
            missing += f" (move it aside first, e.g. to {folder.name}.bad)"
        if aside:
            names = ", ".join(p.name for p in aside)
            missing = (f"{folder} has no usable checkpoint: step(s) {names} were moved aside "
                       f"to {folder / 'corrupt'} as unreadable (or move a repaired step back "
                       "into the checkpoint directory)")
        if blocked or not self._restart_ok:
            raise CheckpointError(start_over_refused(self.run_dir, self.config, recorded,
                                                     self.attempt, saved, missing))
        self.attempt += 1
        self._restart_event = {"kind": "restart", "attempt": self.attempt,
                               "recorded_step": recorded, "missing": missing,
                               "accepted": "restart='ok'",
                               "ended": attempt_curve(self.run_dir, self.attempt - 1)}
        self._say(f"restart='ok': {missing}; starting {self.run_dir} again from step 0 as "
                  f"attempt {self.attempt} (the {recorded} recorded step(s) of attempt "
                  f"{self.attempt - 1} stay in {runs.METRICS})")

    def _writing(self) -> contextlib.AbstractContextManager[Any]:
        """Holds the run directory's lock while this Trainer writes (re-entrant; process 0
        only; a worker of a launched job writes under its launcher's lock)."""
        if self._lock is None:
            return contextlib.nullcontext()
        return self._lock.hold(what="trainer")

    def _mark(self) -> tuple[Any, ...] | None:
        """The newest checkpoint on disk (step, directory inode and time), to notice when
        another writer advanced the run directory between two ``run`` calls."""
        step = self.checkpoints.latest_step()
        if step is None:
            return None
        try:
            st = (self.checkpoints.directory / str(step)).stat()
        except OSError:
            return (step,)
        return (step, st.st_ino, st.st_mtime_ns)

    def _sync_with_disk(self) -> None:
        """Continues from the newest checkpoint if another writer (a CLI run, another
        kernel) trained this run directory since this Trainer last read or wrote it."""
        mark = self._mark()
        if mark == self._disk_mark:
            return
        self._say(f"{self.run_dir} changed since this Trainer read it (newest checkpoint: step "
                  f"{mark[0] if mark else 'none'}, this Trainer was at step {self.step}); "
                  "continuing from the newest checkpoint")
        self._close_trackers(wait=False)   # the next run() continues the tracker runs anew
        self._state = None
        self._load(self._source)

    def _reload_quietly(self) -> None:
        """After a failure: back to the newest good checkpoint (step, state, data position)."""
        try:
            self._load(self._source)
        except Exception:  # noqa: BLE001 - the state stays None and reloads on next use
            self._state = None
