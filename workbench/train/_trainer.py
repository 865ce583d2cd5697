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

import contextlib
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

from workbench import _runs as runs
from workbench._validate import check_int, check_path, check_steps, no_new_empty_dirs
from workbench._display import Displayable
from workbench._run_lock import RunLock
from workbench.train._checkpoint import CheckpointError, Checkpoints
from workbench.train._config import TrainConfig
from workbench.train._loop import LoopInputs, NonFiniteLoss, RunResult, run_loop
from workbench.train._metrics import step_record
from workbench.train._sinks import History, Sink, broadcast, progress_sink, run_sinks
from workbench.train._trackers import require, stored_records
from workbench.train._setup import (
    DataChanged,
    RunConfigMismatch,
    attempt_curve,
    build_parts,
    check_data,
    check_data_changed,
    check_keep,
    check_restart,
    check_run_dir,
    enable_compile_cache,
    fork_to_start_over,
    missing_checkpoints,
    recorded_steps,
    start_over_refused,
)

__all__ = ["DataChanged", "NonFiniteLoss", "RunConfigMismatch", "RunResult", "Trainer"]

_LR_BLOCK = 4096


def _no_empty_dirs_on_failure(init: Any) -> Any:
    """``Trainer.__init__`` that, when it raises, removes the run directory (and its
    ``checkpoints/``) if it made them and they are still empty."""
    @functools.wraps(init)
    def wrapper(self: Any, config: Any, run_dir: Any, *args: Any, **kwargs: Any) -> None:
        check_path(run_dir, "run_dir", where="Trainer ")   # e.g. run_dir='runs/tiny'
        with no_new_empty_dirs(run_dir):
            init(self, config, run_dir, *args, **kwargs)
    return wrapper


class Trainer(Displayable):
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
        if not isinstance(config, TrainConfig):
            raise TypeError(f"Trainer config={config!r:.80} is a {type(config).__name__}; "
                            "config must be a wb.TrainConfig (use Trainer.from_plan(plan, "
                            "...) for a Plan)")
        config.check()   # the files it names (init folder, data), before anything is written
        for name, flag in (("fork", fork), ("force", force),
                           ("async_checkpoint", async_checkpoint)):
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

    def _stored_prediction(self) -> dict[str, Any] | None:
        """The prediction an earlier run in ``run_dir`` recorded (checked), if any."""
        try:
            return runs.clean_prediction(runs.read_run(self.run_dir).get("prediction"))
        except (OSError, ValueError, TypeError):
            return None

    @property
    def losses(self) -> list[float]:
        """Loss of every step done so far (the whole run, across resumes)."""
        return [r["loss"] for r in self.history if r["step"] <= self.step]

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

    def _init_state(self) -> None:
        """Step 0: the state from ``initial_model`` / ``config.init``, else from the seed."""
        if self._initial_model is not None or self.config.init is not None:
            self._state = self._state_from_model(self._initial_model)
        else:
            from workbench._step import init_state

            _, self._state = init_state(self.parts.model_config, self.parts.tx, self.rules,
                                        self.mesh, seed=self.config.seed)
        self._rng = self._new_rng()
        self.step = 0
        self.parts.data.set_state(self.parts.initial_data_state)

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
        self._state = None
        self._load(self._source)

    def close(self) -> None:
        """Waits for checkpoint writes in flight and closes the checkpoint manager (the
        Trainer cannot train after this)."""
        self._closed = True
        self.checkpoints.close()

    def _new_rng(self) -> Any:
        """The run's base PRNG key (typed), replicated over the mesh: a global array, so
        every process saves the same key in a multi-process checkpoint."""
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return jax.jit(lambda: jax.random.key(self.config.seed), out_shardings=replicated)()

    def _abstract_rng(self) -> Any:
        key = jax.eval_shape(lambda: jax.random.key(0))
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated)

    def _state_from_model(self, model: Any) -> Any:
        """A fresh TrainState whose params are ``model``'s, laid out by this run's rules."""
        from flax import nnx

        from workbench._step import TrainState

        if model is None:   # TrainConfig.init: an HF folder, read into this run's shardings
            from workbench._hf_reader import reader
            from workbench._hub import MODEL_FILES

            hub = self._init_hub(MODEL_FILES)
            if hub is not None:
                reader().check_weights(hub, "TrainConfig", arg="init")
                self._init_resolved = hub
            params = self._base_params(hub)
            if self._lora:   # fresh adapters (B = 0) on the loaded base
                params = self._lora.combine(params, self._seed_params(adapters=True))
            model = nnx.merge(self.parts.graphdef, params)
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        want = self.parts.abstract_state.params
        if jax.tree.structure(params) != jax.tree.structure(want):
            raise ValueError("the model's parameters do not match the config's model "
                             f"({self.parts.model_config}); pass the model of the same plan")
        sh = self.parts.shardings
        params = jax.device_put(params, sh.params)
        tx = self._lora.for_params(self.parts.tx, params) if self._lora else self.parts.tx
        opt_state = jax.jit(tx.init, out_shardings=sh.opt_state)(params)
        step = jax.device_put(np.zeros((), np.int32), sh.step)
        return TrainState(step=step, params=params, opt_state=opt_state)

    @property
    def _lora(self) -> Any:
        """``workbench.models._lora`` for a LoRA run (``TrainConfig.lora``, or a model config
        with adapters, e.g. from a plan), else None."""
        if getattr(self.parts.model_config, "lora", None) is None:
            return None
        from workbench.models import _lora as lora

        return lora

    def _base_params(self, hub: Any = None) -> Any:
        """The frozen weights: ``init``'s (a LoRA run's base, loaded into this run's
        shardings without its adapters) or, without ``init``, the seed's (a LoRA run's:
        the same bits as at step 0)."""
        shardings = self.parts.shardings.params
        cfg = self.parts.model_config
        if self._lora:
            shardings = self._lora.split_params(shardings)[0]
            cfg = cfg.replace(lora=None)
        if self.config.init is None:
            return self._seed_params(adapters=False)
        from workbench._hf_reader import reader
        from workbench._hub import MODEL_FILES

        if hub is None:
            hub = self._init_hub(MODEL_FILES)
        if hub is not None:
            reader().check_weights(hub, "TrainConfig", arg="init")
            self._init_resolved = hub
        params, source = reader().load_params(hub.path if hub else self.config.init, cfg, shardings,
                                     hub=hub)
        self._say(f"initialised from {source.family} checkpoint {source.path}"
                  + (f" ({hub.repo_id} at commit {hub.revision})" if hub else ""))
        return params

    def _seed_params(self, *, adapters: bool) -> Any:
        """The adapters (or the base) of a LoRA model initialised from the run's seed,
        straight into their shards (XLA drops the other part's initialisation)."""
        from workbench._step import seed_params

        lora, every = self._lora, self.parts.shardings.params
        part = 1 if adapters else 0

        def init(key: Any) -> Any:
            return lora.split_params(seed_params(self.parts.model_config, every, key))[part]

        shardings = lora.split_params(every)[part]
        return jax.jit(init, out_shardings=shardings)(jax.random.key(self.config.seed))

    @classmethod
    def from_plan(cls, plan: Any, run_dir: str | os.PathLike[str], *, model: Any = None,
                  optimizer: Any = None, steps: int = 200, data: Any = "text",
                  checkpoint_every: int = 20, keep: int = 3, seed: int = 0,
                  **kwargs: Any) -> Trainer:
        """A Trainer for a plan's model config, mesh, rules, batch and sequence length.

        Args:
          plan: a ``wb.plan(...)`` on real devices of a ``GPTConfig`` or of a model
            factory (``wb.any_model.from_nnx`` / ``from_penzai`` spec, trained on token
            batches; see ``_plan_spec``).
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
        from workbench._optimizer import AdamW

        if getattr(plan, "cfg", None) is None and getattr(plan, "factory", None) is None:
            raise TypeError(f"Trainer.from_plan needs a wb.plan(...) Plan, got "
                            f"{type(plan).__name__}")
        if plan.mesh.jax_mesh is None:
            raise ValueError(f"plan is on {plan.mesh.describe()} (no real devices); plan on "
                             "wb.make_mesh(...) to train")
        config = TrainConfig(model=plan.cfg if plan.cfg is not None else _plan_spec(plan),
                             mesh=dict(plan.mesh.shape), rules=plan.rules,
                             batch=plan.report.batch, seq=plan.report.seq, steps=steps,
                             optimizer=optimizer if optimizer is not None else AdamW(),
                             data=data, checkpoint_every=checkpoint_every, keep=keep,
                             seed=seed, pipeline=getattr(plan, "pipeline", None))
        return cls(config, run_dir, initial_model=model, prediction=plan, **kwargs)

    # ------------------------------------------------------------------ compile
    def compiled_step(self) -> Any:
        """The AOT-compiled train step (compiled once, timed, logged as an event)."""
        if self._compiled is None:
            from workbench._flops import compiled_flops
            from workbench._step import jit_train_step, make_train_step

            p = self.parts
            fn = make_train_step(p.graphdef, p.tx, rules=self.rules, mesh=self.mesh,
                                 pipeline=self.config.pipeline)
            jitted = jit_train_step(fn, p.shardings, p.batch_shardings, donate=True,
                                    compiler_options=p.compile_options)
            t0 = time.perf_counter()
            self._compiled = jitted.lower(p.abstract_state, p.abstract_batch).compile()
            self.compile_seconds = time.perf_counter() - t0
            flops = compiled_flops(self._compiled)
            self.compiled_flops = flops * self.config.optimizer.accumulate if flops else None
            mem = self._compiled.memory_analysis()
            self.memory_per_device = None if mem is None else {
                k: int(getattr(mem, f"{k}_size_in_bytes", 0) or 0)
                for k in ("argument", "output", "temp", "generated_code")}
        return self._compiled

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

    def _set_step(self, step: int) -> None:
        self.step = step

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
        trackers = self.config.trackers
        stored = stored_records(self.run_dir, trackers) if self.primary else {}
        writer = runs.RunWriter(self.run_dir, config=self.config.to_dict(),
                                meta=self.run_meta(target)) if self.primary else None
        reporters = [History(self.history, on_step=self._set_step),
                     *run_sinks(writer, progress, trackers=trackers, stored=stored,
                               history=self._tracked() if trackers else []), *shown]
        self._opening_events(reporters, writer, compiled_now)
        return reporters

    def _tracked(self) -> list[dict[str, Any]]:
        """The steps trained so far as readers of ``metrics.jsonl`` have them (the first
        record of each step; a new fork's from its source run): the trackers' backfill."""
        recs = runs.read_metrics(self.run_dir) \
            if (self.run_dir / runs.METRICS).exists() else []
        seen = {r["step"] for r in recs}
        return sorted([*recs, *(r for r in self.history if r["step"] not in seen)],
                      key=lambda r: r["step"])

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

    def evaluator(self) -> Any:
        """The held-out evaluation (``workbench.train._evaluate.Evaluator``), or None when
        ``config.eval_every`` is 0."""
        if not self.config.eval_every:
            return None
        if self._evaluator is None:
            from workbench.train._evaluate import Evaluator

            p = self.parts
            self._evaluator = Evaluator(p.graphdef, p.eval_data, p.shardings.params,
                                        rules=self.rules, mesh=self.mesh)
        return self._evaluator

    def _reload_quietly(self) -> None:
        """After a failure: back to the newest good checkpoint (step, state, data position)."""
        try:
            self._load(self._source)
        except Exception:  # noqa: BLE001 - the state stays None and reloads on next use
            self._state = None

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

    def _recorded_init(self) -> dict[str, Any]:
        """``run.json``'s ``init`` record of this run, if it has one for this Hub id."""
        try:
            rec = runs.read_run(self.run_dir).get("init") or {}
        except (OSError, ValueError):
            return {}
        ok = isinstance(rec, dict) and rec.get("repo_id") == self.config.init \
            and isinstance(rec.get("revision"), str)
        return rec if ok else {}

    def _init_hub(self, files: list[str]) -> Any:
        """``TrainConfig.init``'s Hub snapshot (None for a local folder), at the commit the
        run recorded when it started (a resume loads the same weights), else at
        ``init_revision`` ("main")."""
        from workbench._hub import is_hub_id, resolve

        if not is_hub_id(self.config.init):
            return None
        revision = self._recorded_init().get("revision") or self.config.init_revision
        return resolve(self.config.init, revision=revision, files=files,
                       where="TrainConfig", arg="init")

    def _init_record(self) -> dict[str, Any]:
        """``run.json``'s ``init``: the folder, and for a Hub id the id and commit."""
        from workbench._hub import CONFIG_FILES

        hub = getattr(self, "_init_resolved", None) or self._recorded_init() or \
            self._init_hub(CONFIG_FILES)
        if hub is None:
            return {"format": "huggingface", "path": str(Path(self.config.init).resolve())}
        if isinstance(hub, dict):
            return hub
        return {"format": "huggingface", "path": str(hub.path), "repo_id": hub.repo_id,
                "revision": hub.revision}

    def lr(self, step: int) -> float:
        """Learning rate of update ``step`` (1-based): ``schedule(step - 1)``.

        Evaluated by one jitted function on blocks of 4096 steps (compiled once).
        """
        block, i = divmod(step - 1, _LR_BLOCK)
        table = self._lr_blocks.get(block)
        if table is None:
            if self._lr_fn is None:
                self._lr_fn = jax.jit(jax.vmap(self.parts.schedule))
            steps = np.arange(block * _LR_BLOCK, (block + 1) * _LR_BLOCK, dtype=np.int32)
            table = self._lr_blocks[block] = np.asarray(self._lr_fn(steps))
        return float(table[i])

    def _say(self, message: str) -> None:
        if self.primary:
            print(message, file=sys.stderr if self.progress is None else sys.stdout,
                  flush=True)

    def __repr__(self) -> str:
        last = self.history[-1]["loss"] if self.history else math.nan
        return (f"Trainer(run_dir={str(self.run_dir)!r}, step={self.step}/"
                f"{self.config.steps}, loss={last:.4f}, mesh={dict(self.mesh.shape)})")


def _plan_spec(plan: Any) -> Any:
    """The ``ModelSpec`` a factory plan trains: the plan's own spec, or its factory and
    loss wrapped by ``wb.any_model.from_nnx``. The Trainer feeds token batches (``{"inputs",
    "targets"}`` int32 ``(batch, seq)``), so a plan of another batch is refused with the
    supported way: a ``loss_fn`` that makes the model's inputs from the token batch."""
    from workbench.any_model._spec import ModelSpec, from_nnx
    from workbench._step import lm_loss

    tokens = set(plan.abstract_batch) == {"inputs", "targets"} and all(
        len(v.shape) == 2 and np.issubdtype(v.dtype, np.integer)
        for v in plan.abstract_batch.values())
    if not tokens:
        given = ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in plan.abstract_batch.items())
        raise ValueError(
            f"Trainer.from_plan: the plan's batch is {{{given}}}, but the Trainer feeds token "
            "batches {inputs, targets: int32[batch, seq]} from TrainConfig.data; plan the model "
            "with a loss_fn that makes its inputs from the token batch (docs/your_model.md)")
    spec = plan.factory
    if not isinstance(spec, ModelSpec):
        spec = from_nnx(plan.factory, name=plan.name,
                        loss_fn=None if plan.loss_fn is lm_loss else plan.loss_fn)
    if spec.vocab_size is None:
        raise ValueError(f"Trainer.from_plan: model {spec.name!r} has no vocab_size, which the "
                         "Trainer's token data needs; plan wb.any_model.from_nnx(factory, "
                         "vocab_size=..., loss_fn=...) instead of the bare factory")
    return spec


def prediction_record(plan: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``(run.json "prediction", run event)`` for a plan: the plan's prediction and where
    it comes from, or None and a ``prediction`` event saying why there is none.

    Args:
      plan: a ``wb.plan(...)`` Plan, or None (no prediction, no event).

    The record is ``plan.predicted.to_dict()`` (``step_seconds``, ``mfu``,
    ``tokens_per_s``, ``bound``, ``compiler_seconds``, ``sources``, ``breakdown``) plus
    ``source`` and ``source_reason`` (compiler or estimate), ``hardware`` and
    ``plan_name``. A plan without a prediction (a hardware table without the numbers:
    ``plan.report.prediction_error``) never stops the run: the event says why instead.
    """
    if plan is None:
        return None, None
    if not hasattr(type(plan), "predicted"):  # the class: reading it may raise
        raise TypeError(f"prediction= needs a wb.plan(...) Plan, got {type(plan).__name__}; "
                        "use Trainer.from_plan(plan, run_dir)")
    if plan.predicted is None:   # a hardware table without the numbers: said, not raised
        return None, {"recorded": False, "reason": "the plan has no prediction "
                      f"({plan.report.prediction_error})"}
    predicted = plan.predicted.to_dict()
    mesh = plan.mesh
    record = {**predicted, "source": plan.source, "source_reason": plan.source_reason,
              "hardware": getattr(mesh, "hardware", None) or getattr(mesh, "device_kind", None),
              "plan_name": plan.name}
    return runs.json_safe(record), {"recorded": True, "step_seconds": predicted["step_seconds"],
                                    "mfu": predicted["mfu"], "source": plan.source}
