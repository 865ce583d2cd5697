"""What one worker process of a job runs: ``train`` (the Trainer) and ``run_ping`` (collectives),
and the worker subcommands a launch asks for (``train_command``, ``ping_command``).

Both start with :func:`workbench.jobs._cluster.initialize`, so the same code runs as a
loopback process of :func:`workbench.jobs`, an ``srun`` task, or one worker of a TPU
pod. Exit codes tell the launcher what happened: 0 reached the target, ``EXIT_STOPPED``
stopped early after a checkpoint (SIGTERM / preemption), anything else failed.
"""
from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from workbench.jobs import _cluster as cluster

__all__ = ["EXIT_STOPPED", "ConfigRejected", "export", "load_config", "ping_command",
           "record_exit", "run_ping", "train", "train_command"]

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped before the target with a checkpoint; relaunch continues
EXIT_FILE_ENV = "WORKBENCH_EXIT_FILE"  # where a launched worker records its exit code
#: The folder holding the ``workbench`` package, put on a worker's PYTHONPATH so that the
#: workers import the same workbench as the launcher, installed or not.
IMPORT_ROOT = str(Path(__file__).resolve().parents[2])


class ConfigRejected(ValueError):
    """The config, or the run directory, was refused before training began: the
    ``ValueError`` or ``TypeError`` of ``load_config`` or of the ``Trainer``'s checks,
    with its message (the original is the ``__cause__``)."""


def record_exit(code: int) -> None:
    """Writes this worker's exit code where the launcher asked (for ``attach``)."""
    path = os.environ.get(EXIT_FILE_ENV)
    if path:
        try:
            with open(path, "w", encoding="ascii") as f:
                f.write(f"{code}\n")
        except OSError:
            pass


def _say(msg: str) -> None:
    print(f"[workbench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_config(path: str | os.PathLike[str]) -> Any:
    """Reads a ``TrainConfig`` from ``CONFIG.json`` or from ``CONFIG.py``.

    A Python file must define ``config`` (a ``TrainConfig`` or a dict of its fields),
    or a function ``config()`` returning one.
    """
    from workbench.train import TrainConfig

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {p} does not exist; pass CONFIG.json (as written "
                                "by TrainConfig.to_json()) or CONFIG.py defining `config`")
    if p.suffix == ".json":
        return TrainConfig.from_json(p.read_text(encoding="utf-8"))
    if p.suffix != ".py":
        raise ValueError(f"config file {p} must end in .json or .py, not {p.suffix!r}")
    ns = runpy.run_path(str(p), run_name="__workbench_config__")
    if "config" not in ns:
        raise ValueError(f"{p} defines no `config`; add e.g. `config = wb.TrainConfig(...)`")
    cfg = ns["config"]() if callable(ns["config"]) and not isinstance(ns["config"], type) \
        else ns["config"]
    if isinstance(cfg, dict):
        cfg = TrainConfig.from_json(json.dumps(cfg))
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"`config` in {p} is a {type(cfg).__name__}, expected a TrainConfig "
                        "or a dict of its fields")
    return cfg


def _joined(spec: cluster.DistributedSpec) -> None:
    how = cluster.initialize(spec, on_timeout=record_exit)
    import jax

    _say(f"process {jax.process_index()} of {jax.process_count()} joined ({how}): "
         f"{jax.local_device_count()} local / {jax.device_count()} global "
         f"{jax.devices()[0].platform} devices, pid {os.getpid()}")


def train(config_path: str | os.PathLike[str], run_dir: str | os.PathLike[str],
          spec: cluster.DistributedSpec, *, steps: int | None = None,
          data_changed: str | None = None, restart: str | None = None) -> int:
    """Joins the job, then trains ``config`` in ``run_dir`` (resuming from its checkpoint;
    ``data_changed="ok"``: also when the data differs from what the run recorded, as
    ``wb.Trainer(data_changed="ok")``; ``restart="ok"``: a new attempt where no checkpoint
    restores the steps the run recorded, as ``wb.Trainer(restart="ok")``).

    Returns:
      The exit code: 0 when the run reached its target, ``EXIT_STOPPED`` when SIGTERM
      (or a preemption notice) stopped it after a checkpoint.
    """
    _joined(spec)
    try:
        trainer = _trainer(config_path, Path(run_dir), data_changed=data_changed,
                           restart=restart)
        try:
            result = trainer.run(steps=steps)
        finally:
            trainer.close()
    except BaseException:
        _exit_now_if_distributed()
        raise
    if result.step >= result.target:
        _say(f"finished: step {result.step} of {result.target}")
        return 0
    _say(f"stopped at step {result.step} of {result.target} with a checkpoint; "
         "launch again into the same run directory to continue")
    return EXIT_STOPPED


def export(run_dir: str | os.PathLike[str], out: str | os.PathLike[str],
           spec: cluster.DistributedSpec, *, step: int | None = None,
           dtype: str | None = None, overwrite: bool = False) -> int:
    """Joins the job, then writes the run's checkpoint as a Hugging Face folder
    (``wb.hf.export_run``: each process restores its shards, process 0 writes;
    ``overwrite`` replaces only a folder an earlier export wrote).

    Returns:
      0 once the folder is complete.
    """
    _joined(spec)
    from workbench.hf._export import export_run

    try:
        path = export_run(run_dir, out, step=step, dtype=dtype, overwrite=overwrite)
    except BaseException:
        _exit_now_if_distributed()
        raise
    _say(f"exported {run_dir} to {path}")
    return 0


def _trainer(config_path: str | os.PathLike[str], run_dir: Path, *,
             data_changed: str | None = None, restart: str | None = None) -> Any:
    """The ``Trainer`` of ``config_path`` in ``run_dir``.

    Raises:
      ConfigRejected: reading the config or the Trainer's checks raised a ``ValueError``
        or ``TypeError`` (a batch that does not divide over the mesh, a run directory
        holding another config, ...). Errors of training itself are not wrapped.
    """
    from workbench.train import Trainer

    try:
        config = load_config(config_path)
        # The Trainer of process 0 locks the run directory while it writes (workbench.jobs.
        # lock), unless the local launcher holds the lock for this job already.
        return Trainer(config, run_dir=run_dir, compile_cache=_compile_cache(),
                       data_changed=data_changed, restart=restart)
    except (ValueError, TypeError) as err:
        raise ConfigRejected(str(err)) from err


def train_args(steps: int | None, data_changed: str | None = None,
               restart: str | None = None) -> list[str]:
    """The ``workbench train`` options a launch passes to every worker."""
    return ([] if steps is None else ["--steps", str(steps)]) + (
        [] if data_changed is None else ["--data-changed", str(data_changed)]) + (
        [] if restart is None else ["--restart", str(restart)])


def train_command(run_dir: Path) -> tuple[str, ...]:
    """The worker subcommand of a training job (after ``python -m workbench``): train
    ``<run_dir>/config.json`` into ``run_dir`` (:func:`train_args` gives its options)."""
    return ("train", "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir))


def ping_command(hold: float = 0.0) -> tuple[str, ...]:
    """The worker subcommand of a ping job (:func:`run_ping`)."""
    return ("ping", "--hold", str(hold))


#: What leaving each consent out does, and what "ok" does (``wb.Trainer``'s own values).
_CONSENTS = {
    "data_changed": "leave it out (a resume on changed data is refused) or pass "
                    "data_changed='ok' to continue this run on the data as it is now",
    "restart": "leave it out (a run whose recorded steps no checkpoint restores is refused) "
               "or pass restart='ok' to start a new attempt, recorded in run.json's history",
}


def check_consent(name: str, value: Any, where: str) -> str | None:
    """``data_changed`` / ``restart``: None or "ok" (``wb.Trainer``'s own values)."""
    if value is None or (isinstance(value, str) and value == "ok"):
        return value
    raise (ValueError if isinstance(value, str) else TypeError)(
        f"{where}{name}={value!r}: {_CONSENTS[name]}")


def _compile_cache() -> bool:
    """Whether to use JAX's persistent compilation cache in this worker.

    Not across CPU processes: JAX writes cache entries from process 0 only, and the
    other processes' keys differ, so process 0 would skip its compiles while the others
    compile for tens of seconds, and gloo gives up on a collective whose peers arrive
    more than 30 s apart ("Gloo context initialization failed: GetKeyValue() timed
    out"). With no cache every process compiles, and they reach step 1 together.
    JAX's ``jax_share_binary_between_hosts`` (process 0 compiles, the others read its
    executable from the coordinator) does not help on CPU. It needs the cache, and it
    publishes the executable under process 0's key. Another process waits under its own key,
    which differs (checked with jax 0.10.2: every key of a 2 x 4 gloo job differed, the
    global step's included), so that process would wait until the share times out.
    """
    import jax

    if jax.process_count() > 1 and jax.devices()[0].platform == "cpu":
        jax.config.update("jax_enable_compilation_cache", False)
        return False
    return True


def _exit_now_if_distributed() -> None:
    """After an error in a multi-process job: print it and exit at once.

    A normal exit would wait in ``jax.distributed``'s shutdown barrier for the other
    processes, which are blocked in a collective waiting for this one; exiting at once
    lets the launcher (or the others' heartbeat check) end the job within seconds.
    Committed checkpoints are complete (Orbax commits atomically).
    """
    import jax

    if jax.process_count() <= 1:
        return
    traceback.print_exc()
    _say(f"process {jax.process_index()} failed; exiting without the shutdown barrier")
    sys.stdout.flush()
    sys.stderr.flush()
    record_exit(1)
    os._exit(1)


def run_ping(spec: cluster.DistributedSpec, *, hold: float = 0.0) -> int:
    """One worker of a ping job (``workbench.jobs.ping`` starts them): checks that every
    process joined and a cross-process all-reduce is right.

    Each device contributes its process index; the all-reduced sum must equal the hand
    count ``sum(process_index * local_devices)``. With ``hold`` the check repeats for
    that many seconds (stoppable with SIGTERM at an agreed step, like training). Every
    process stops at the same round: each adds "my time is up" to the same all-reduce,
    so no process leaves for the shutdown barrier while another waits in a collective
    (their clocks start a few ms apart, more under load).

    Returns:
      0 when every sum was right, ``EXIT_STOPPED`` when stopped early, 1 on a wrong sum.
    """
    _joined(spec)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n_local, pid = jax.local_device_count(), jax.process_index()
    counts = np.asarray(multihost_utils.process_allgather(np.int32(n_local)))  # (processes,)
    expected = float(sum(p * int(c) for p, c in enumerate(counts.reshape(-1))))
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    # column 0: the process index; column 1: 1 on every device of a process whose time is up
    total = jax.jit(lambda a: jnp.sum(a, axis=0), out_shardings=NamedSharding(mesh, P()))
    stop = _StopFlag(distributed=jax.process_count() > 1)
    t_end, i, t0 = time.monotonic() + hold, 0, time.perf_counter()
    while True:
        i += 1
        local = np.zeros((n_local, 2), np.float32)  # (local devices, 2)
        local[:, 0] = pid + i
        local[:, 1] = float(time.monotonic() >= t_end)
        sums = np.asarray(total(jax.make_array_from_process_local_data(sharding, local)))
        got, done = float(sums[0]) - i * jax.device_count(), bool(sums[1] > 0)
        if got != expected:
            _say(f"ping FAILED at round {i}: all-reduce gave {got}, hand count {expected}")
            return 1
        if i == 1:
            report = {"processes": jax.process_count(), "devices": jax.device_count(),
                      "local_devices": [int(c) for c in counts.reshape(-1)], "sum": got,
                      "expected": expected, "first_round_s": time.perf_counter() - t0}
            _say("PING " + json.dumps(report))
        if stop(i):
            _say(f"stopped at round {i} (SIGTERM)")
            return EXIT_STOPPED
        if done:
            _say(f"ping ok: {i} round(s)")
            return 0
        time.sleep(0.1)


class _StopFlag:
    """True at the same round on every process once any got SIGTERM.

    Across processes this is JAX's preemption sync point (its notifier catches SIGTERM
    and the processes agree on the step); in one process, a plain signal handler.
    """

    def __init__(self, *, distributed: bool) -> None:
        self.distributed, self.flag = distributed, False
        if not distributed:
            signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        self.flag = True

    def __call__(self, step: int) -> bool:
        if self.distributed:
            from jax.experimental import multihost_utils

            return bool(multihost_utils.reached_preemption_sync_point(step))
        return self.flag
