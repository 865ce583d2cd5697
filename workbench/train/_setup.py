"""Before a Trainer runs: the run directory checked against what it is given, then built.

The checks refuse (naming the fix), fork, or accept and record a run directory whose config
(:func:`check_run_dir`), data (:func:`check_data`), checkpoints (a restart from step 0,
:func:`fork_to_start_over`) or retention (:func:`check_keep`) differ from the given ones,
before anything is written; the differences themselves are :mod:`workbench.train._run_diff`.
Then the compile cache, and :func:`build_parts`: mesh, rules, optimizer, abstract sharded
state and the data (:class:`workbench.train._parts.Parts`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from workbench import _runs as runs
from workbench.data import ShardedBatches, batch_keys, cache_root
from workbench.train._compile_cache import check_compile_cache
from workbench.train._config import TrainConfig
from workbench.train._parts import Parts, analytic_flops, device_fp8_peak
from workbench.train._run_diff import DATA_IDENTITY, config_diff, data_diff


class RunConfigMismatch(ValueError):
    """The run directory holds a run of a different experiment."""


def check_run_dir(run_dir: Path, config: TrainConfig, *, fork: bool, force: bool
                  ) -> tuple[Path, Any, dict[str, Any] | None]:
    """Refuses a run directory of another experiment unless forking or forcing.

    Returns:
      ``(run_dir, source, event)``: the directory to use, the checkpoints to start from
      when forking (else None), and an event to log (``fork`` / ``config_changed``).
    """
    if not (run_dir / runs.RUN_JSON).exists():
        return run_dir, None, None
    stored_run = read_stored_run(run_dir)
    recorded = stored_run.get("dtype")
    diff = config_diff(stored_run.get("config") or {}, config,
                       recorded_dtype=recorded.partition(":")[0].strip()
                       if isinstance(recorded, str) and recorded else None)
    if not diff:
        return run_dir, None, None
    changes = {k: [a, b] for k, (a, b) in diff.items()}
    if force:
        return run_dir, None, {"kind": "config_changed", "diff": changes}
    if fork:
        from workbench.train._checkpoint import Checkpoints

        new_dir = run_dir.with_name(f"{run_dir.name}-fork-{config.hash()[:6]}")
        if (new_dir / runs.RUN_JSON).exists():  # the fork exists already: continue it
            return check_run_dir(new_dir, config, fork=False, force=False)
        source = Checkpoints(run_dir / "checkpoints", read_only=True)
        return new_dir, source, {"kind": "fork", "source": str(run_dir.absolute()),
                                 "diff": changes}
    lines = "\n".join(f"  {k}: {a!r} (in {run_dir}) -> {b!r} (given)"
                      for k, (a, b) in diff.items())
    if {"model.dtype", "model_overrides.dtype"} & set(diff):
        lines += ("\n  (dtype 'auto' computes in bfloat16 on GPU and TPU, float32 on CPU: give "
                  "the model the dtype the run computed in to continue it as it was)")
    raise RunConfigMismatch(
        f"run_dir {str(run_dir)!r} holds a run with a different config:\n{lines}\n"
        "Nothing was changed. Use a new run_dir, Trainer(..., fork=True) to start a new run "
        "from its newest checkpoint, or Trainer(..., force=True) to continue it with the "
        "new config.")


class DataChanged(RunConfigMismatch):
    """The run directory was trained on other data (documents or tokenizer) than given now."""


#: ``Trainer(data_changed=...)``: None refuses a resume on changed data, "ok" accepts it.
DATA_CHANGED_CHOICES = (None, "ok")


def check_data_changed(value: Any) -> str | None:
    """``Trainer(data_changed=...)`` checked: None or "ok"."""
    if value not in DATA_CHANGED_CHOICES or isinstance(value, bool):
        raise ValueError(f"Trainer data_changed={value!r}; pass data_changed='ok' to continue "
                         "a run on changed data (recorded in run.json's history), or leave it "
                         "None to have such a resume refused")
    return value


def _trained(run_dir: Path, run: dict[str, Any]) -> bool:
    """Whether the run directory holds training to continue (steps logged or saved)."""
    step = run.get("step")
    if isinstance(step, int) and not isinstance(step, bool) and step > 0:
        return True
    try:
        return any(p.name.isdigit() for p in (run_dir / "checkpoints").iterdir())
    except OSError:
        return False


def check_data(run_dir: Path, config: TrainConfig, info: dict[str, Any], *, fork: bool,
               data_changed: str | None) -> tuple[Path, Any, dict[str, Any] | None]:
    """Refuses to continue a run on other data than it was trained on.

    The data ``run.json`` records (documents' SHA-256, one per file and combined; the
    eval files'; the tokenizer's file hash, fingerprint and vocabulary) is compared with
    ``info``, the data read now. A run with nothing trained yet is not checked.

    Returns:
      ``(run_dir, source, event)``: the run directory (``<run_dir>-fork-<hash>`` when
      forking), the checkpoints a fork starts from (else None) and the event to log
      (``data_changed`` when continuing with ``data_changed="ok"``, ``fork``), kept in
      ``run.json``'s ``history``.

    Raises:
      DataChanged: the data changed, without ``fork`` or ``data_changed="ok"``; the
        message names each file (or the tokenizer) that changed and the fixes. Nothing
        is written.
    """
    if not (run_dir / runs.RUN_JSON).exists():
        return run_dir, None, None
    run = read_stored_run(run_dir)
    lines = data_diff(run.get("data"), info) if _trained(run_dir, run) else []
    if not lines:
        return run_dir, None, None
    stored = run["data"]
    change = {"changes": lines, "before": {k: stored.get(k) for k in DATA_IDENTITY},
              "after": {k: info.get(k) for k in DATA_IDENTITY}}
    if data_changed == "ok":
        return run_dir, None, {"kind": "data_changed", "accepted": "data_changed='ok'",
                               **change}
    if fork:
        from workbench.train._checkpoint import Checkpoints

        key = runs.config_hash({"config": config.hash(), "data": change["after"]})
        new_dir = run_dir.with_name(f"{run_dir.name}-fork-{key[:6]}")
        if (new_dir / runs.RUN_JSON).exists():   # the fork exists already: continue it
            return check_data(new_dir, config, info, fork=False, data_changed=data_changed)
        source = Checkpoints(run_dir / "checkpoints", read_only=True)
        return new_dir, source, {"kind": "fork", "source": str(run_dir.absolute()),
                                 "data": change}
    listed = "\n".join(f"  {line}" for line in lines)
    raise DataChanged(
        f"run_dir {str(run_dir)!r} was trained on other data than it is given now:\n"
        f"{listed}\nNothing was changed. Continuing would train the run's checkpoints on "
        "other data under the same name. Use a new run_dir, Trainer(..., fork=True) to start "
        "a new run from its newest checkpoint on this data, or Trainer(..., "
        "data_changed='ok') to continue this run on it (recorded in run.json's history; "
        "for a launched job wb.launch(..., data_changed='ok'), on the command line "
        "`workbench train --data-changed ok`).")


#: ``Trainer(restart=...)``: None refuses to start over a run whose trained steps no
#: checkpoint restores; "ok" starts it again from step 0 as a new attempt.
RESTART_CHOICES = (None, "ok")


def check_restart(value: Any) -> str | None:
    """``Trainer(restart=...)`` checked: None or "ok"."""
    if not (value is None or (isinstance(value, str) and value == "ok")):
        raise ValueError(f"Trainer restart={value!r:.80}; pass restart='ok' to start a run "
                         "whose checkpoints are gone again from step 0 (a new attempt, "
                         "recorded in run.json's history), or leave it None to have that "
                         "refused")
    return value


def recorded_steps(run_dir: Path) -> tuple[int, int, int]:
    """``(last step, attempt, last saved step)`` the run directory records as trained: the
    newest attempt of ``run.json`` (``attempt``, 1 when absent) and of ``metrics.jsonl``'s
    lines, the last step either records for it, and the last step whose record says a
    checkpoint was saved (``ckpt_time`` > 0; without records, the last multiple of
    ``checkpoint_every`` reached); ``(0, 1, 0)`` for a new run directory."""
    run: dict[str, Any] = {}
    if os.path.lexists(run_dir / runs.RUN_JSON):
        run = read_stored_run(run_dir)
    attempt = run.get("attempt")
    attempt = attempt if isinstance(attempt, int) and not isinstance(attempt, bool) \
        and attempt >= 1 else 1
    tail = runs.MetricsTail(run_dir)
    records, _ = tail.poll()
    if tail.attempt > attempt and not records:   # a restart began, no step of it yet
        return 0, tail.attempt, 0
    if tail.attempt < attempt or not records:   # run.json alone knows the newest attempt
        step = run.get("step") or 0
        config = run.get("config")
        every = config.get("checkpoint_every") if isinstance(config, dict) else None
        every = every if isinstance(every, int) and not isinstance(every, bool) \
            and every > 0 else 0
        return step, attempt, step - step % every if every else 0
    saved = [r["step"] for r in records if isinstance(r.get("ckpt_time"), (int, float))
             and not isinstance(r.get("ckpt_time"), bool) and r["ckpt_time"] > 0]
    step = max(tail.last_step or 0, run.get("step") or 0 if attempt == tail.attempt else 0)
    return step, tail.attempt, max(saved, default=0)


#: Points of an ended attempt's loss curve kept in its ``restart`` history entry.
CURVE_POINTS = 256


def attempt_curve(run_dir: Path, attempt: int) -> dict[str, Any]:
    """An attempt's loss curve as its ``restart`` entry in ``run.json``'s history keeps it
    (``{"attempt", "step", "loss"}``, at most ``CURVE_POINTS`` evenly strided points, the
    last one kept), so the lab panel draws the ended attempt beside the new one."""
    records = runs.read_attempts(run_dir).get(attempt, []) \
        if os.path.lexists(run_dir / runs.METRICS) else []
    stride = max(1, -(-len(records) // CURVE_POINTS))
    kept = records[::stride]
    if records and kept[-1] is not records[-1]:
        kept.append(records[-1])
    return {"attempt": attempt, "step": [r["step"] for r in kept],
            "loss": [r.get("loss") for r in kept]}


def missing_checkpoints(directory: Path) -> str:
    """What the checkpoint directory lacks, in words (for a refusal to start over)."""
    try:
        entries = sorted(os.listdir(directory))
    except FileNotFoundError:
        return f"{directory} does not exist (deleted?)"
    except NotADirectoryError:
        return f"{directory} is a file, not a folder"
    except OSError as e:
        return f"{directory} cannot be read ({e.strerror or e})"
    unfinished = [e for e in entries if ".orbax-checkpoint-tmp" in e]
    if unfinished and len(unfinished) == len(entries):
        return (f"{directory} holds only the unfinished save {unfinished[0]} (the process "
                "died while saving its first checkpoint)")
    if not entries:
        return f"{directory} is empty (its checkpoints were deleted?)"
    shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
    return f"{directory} holds no checkpoint step ({shown})"


def start_over_refused(run_dir: Path, config: TrainConfig, step: int, attempt: int,
                       saved: int, missing: str) -> str:
    """The refusal to start a run with trained steps again from step 0: what is recorded,
    what is missing, and the three ways on."""
    fork = run_dir.with_name(f"{run_dir.name}-fork-{config.hash()[:6]}")
    what = (f"records {step} trained step(s) (last step {step}"
            f"{f' of attempt {attempt}' if attempt > 1 else ''}, in {runs.RUN_JSON} / "
            f"{runs.METRICS}, step {saved} saved), but no checkpoint restores them"
            if step else
            "has no checkpoint to continue from")
    return (
        f"run_dir {str(run_dir)!r} {what}: {missing}. Starting from "
        "step 0 here would mix a new run into this run's history. Nothing was changed. Use "
        f"a new run_dir, Trainer(..., fork=True) to start a new run in {str(fork)!r}, or "
        f"Trainer(..., restart='ok') to start this run again from step 0 as attempt "
        f"{attempt + 1} (recorded in run.json's history; the steps of attempt {attempt} stay "
        f"in {runs.METRICS})")


def fork_to_start_over(run_dir: Path, config: TrainConfig, *, fork: bool
                       ) -> tuple[Path, dict[str, Any] | None]:
    """With ``fork``: a run directory whose trained steps no checkpoint restores is left
    as it is and ``<run_dir>-fork-<hash>`` starts from step 0 (an existing one continues).

    Returns:
      ``(run_dir, event)``: the directory to train in and the ``fork`` event to log.
    """
    if not fork or _has_steps(run_dir / "checkpoints") or \
            recorded_steps(run_dir)[2] == 0:
        return run_dir, None
    new_dir = run_dir.with_name(f"{run_dir.name}-fork-{config.hash()[:6]}")
    if os.path.lexists(new_dir / runs.RUN_JSON):   # the fork exists already: continue it
        return new_dir, None
    return new_dir, {"kind": "fork", "source": str(run_dir.absolute()),
                     "start_over": missing_checkpoints(run_dir / "checkpoints")}


def _has_steps(directory: Path) -> bool:
    """Whether a checkpoint directory holds a step (or a step moved aside as corrupt)."""
    try:
        if any(p.name.isdigit() for p in directory.iterdir()):
            return True
        return any(True for _ in (directory / "corrupt").iterdir())
    except OSError:
        return False


def read_stored_run(run_dir: Path) -> dict[str, Any]:
    """The ``run.json`` a resumed run continues, checked where the Trainer relies on it.

    Raises:
      runs.RunFileError: it cannot be read (binary, empty, not an object, a directory, too
        deep: see ``runs.read_run``) or its ``step`` is not a whole number >= 0; the
        message names the file and the fix.
    """
    run = runs.read_run(run_dir)
    step = run.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        path = run_dir / runs.RUN_JSON
        raise runs.RunFileError(
            f"{path} has step={step!r}, not a whole number >= 0: it was edited or damaged. "
            f"Move it aside (e.g. to {runs.RUN_JSON}.bad) or delete it; the run resumes from "
            "its checkpoints and writes a new one (metrics.jsonl and checkpoints are kept)")
    return run


def check_keep(checkpoints: Any, run_dir: Path, keep: int, *, force: bool) -> str | None:
    """Refuses a lower ``keep`` that would delete existing checkpoints at the next save.

    Orbax keeps the newest ``keep`` checkpoints and deletes older ones after each save;
    continuing a run saved with ``keep=3`` with ``keep=1`` would silently delete two.
    Only a lowered ``keep`` (below the one in ``run.json``) is checked, so the extra
    checkpoint a crash between a save and its clean-up leaves behind is no reason to refuse.

    Returns:
      With ``force``: a message naming the checkpoints the next save deletes (else None).

    Raises:
      RunConfigMismatch: ``keep`` was lowered and checkpoints would go, without ``force``.
    """
    try:
        stored = read_stored_run(run_dir).get("config") or {}
    except (OSError, ValueError):
        return None
    old = stored.get("keep") if isinstance(stored, dict) else None
    if isinstance(old, bool) or not isinstance(old, int) or keep >= old:
        return None
    steps = checkpoints.all_steps()
    if len(steps) <= keep:
        return None
    gone, kept = steps[:len(steps) - keep], steps[len(steps) - keep:]
    names = ", ".join(str(s) for s in gone)
    if force:
        return (f"keep lowered from {old} to {keep} (force=True): the next save deletes "
                f"checkpoint step(s) {names} in {checkpoints.directory}")
    raise RunConfigMismatch(
        f"keep={keep} is lower than the keep={old} run_dir {str(run_dir)!r} was trained with: "
        f"the next save would delete checkpoint step(s) {names} (keeping "
        f"{', '.join(str(s) for s in kept)}). Nothing was deleted. Pass keep={old} (or "
        f"more) to keep them, copy them elsewhere first, or pass Trainer(..., force=True) "
        "to let the next save delete them.")


def enable_compile_cache(setting: bool | str | os.PathLike[str]) -> str | None:
    """Turns on JAX's persistent compilation cache so a restarted kernel skips XLA compiles.

    True uses the configured ``jax_compilation_cache_dir`` or ``~/.cache/workbench/
    jax-compile``; when Workbench picks the directory it also caches every compile
    (``jax_persistent_cache_min_compile_time_secs=0``), since CPU compiles are short.
    """
    if setting is False:
        return None
    current = jax.config.jax_compilation_cache_dir
    if setting is True and current:
        check_compile_cache(current)
        return str(current)
    path = str(cache_root() / "jax-compile") if setting is True else os.fspath(setting)
    check_compile_cache(path)   # no pipe, link or directory where JAX reads an entry
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def build_parts(config: TrainConfig, *, data_cache: str | os.PathLike[str] | None = None
                ) -> Parts:
    """Mesh, rules, optimizer, abstract sharded state, step shardings and the data: the
    step's inputs by the resolver ``wb.plan`` uses too (``planning._step_inputs``), so the
    Trainer runs the step a plan of the same model compiles."""
    from workbench.hardware import peak_flops
    from workbench.planning._step_inputs import resolve_step
    from workbench._train_state import abstract_state, batch_shardings

    inputs = resolve_step(config.model_config(), mesh=dict(config.mesh), rules=config.rules,
                          batch=config.batch, seq=config.seq, optimizer=config.optimizer,
                          steps=config.steps, where="TrainConfig", pipeline=config.pipeline)
    mesh, rules, model_config = inputs.info.jax_mesh, inputs.rules, inputs.model
    graphdef, abstract = abstract_state(model_config, inputs.optimizer, rules, mesh)
    bsh = batch_shardings(rules, mesh, keys=batch_keys(config.data))
    abstract_batch = {k: jax.ShapeDtypeStruct((inputs.micro_batch, config.seq), jnp.int32,
                                              sharding=s) for k, s in bsh.items()}
    data = ShardedBatches(config.data, seq=config.seq, batch=inputs.micro_batch,
                          seed=config.seed, sharding=bsh["inputs"],
                          vocab_size=model_config.vocab_size, cache_dir=data_cache)
    # the held-out batches, read (and checked: enough rows?) before anything is written
    eval_data = data.eval_batches(config.eval_batches) if config.eval_every else []
    device = mesh.devices.flat[0]
    peak, source = peak_flops(device)
    return Parts(
        mesh=mesh, rules=rules, model_config=model_config, tx=inputs.optimizer,
        schedule=inputs.schedule, graphdef=graphdef, abstract_state=abstract,
        shardings=jax.tree.map(lambda a: a.sharding, abstract), batch_shardings=bsh,
        abstract_batch=abstract_batch, data=data, initial_data_state=data.get_state(),
        eval_data=eval_data,
        model_flops=analytic_flops(model_config, config.batch, config.seq),
        peak=peak, peak_source=source, device_kind=device.device_kind,
        n_devices=mesh.devices.size, attention=inputs.attention,
        fp8_peak=device_fp8_peak(model_config, device.device_kind),
        compile_options=inputs.compile_options, dtype=inputs.dtype,
        placement={"preset": inputs.placement.preset, "why": inputs.placement.why})


