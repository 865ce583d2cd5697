"""The Trainer: a resumable run loop around the one train step of ``workbench._step``.

``Trainer(config, run_dir=...)`` builds the mesh, the sharded state (restored from the
run directory's newest readable checkpoint, else initialised from the seed), the Grain
input pipeline and the jitted step (in/out shardings, donated state). ``run(steps=N)``
trains until the run has done ``N`` updates in total; a metrics line is written after each
update (step ``k`` is the ``k``-th update, from 1). Ctrl-C and SIGTERM stop at a step
boundary with a checkpoint; a new process with the same ``run_dir`` continues where the
last checkpoint left off, with bitwise the same losses on CPU.
"""
from __future__ import annotations

import functools
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from workbench._validate import check_int, check_path, check_steps, no_new_empty_dirs
from workbench._display import Displayable
from workbench._run_lock import RunLock
from workbench.train._checkpoint import Checkpoints
from workbench.train._config import TrainConfig
from workbench.train._loop import LoopInputs, NonFiniteLoss, RunResult, run_loop
from workbench.train._metrics import step_record
from workbench.train._sinks import Sink
from workbench.train._trackers import Trackers, require, stored_records
from workbench.train._trainer_compile import Compiled
from workbench.train._trainer_plan import plan_config, prediction_record
from workbench.train._trainer_report import Reporting
from workbench.train._trainer_resume import Resume
from workbench.train._trainer_start import StartState
from workbench.train._setup import (
    DataChanged,
    RunConfigMismatch,
    build_parts,
    check_data,
    check_data_changed,
    check_keep,
    check_restart,
    check_run_dir,
    enable_compile_cache,
    fork_to_start_over,
    missing_checkpoints,
)

__all__ = ["DataChanged", "NonFiniteLoss", "RunConfigMismatch", "RunResult", "Trainer"]

def _no_empty_dirs_on_failure(init: Any) -> Any:
    """``Trainer.__init__`` that, when it raises, removes the run directory (and its
    ``checkpoints/``) if it made them and they are still empty."""
    @functools.wraps(init)
    def wrapper(self: Any, config: Any, run_dir: Any, *args: Any, **kwargs: Any) -> None:
        check_path(run_dir, "run_dir", where="Trainer ")   # e.g. run_dir='runs/tiny'
        with no_new_empty_dirs(run_dir):
            init(self, config, run_dir, *args, **kwargs)
    return wrapper


def _check_arguments(config: Any, *, flags: dict[str, Any], progress: Any, compile_cache: Any,
                     data_cache: Any, initial_model: Any) -> bool | str | os.PathLike[str]:
    """``Trainer``'s arguments checked, and ``config``'s files (before anything is written):
    raises naming the argument and what it takes. Returns ``compile_cache`` (a bool or a
    directory)."""
    if not isinstance(config, TrainConfig):
        raise TypeError(f"Trainer config={config!r:.80} is a {type(config).__name__}; "
                        "config must be a wb.TrainConfig (use Trainer.from_plan(plan, "
                        "...) for a Plan)")
    config.check()   # the files it names (init folder, data), before anything is written
    for name, flag in flags.items():
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"Trainer {name}={flag!r:.80} must be True or False")
    if progress is not None and (not isinstance(progress, str)
                                 or progress not in ("auto", "widget", "line")):
        raise ValueError(f"Trainer progress={progress!r:.80}; use 'auto', 'widget', "
                         "'line' or None")
    if isinstance(compile_cache, (bool, np.bool_)):
        compile_cache = bool(compile_cache)
    else:
        check_path(compile_cache, "compile_cache", where="Trainer ")
    if data_cache is not None:
        check_path(data_cache, "data_cache", where="Trainer ")
    from flax import nnx

    if initial_model is not None and not isinstance(initial_model, nnx.Module):
        raise TypeError(f"Trainer initial_model={initial_model!r:.80} is a "
                        f"{type(initial_model).__name__}; give an nnx.Module of the "
                        "config's model (plan.materialize(...)), or None")
    return compile_cache


class Trainer(Compiled, Reporting, Resume, StartState, Displayable):
    """Trains ``config`` in ``run_dir``, resuming from its checkpoints.

    Args:
      config: the experiment.
      run_dir: the run directory (``run.json``, ``metrics.jsonl``, ``checkpoints/``).
      fork: if ``run_dir`` holds a run with a different config, start a new run directory
        ``<run_dir>-fork-<hash>`` from that run's newest checkpoint instead of refusing.
      force: continue ``run_dir`` with the new config anyway (recorded as an event).
      data_changed: what to do when ``run_dir`` was trained on other data than
        ``config.data`` reads now (a document file or the tokenizer changed: their
        SHA-256 differ from ``run.json``'s ``data``): None refuses (``DataChanged``, naming
        what changed); "ok" continues the run on the new data, recorded in ``run.json``'s
        ``history``. ``fork=True`` starts a new run directory from the newest checkpoint
        instead. A choice for this resume, not part of the experiment: it is not in the
        config (a later resume on yet other data is refused again).
      restart: what to do when ``run_dir`` records a saved checkpoint (``run.json``,
        ``metrics.jsonl``) that no checkpoint restores (its checkpoints were deleted, or
        the process died while saving its first): None refuses (``CheckpointError``, naming
        what is missing); "ok" starts the run again from step 0 as a new *attempt*
        (``run.json``'s ``attempt`` and a ``restart`` entry in its ``history``; the new
        attempt's ``metrics.jsonl`` lines carry ``"attempt"``, the old ones stay).
        ``fork=True`` starts a new run directory instead. A choice for this start, not
        part of the experiment.
      progress: "auto" (a live panel in notebooks, a progress line elsewhere), "widget",
        "line" or None.
      compile_cache: JAX's persistent compilation cache: True (``~/.cache/workbench/
        jax-compile`` unless one is configured), a directory, or False (leave JAX alone).
      async_checkpoint: write checkpoints in the background after the device-to-host copy.
      data_cache: where the text corpus' ArrayRecord file is kept.
      initial_model: an ``nnx.Module`` whose parameters start the run when it has no
        checkpoint yet (see :meth:`from_plan`).
      prediction: the ``wb.plan(...)`` of this config (see :meth:`from_plan`): its predicted
        step time and MFU are recorded in ``run.json`` (``"prediction"``) beside the
        measured ones. Without it, a resumed run keeps the prediction it has.

    Example::

        trainer = wb.Trainer(wb.TrainConfig(model="tiny", mesh={"data": 8}), run_dir="runs/tiny")
        trainer.run(steps=200)   # after Ctrl-C or a restart, the same cell continues
    """

    @_no_empty_dirs_on_failure
    def __init__(self, config: TrainConfig, run_dir: str | os.PathLike[str], *,
                 fork: bool = False, force: bool = False, data_changed: str | None = None,
                 restart: str | None = None, progress: str | None = "auto",
                 compile_cache: bool | str | os.PathLike[str] = True,
                 async_checkpoint: bool = True,
                 data_cache: str | os.PathLike[str] | None = None,
                 initial_model: Any = None, prediction: Any = None) -> None:
        compile_cache = _check_arguments(
            config, flags={"fork": fork, "force": force, "async_checkpoint": async_checkpoint},
            progress=progress, compile_cache=compile_cache, data_cache=data_cache,
            initial_model=initial_model)
        self.config = config
        check_data_changed(data_changed)
        self._restart_ok = check_restart(restart) == "ok"
        self.run_dir, source, self._config_event = check_run_dir(
            Path(run_dir), config, fork=fork, force=force)
        self.progress = progress
        self.compile_cache = enable_compile_cache(compile_cache)
        self.primary = jax.process_index() == 0
        if self.primary:   # the trackers' libraries, and the runs run.json says they continue
            require(config.trackers)
            stored_records(self.run_dir, config.trackers)
        t0 = time.perf_counter()
        self.parts = build_parts(config, data_cache=data_cache)
        # the data read now against what the run trained on (before anything is written)
        self.run_dir, data_source, self._data_event = check_data(
            self.run_dir, config, self.parts.data.info, fork=fork, data_changed=data_changed)
        source = source or data_source
        if source is None:   # fork=True on a run whose trained steps no checkpoint restores
            self.run_dir, event = fork_to_start_over(self.run_dir, config, fork=fork)
            self._config_event = event or self._config_event
        self._restart_event: dict[str, Any] | None = None
        self.attempt = 1
        if self.parts.data.info.get("note"):   # e.g. documents longer than a row were split
            self._say(f"data: {self.parts.data.info['note']}")
        self.mesh, self.rules = self.parts.mesh, self.parts.rules
        # one writer per run directory (workbench._run_lock): held while restoring and running
        self._lock = RunLock(self.run_dir) if self.primary else None
        self._disk_mark: Any = None
        self._state: Any = None
        self._rng: Any = None
        self.step = 0
        self.restored_from: int | None = None
        self._compiled: Any = None
        self._evaluator: Any = None
        self._lr_fn: Any = None
        self._lr_blocks: dict[int, np.ndarray] = {}
        self.compile_seconds: float | None = None
        self.compiled_flops: float | None = None
        self.memory_per_device: dict[str, int] | None = None
        self.history: list[dict[str, Any]] = []
        self._trackers: Trackers | None = None
        self._inherited = False
        self._source = source
        self._initial_model = initial_model
        self._recorded_prediction, self._prediction_event = prediction_record(prediction)
        self._plan = prediction   # the plan whose prediction trainer.profile() compares with
        self.prediction = self._recorded_prediction or self._stored_prediction()
        # what the checkpoint folder holds before Orbax creates it or clears unfinished saves
        self._found = missing_checkpoints(self.run_dir / "checkpoints")
        with self._writing():
            self.checkpoints = Checkpoints(self.run_dir / "checkpoints", keep=config.keep,
                                           every=config.checkpoint_every,
                                           async_save=async_checkpoint)
            lowered = check_keep(self.checkpoints, self.run_dir, config.keep, force=force)
            if lowered:
                self._say(lowered)
            self._load(source)
        self.setup_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> Any:
        """The current ``TrainState`` (step, params, opt_state) as sharded arrays."""
        if self._state is None:
            with self._writing():
                self._load(self._source)
        return self._state

    @property
    def model(self) -> Any:
        """The model as an ``nnx.Module`` with the current parameters."""
        from flax import nnx

        return nnx.merge(self.parts.graphdef, self.state.params)

    @property
    def losses(self) -> list[float]:
        """Loss of every step done so far (the whole run, across resumes)."""
        return [r["loss"] for r in self.history if r["step"] <= self.step]

    def close(self) -> None:
        """Waits for checkpoint writes in flight and closes the checkpoint manager, then
        sends the trackers' last steps and finishes their runs (waiting at most
        ``workbench.train._trackers.FINISH_SECONDS``). The Trainer cannot train after this."""
        self._closed = True
        self.checkpoints.close()
        self._close_trackers(wait=True)

    @classmethod
    def from_plan(cls, plan: Any, run_dir: str | os.PathLike[str], *, model: Any = None,
                  optimizer: Any = None, steps: int = 200, data: Any = "text",
                  checkpoint_every: int = 20, keep: int = 3, seed: int = 0,
                  **kwargs: Any) -> Trainer:
        """A Trainer for a plan's model config, mesh, rules, batch and sequence length.

        Args:
          plan: a ``wb.plan(...)`` on real devices of a ``GPTConfig`` or of a model
            factory (``wb.any_model.from_nnx`` / ``from_penzai`` spec, trained on token
            batches; see ``workbench.train._trainer_plan._plan_spec``).
          run_dir: the run directory.
          model: ``plan.materialize(...)``: its parameters start the run (when the run has
            no checkpoint yet); default: initialised from ``seed``.
          optimizer: a ``wb.train.AdamW`` spec (the plan's optax object is not
            serialisable; default ``AdamW()``).
          steps, data, checkpoint_every, keep, seed: as in ``TrainConfig``.
          **kwargs: passed to ``Trainer`` (``progress``, ``fork``, ...).

        The plan's prediction (``plan.predicted``: step time, MFU, tokens/s, bound, with
        ``plan.source``) is recorded in ``run.json`` as ``"prediction"`` (kept on resume)
        and shown beside the measured numbers; where the plan has none (no hardware
        numbers), a ``prediction`` event in ``metrics.jsonl`` says why.

        Example::

            plan = wb.plan(cfg, mesh=mesh, rules="fsdp", batch=8, seq=128)
            trainer = wb.Trainer.from_plan(plan, "runs/p", model=plan.materialize(seed=0))
        """
        config = plan_config(plan, optimizer=optimizer, steps=steps, data=data,
                             checkpoint_every=checkpoint_every, keep=keep, seed=seed)
        return cls(config, run_dir, initial_model=model, prediction=plan, **kwargs)

    # ------------------------------------------------------------------ run
    def run(self, steps: int | None = None, *, sinks: Sequence[Sink] = ()) -> RunResult:
        """Trains until the run has done ``steps`` updates in total (default ``config.steps``).

        Re-running when the target is reached does nothing (and says so). Ctrl-C or
        SIGTERM: finishes the current step, saves a checkpoint, waits for it and returns.

        Args:
          steps: the total number of updates to reach (a positive int; not a bool).
          sinks: further reporters (``workbench.train._sinks.Sink``: ``event``, ``update``,
            ``finish``) beside the run directory, the trackers and the progress display.

        Raises:
          NonFiniteLoss: the loss or gradient norm became NaN/inf (the last good
            checkpoint is kept; nothing after it is saved).
          CheckpointError: a save failed (disk full); the previous checkpoint is intact.
          JobRunningError: another writer (a running Trainer, CLI run or launched job)
            holds the run directory; nothing was changed.
        """
        target = self.config.steps if steps is None else check_int(
            steps, "steps", where="Trainer.run: ",
            fix="steps is the total number of updates the run trains to, e.g. steps=200")
        check_steps(target, "steps", where="Trainer.run: ")
        with self._writing():  # refused while another writer holds the run directory
            self._sync_with_disk()
            try:
                return self._run(target, sinks)
            finally:
                self._disk_mark = self._mark()

    def _run(self, target: int, sinks: Sequence[Sink]) -> RunResult:
        """:meth:`run` once the run directory is locked and in sync."""
        if self.step >= target:
            msg = (f"run {self.run_dir} is already at step {self.step} (target {target}); "
                   f"nothing to do. Train further with trainer.run(steps=N), N > {self.step}.")
            self._say(msg)
            return RunResult(status="finished", step=self.step, target=target, message=msg)
        state = self.state  # restores after a failed or aborted run
        reporters = self._reporters(target, sinks)
        try:
            result, state = run_loop(self._loop_inputs(reporters), state,
                                     start=self.step, target=target)
        except BaseException:
            self._state = None  # the step in flight may have consumed the state's buffers
            self._reload_quietly()
            raise
        self._state, self.step = state, result.step
        return result

    def _loop_inputs(self, reporters: Sequence[Sink]) -> LoopInputs:
        """What the run loop uses: the compiled step, the run's pieces, and ``reporters``."""
        p, cfg = self.parts, self.config
        record = functools.partial(
            step_record, tokens=cfg.tokens_per_step, model_flops=p.model_flops,
            n_devices=p.n_devices, peak=p.peak, peak_source=p.peak_source,
            compiled_flops=self.compiled_flops, fp8_peak=p.fp8_peak)
        return LoopInputs(step_fn=self.compiled_step(), rng=self._rng, data=p.data,
                          checkpoints=self.checkpoints, accumulate=cfg.optimizer.accumulate,
                          checkpoint_every=cfg.checkpoint_every, config=cfg.to_dict(),
                          lr=self.lr, record=record, sinks=tuple(reporters),
                          run_dir=self.run_dir, evaluate=self.evaluator(),
                          eval_every=cfg.eval_every,
                          saved=self._lora.saved_state if self._lora else None)

    def profile(self, steps: int = 3, *, warmup: int = 3, plan: Any = None,
                directory: str | os.PathLike[str] | None = None) -> Any:
        """Profile ``steps`` steady-state steps: predicted vs measured, term by term.

        Trains ``warmup`` steps, then ``steps`` more under a ``jax.profiler`` trace (both
        recorded as usual), written to ``run_dir/profiles/<first traced step>`` (open it
        with ``xprof --logdir <run_dir>/profiles``), and lines the trace up against the
        plan's prediction (``workbench.perf._profile.ProfileReport``, also saved
        there as ``report.json``); ``wb.calibrate(report)`` feeds it back into predictions.

        Args:
          steps: steps traced, 1 to ``workbench.train._profile.MAX_STEPS``.
          warmup: untraced steps first (their tokens/s is the "outside" throughput the
            profiler's overhead is measured against).
          plan: the plan to compare with (default: the one of ``from_plan``, else
            ``wb.plan`` of this config).
          directory: where the trace goes instead.

        Raises:
          ProfileError: this Trainer was closed, or a trace is already running.
          JobRunningError: another writer (a launched job) holds the run directory.
          PermissionError: the trace directory is not writable (nothing was trained).
        """
        from workbench.train._profile import profile_trainer

        return profile_trainer(self, steps=steps, warmup=warmup, plan=plan,
                               directory=directory)

    # ------------------------------------------------------------------ helpers
    def _say(self, message: str) -> None:
        if self.primary:
            print(message, file=sys.stderr if self.progress is None else sys.stdout,
                  flush=True)

    def __repr__(self) -> str:
        last = self.history[-1]["loss"] if self.history else math.nan
        return (f"Trainer(run_dir={str(self.run_dir)!r}, step={self.step}/"
                f"{self.config.steps}, loss={last:.4f}, mesh={dict(self.mesh.shape)})")
