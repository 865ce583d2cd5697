"""Profiles of real train steps: a ``jax.profiler`` trace of N steady-state steps, read
and lined up against the plan's prediction (``trainer.profile(steps=3)``,
``wb.profile_step(plan)``).

The trace is what ``jax.profiler.start_trace`` writes (``plugins/profile/<time>/
<host>.xplane.pb``), so XProf opens it: ``xprof --logdir <run_dir>/profiles`` (the
``xprof`` package: the same viewer as TensorBoard's profile plugin, standalone, without
TensorFlow). Errors come before anything is traced or written: a step count that is not a
positive int or is over :data:`MAX_STEPS`, a directory that cannot be written, a trace
already running in this process.
"""
from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from workbench._validate import check_int, check_path
from workbench.perf._shared_cores import host_cores
from workbench.train._host_load import HostLoad, available_cores, shared_cores

__all__ = ["MAX_STEPS", "ProfileError", "capture", "check_directory", "check_idle",
           "profile_step"]

#: More steps make a trace of hundreds of MB that XProf loads slowly; a few steady-state
#: steps say where the time goes.
MAX_STEPS = 50
#: Warm-up steps run untraced before the traced ones and as many after: a few reach the
#: steady state, and a huge count only makes the call run for hours.
MAX_WARMUP = 1000
_ACTIVE: list[str] = []   # the directory of the trace this process is capturing


class ProfileError(RuntimeError):
    """A profile cannot be taken now (another one runs, the run cannot train)."""


def check_steps(steps: Any, warmup: Any, where: str) -> tuple[int, int]:
    """``(steps, warmup)`` checked: 1..MAX_STEPS profiled steps, 0.. warm-up steps."""
    steps = check_int(steps, "steps", where=where, maximum=MAX_STEPS,
                      fix=f"profile a few steady-state steps, e.g. steps=3 (at most "
                          f"{MAX_STEPS}: a trace grows with every op of every step)")
    warmup = check_int(warmup, "warmup", minimum=0, maximum=MAX_WARMUP, where=where,
                       fix="warmup is how many steps run untraced first (and after), e.g. "
                           f"warmup=3; at most {MAX_WARMUP}: a few reach the steady state")
    return steps, warmup


def check_directory(directory: Path) -> Path:
    """``directory`` if a trace can be written there, creating nothing: its nearest
    existing parent must be a writable directory and it must not hold a trace already."""
    directory = Path(directory)
    parent = directory
    try:
        while not parent.exists():
            parent = parent.parent
    except PermissionError as e:   # a folder on the way that this user may not enter
        raise PermissionError(f"cannot write a profile into {directory}: {e.filename} cannot "
                              f"be reached ({e.strerror}); pass directory= a folder you can "
                              "write to, or fix its permissions") from None
    if not parent.is_dir():
        raise NotADirectoryError(f"cannot write a profile into {directory}: {parent} is a "
                                 "file; pass directory= a folder path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write a profile into {directory}: {parent} is not "
                              "writable; pass directory= a writable folder, or fix its "
                              "permissions")
    if directory.exists() and any(directory.glob("plugins/profile/*/*.xplane.pb")):
        raise FileExistsError(f"{directory} already holds a trace; pass another directory= "
                              "(traces are never overwritten)")
    return directory


def free_directory(base: Path) -> Path:
    """``base``, or ``base-2``, ``base-3``... the first that holds no trace yet and is
    free to write: absent, or a real folder (not a symlink) whose ``report.json``, if
    any, is a regular file (a link or pipe there is skipped, never written through)."""
    candidate, k = base, 1
    while not _writable(candidate) or any(candidate.glob("plugins/profile/*/*.xplane.pb")):
        k += 1
        candidate = base.with_name(f"{base.name}-{k}")
    return candidate


def _writable(folder: Path) -> bool:
    if not os.path.lexists(folder):
        return True
    if folder.is_symlink() or not folder.is_dir():
        return False
    report = folder / "report.json"
    return not os.path.lexists(report) or stat.S_ISREG(os.lstat(report).st_mode)


def check_idle() -> None:
    """Raises ProfileError when a trace already runs in this process (one of ours, or one
    the user started with ``jax.profiler.start_trace``): checked before any step runs,
    and again by ``jax.profiler.start_trace`` itself."""
    if _ACTIVE:
        raise ProfileError(f"a profile is already being captured (into {_ACTIVE[0]}); one "
                           "jax.profiler trace runs at a time per process: wait for it to "
                           "finish, then profile again")
    from jax._src import profiler as _profiler  # its one record of the running session

    state = getattr(_profiler, "_profile_state", None)
    # JAX 0.11 keeps the running session in .profile_session (its folder in .log_dir);
    # JAX 0.12 in .session, a ProfileSession that holds its own .log_dir
    session = getattr(state, "session", None) or getattr(state, "profile_session", None)
    if session is not None:
        where = getattr(session, "log_dir", None) or getattr(state, "log_dir", "?")
        raise ProfileError(
            f"a jax.profiler trace is already running in this process (into "
            f"{where}, started with jax.profiler.start_trace or "
            "jax.profiler.trace); stop it with jax.profiler.stop_trace() and profile again")


@contextlib.contextmanager
def capture(directory: Path) -> Iterator[Path]:
    """A ``jax.profiler`` trace of the block into ``directory`` (one at a time)."""
    check_idle()
    directory = check_directory(directory)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        jax.profiler.start_trace(str(directory))
    except RuntimeError as err:
        raise ProfileError(
            "a jax.profiler trace is already running in this process (started with "
            "jax.profiler.start_trace or jax.profiler.trace); stop it with "
            f"jax.profiler.stop_trace() and profile again ({err})") from err
    _ACTIVE.append(str(directory))
    try:
        yield directory
    finally:
        _ACTIVE.clear()
        jax.profiler.stop_trace()


def _tokens_batch(plan: Any, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    vocab = getattr(plan.cfg, "vocab_size", None) or 256
    out = {}
    for k, v in plan.abstract_batch.items():   # the same tokens in every process
        toks = rng.integers(0, vocab, v.shape, dtype=np.int32)
        out[k] = jax.make_array_from_callback(toks.shape, plan.batch_shardings[k],
                                              lambda idx, t=toks: t[idx])
    return out


def profile_step(plan: Any, *, steps: int = 3, warmup: int = 2, directory: Any = None,
                 seed: int = 0) -> Any:
    """Profile a plan's own compiled step on its real devices (random tokens, state from
    ``seed``), and line it up against the plan's prediction from the hardware table
    (``plan.predict(calibration=False)``: what ``wb.calibrate`` corrects).

    Args:
      plan: a ``wb.plan(...)`` compiled on ``wb.make_mesh(...)`` devices.
      steps: steps traced (1..``MAX_STEPS``); warmup: untraced steps before the traced
        ones, and as many after: their median tokens/s (all but the very first step) is
        the "outside" throughput the profiler's overhead is measured against.
      directory: where the trace goes (default ``profiles/<plan name>-<time>``).
      seed: the parameters' and tokens' seed.

    Returns:
      A ``workbench.perf._profile.ProfileReport``.
    """
    from workbench.perf._profile import profile_report
    from workbench.perf._trace import read_trace

    steps, warmup = check_steps(steps, warmup, "profile_step: ")
    seed = check_int(seed, "seed", minimum=0, maximum=2**32 - 1, where="profile_step: ")
    if directory is not None:
        check_path(directory, "directory", where="profile_step: ")
    _check_runnable(plan)
    directory = check_directory(Path(directory) if directory is not None else Path(
        "profiles") / f"{plan.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    check_idle()
    cores = shared_cores()
    step = plan.compiled
    times, load = _timed_steps(step, plan.init_state(seed), _tokens_batch(plan, seed),
                               steps, warmup, directory)
    tokens = plan.report.batch * plan.report.seq
    measured = read_trace(directory, hlo_text=step.as_text(), axis_names=plan.mesh.axis_names,
                          axis_sizes=plan.mesh.axis_sizes, cores=cores,
                          available=available_cores(host_cores(), cores, load), steps=steps)
    tps = {k: tokens / float(np.median(v)) for k, v in times.items() if v}
    report = profile_report(plan.predict(calibration=False), measured, plan_name=plan.name,
                            mesh=dict(plan.mesh.shape), device_kind=_kind(plan.mesh),
                            processes=jax.process_count(), tokens_per_s=tps)
    write_report(report)
    return report


def _check_runnable(plan: Any) -> None:
    """Refuses a plan ``profile_step`` cannot run: not a Plan, not compiled for devices at
    hand, or a step that does not take token batches."""
    from workbench.planning import Plan

    if not isinstance(plan, Plan):
        raise TypeError(f"profile_step: plan={plan!r} is a {type(plan).__name__}; give what "
                        "wb.plan(cfg, mesh=wb.make_mesh(...), ...) returns")
    if plan.compiled is None or plan.mesh.jax_mesh is None:
        raise ProfileError(f"plan {plan.name!r} is on {plan.mesh.describe()} and was not "
                           "compiled for devices at hand: there is no step to run. Plan on "
                           "wb.make_mesh(...) to profile it, or profile a running Trainer")
    if not isinstance(plan.abstract_batch, dict) or set(plan.abstract_batch) != {"inputs",
                                                                               "targets"}:
        raise ProfileError("profile_step feeds token batches {inputs, targets}; profile a "
                           "factory model's step through a Trainer (trainer.profile())")


def _timed_steps(step: Any, state: Any, batch: Any, steps: int, warmup: int,
                 directory: Path) -> tuple[dict[str, list[float]], HostLoad]:
    """Runs ``warmup`` untraced steps, ``steps`` traced into ``directory``, and ``warmup``
    untraced again: each step's seconds (``"outside"``: the untraced ones but the very
    first, ``"during"``: the traced), and the host's load while the trace ran."""
    times: dict[str, list[float]] = {"outside": [], "during": []}

    def run(n: int, label: str) -> None:
        nonlocal state
        for _ in range(n):
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times[label].append(time.perf_counter() - t0)

    run(warmup, "outside")
    with capture(directory), HostLoad() as load:
        run(steps, "during")
    # as many untraced steps after the trace: the steps right after a compile (or a
    # first call) run slower for a while, so untraced steps only before the trace made the
    # traced ones look faster (bench_profile read 1.06-1.38x); the first step is left out
    run(warmup, "outside")
    times["outside"] = times["outside"][1:]
    return times, load


def _kind(info: Any) -> str:
    """The hardware entry's name for a mesh's devices (the calibration's key)."""
    from workbench.hardware import cpu_spec, hardware_spec

    if info.platform == "cpu":
        return cpu_spec(info.size).name
    spec = hardware_spec(info.device_kind)
    return spec.name if spec is not None else info.device_kind


def write_report(report: Any) -> Path:
    """``report.json`` beside the trace (the rows, the verdict, the top ops)."""
    from workbench import _runs as runs

    path = Path(report.directory) / "report.json"
    if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
        raise ProfileError(f"{path} exists and is not a regular file (a link, pipe or "
                           "folder); it is never written through or replaced: move it away, "
                           "or profile into another directory")
    # a temporary file of its own, renamed over: readers never see half a report
    fd, tmp = tempfile.mkstemp(prefix=".report.json.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(runs.json_safe(report.to_dict()), indent=1))
        os.chmod(tmp, 0o644)   # readable like the trace beside it (mkstemp's is 0600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def profile_trainer(trainer: Any, *, steps: int = 3, warmup: int = 3, plan: Any = None,
                    directory: Any = None) -> Any:
    """:meth:`workbench.train._trainer.Trainer.profile`: ``warmup`` untraced steps, then
    ``steps`` traced ones, both trained and recorded as usual; the trace into
    ``run_dir/profiles/<first traced step>``; the report beside it."""
    from workbench.perf._profile import profile_report
    from workbench.perf._trace import read_trace

    steps, warmup = check_steps(steps, warmup, "Trainer.profile: ")
    if getattr(trainer, "_closed", False):
        raise ProfileError(f"this Trainer of {trainer.run_dir} was closed (trainer.close()): "
                           "it cannot train, so there is nothing to profile; make a new "
                           f"wb.Trainer(config, {str(trainer.run_dir)!r}) and profile that")
    start = trainer.step + warmup
    directory = check_directory(Path(directory) if directory is not None else
                                free_directory(trainer.run_dir / "profiles" / str(start + 1)))
    check_idle()
    plan = plan if plan is not None else trainer_plan(trainer)
    _check_plan(plan, trainer)
    prediction = plan.predict(calibration=False)
    cores = shared_cores()
    with trainer._writing():   # refused at once when another writer holds the run directory
        if warmup:
            _finished(trainer.run(steps=trainer.step + warmup), directory)
        first = trainer.step
        with capture(directory), HostLoad() as load:
            result = trainer.run(steps=first + steps)
        _finished(result, directory)
    mesh = trainer.mesh
    # one execution of the step program (a micro-batch with gradient accumulation) is
    # what the plan predicts
    measured = read_trace(directory, hlo_text=trainer.compiled_step().as_text(),
                          axis_names=tuple(mesh.axis_names),
                          axis_sizes=tuple(int(s) for s in mesh.devices.shape), cores=cores,
                          available=available_cores(host_cores(), cores, load),
                          steps=steps * trainer.config.optimizer.accumulate)
    tps = _throughput(trainer.history, first, warmup, steps, trainer.config.tokens_per_step)
    from workbench._sharding.mesh import mesh_info

    report = profile_report(prediction, measured, plan_name=plan.name,
                            mesh={k: int(v) for k, v in mesh.shape.items()},
                            device_kind=_kind(mesh_info(mesh)),
                            processes=jax.process_count(), tokens_per_s=tps)
    write_report(report)
    return report


def _check_plan(plan: Any, trainer: Any) -> None:
    """The plan must be of the trainer's step: the same mesh, micro-batch and sequence."""
    cfg = trainer.config
    have = (dict(plan.mesh.shape), plan.report.batch, plan.report.seq)
    want = ({k: int(v) for k, v in trainer.mesh.shape.items()}, cfg.micro_batch, cfg.seq)
    if have != want:
        raise ValueError(f"Trainer.profile: plan={plan.name!r} is for mesh {have[0]}, batch "
                         f"{have[1]}, seq {have[2]}, but this Trainer runs mesh {want[0]}, "
                         f"batch {want[1]} (per step program), seq {want[2]}; pass the plan "
                         "of this config, or leave plan= out to plan it")


def _finished(result: Any, directory: Path) -> None:
    """Stops the profile when the steps were interrupted (Ctrl-C, SIGTERM): the run kept
    its checkpoint; the trace so far stays in ``directory``."""
    if result.status != "finished":
        raise ProfileError(f"the profiled steps were {result.status} at step {result.step} "
                           f"({result.message}); nothing was compared. The trace so far is "
                           f"in {directory}; profile again to compare")


def _throughput(history: list[dict[str, Any]], first: int, warmup: int, steps: int,
                tokens: int) -> dict[str, float]:
    """Median tokens/s of the untraced and of the traced steps, each taken from the middle
    of its ``run`` call: the first step of a call starts the pipeline and the last one
    saves a checkpoint (every call saves at its target); where a call has no middle step,
    its last one without its checkpoint time."""
    recs = {r["step"]: r for r in history}

    def rate(lo: int, hi: int) -> float | None:
        mid = [s for s in range(lo + 1, hi) if s in recs] or [s for s in (hi,) if s in recs]
        t = [recs[s]["step_time"] - recs[s].get("ckpt_time", 0.0) for s in mid]
        return tokens / float(np.median(t)) if t else None

    out = {"outside": rate(first - warmup + 1, first) if warmup else None,
           "during": rate(first + 1, first + steps)}
    return {k: v for k, v in out.items() if v}


def trainer_plan(trainer: Any) -> Any:
    """The plan of a Trainer's config: the one it was made from (``Trainer.from_plan``),
    else ``wb.plan`` of its model config, mesh, rules, batch and sequence."""
    given = getattr(trainer, "_plan", None)
    if given is not None:
        return given
    from workbench.planning._planner import plan

    cfg = trainer.config
    return plan(trainer.parts.model_config, mesh=trainer.mesh, rules=trainer.rules,
                batch=cfg.micro_batch, seq=cfg.seq, optimizer=trainer.parts.tx,
                pipeline=cfg.pipeline, progress=False, name=str(cfg.rules)
                if isinstance(cfg.rules, str) else
                trainer.parts.placement.get("preset") or "trainer")
