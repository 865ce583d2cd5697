"""The three verbs of ``workbench.jobs``: ``launch`` a training job, ``ping`` the collectives,
``attach`` to a job again. Each works through the ``Cluster`` protocol, whatever the kind.

``launch`` and ``ping`` check their arguments (and the config, and the files it names)
before anything is written, then hand one :class:`~workbench.jobs._protocol.Submission` to
``cluster.submit``; without ``cluster=`` they run on this machine (``Local``). ``attach``
asks each kind whether the run directory holds its record and lets that kind find the job.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from workbench._validate import check_int, check_path
from workbench.jobs._hosts import Hosts, TPUSlice
from workbench.jobs._job import Job
from workbench.jobs._local import PLATFORMS, Local, default_platform
from workbench.jobs._protocol import Cluster, Submission
from workbench.jobs._slurm import Slurm
from workbench.jobs._worker import check_consent, ping_command, train_args, train_command

__all__ = ["KINDS", "attach", "launch", "ping"]

#: The cluster kinds ``attach`` asks, in order (a SLURM record first: SLURM knows ended
#: jobs too; ``Local`` last: every kind holds the run directory's lock).
KINDS: tuple[type[Any], ...] = (Slurm, Hosts, TPUSlice, Local)

CONFIG_NAME = "config.json"


def _config_text(config: Any) -> str:
    """JSON text of a ``TrainConfig`` (or a dict of its fields, or a path to CONFIG.json)."""
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if path.suffix != ".json" or not path.is_file():
            raise ValueError(f"launch(config={str(config)!r}): pass a TrainConfig, a dict, or "
                             "an existing CONFIG.json")
        return path.read_text(encoding="utf-8")
    if isinstance(config, dict):
        return json.dumps(config, indent=1)
    to_json = getattr(config, "to_json", None)
    if to_json is None:
        raise TypeError(f"wb.launch: config={config!r} is a {type(config).__name__}; give a "
                        "TrainConfig (or a dict, or the path of a CONFIG.json)")
    text = to_json()
    return text if isinstance(text, str) else json.dumps(text, indent=1)


def _cluster(cluster: Any, where: str) -> Cluster:
    if not isinstance(cluster, Cluster):
        raise TypeError(f"{where}cluster={cluster!r} is not a cluster; pass a wb.Local, "
                        "wb.Slurm, wb.Hosts or wb.TPUSlice (or leave it out for this machine)")
    return cluster


def _local(processes: int, devices_per_process: int | None, platform: str | None,
           heartbeat_timeout: int | None, where: str) -> Local:
    """``Local`` of a launch's own arguments, each checked with the launch's name."""
    if platform is not None and platform not in PLATFORMS:
        raise (ValueError if isinstance(platform, str) else TypeError)(
            f"{where}platform={platform!r} is not one of {PLATFORMS}; leave it out for "
            f"this machine's ({default_platform()!r})")
    for name, value in (("processes", processes), ("devices_per_process", devices_per_process),
                        ("heartbeat_timeout", heartbeat_timeout)):
        if value is not None:
            check_int(value, name, where=where,
                      fix="seconds, e.g. heartbeat_timeout=60" if name[0] == "h" else "")
    return Local(processes=processes, devices_per_process=devices_per_process,
                 platform=platform, heartbeat_timeout=heartbeat_timeout)


def launch(config: Any, processes: int = 1, devices_per_process: int | None = None,
           run_dir: str | os.PathLike[str] | None = None, *, steps: int | None = None,
           platform: str | None = None, heartbeat_timeout: int | None = None,
           cluster: Cluster | None = None, data_changed: str | None = None,
           restart: str | None = None) -> Job:
    """Launches ``config`` as a multi-process ``jax.distributed`` training job on this machine,
    or on a cluster: SLURM (``cluster=wb.Slurm(...)``), hosts over ssh (``wb.Hosts``) or a
    Cloud TPU VM slice (``wb.TPUSlice``).

    Writes ``<run_dir>/config.json`` and starts the workers, each running ``python -m
    workbench train --config <run_dir>/config.json``; on this machine they join through a
    coordinator on 127.0.0.1 (gloo collectives on CPU). Process 0 writes the metrics to
    the run directory, so the lab panel and the Job widget show them live. Launching
    again into the same run directory continues from its last checkpoint. The config and
    the files it names (``TrainConfig.check``) are checked before anything is written.

    Args:
      config: a ``TrainConfig`` (or a dict of its fields, or a path to CONFIG.json).
      processes: number of worker processes (on this machine).
      devices_per_process: simulated CPU devices per process (CPU), or GPUs per process
        (one-host GPU launch: process i takes GPUs i*M .. i*M+M-1); None: all/JAX default.
      run_dir: the run directory (default ``runs/launch-<time>``); on shared storage
        when the job spans hosts.
      steps: train until this many steps in total (default: ``config.steps``).
      platform: "cpu", "gpu" or "tpu" (default: this machine's, ``default_platform``).
      heartbeat_timeout: seconds after which a silent process counts as dead (default 15).
      cluster: where to run: a ``wb.Local``, ``wb.Slurm``, ``wb.Hosts`` or ``wb.TPUSlice``
        (then ``processes``, ``devices_per_process``, ``platform`` and
        ``heartbeat_timeout`` come from it); default ``wb.Local`` of those four.
      data_changed: None, or "ok" to continue a run whose data (files or tokenizer)
        changed since it was recorded (``wb.Trainer(data_changed="ok")``; without it the
        workers refuse, naming what changed).
      restart: None, or "ok" to start a new attempt of a run whose recorded steps no
        checkpoint restores (its checkpoints were deleted: ``wb.Trainer(restart="ok")``,
        recorded in run.json's history; without it the workers refuse, naming the run).

    Returns:
      The running :class:`Job` (``status``, ``wait()``, ``stop()``, ``tail()``; it shows
      as a live widget in a notebook).

    Raises:
      JobRunningError: ``run_dir`` already has a running job.

    Example::

        job = wb.launch(cfg.replace(steps=500), processes=2, devices_per_process=4,
                        run_dir="runs/tiny-2x4")
        job.wait()
    """
    where = "wb.launch: "
    if run_dir is not None:
        check_path(run_dir, "run_dir", where=where)
    local = _local(processes, devices_per_process, platform, heartbeat_timeout, where)
    if steps is not None:
        check_int(steps, "steps", where=where)
    check_consent("data_changed", data_changed, where)
    check_consent("restart", restart, where)
    target = _cluster(cluster, where) if cluster is not None else local
    run_dir = Path(run_dir or f"runs/launch-{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    text = _config_text(config)
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"wb.launch: the config {str(config)[:200]!r} is not valid JSON: "
                         f"{err}; write it with TrainConfig.to_json()") from None
    from workbench.train._config import TrainConfig

    # a bad config, or a file it names that is missing or holds another model, is refused
    # here: no directory, no process
    TrainConfig.from_dict(fields).check()
    return target.submit(Submission(
        run_dir=run_dir, command=train_command(run_dir),
        options=tuple(train_args(steps, data_changed, restart)), files={CONFIG_NAME: text},
        what="train", target_steps=steps if steps is not None else fields.get("steps"),
        checkpoint_every=fields.get("checkpoint_every"), mesh=fields.get("mesh") or {}))


def ping(processes: int = 2, devices_per_process: int | None = None,
         run_dir: str | os.PathLike[str] | None = None, *, hold: float = 0.0,
         platform: str | None = None, heartbeat_timeout: int | None = None,
         cluster: Cluster | None = None) -> Job:
    """Starts a job that only checks ``jax.distributed`` and a cross-process all-reduce.

    Useful before a long launch (and on a new machine or cluster): the job finishes in
    seconds, and its logs show every process, its devices and the all-reduce against a
    hand count (``python -m workbench ping`` in every worker).

    Args:
      processes, devices_per_process, run_dir, platform, heartbeat_timeout, cluster: as
        in :func:`launch`.
      hold: keep all-reducing for this many seconds (stoppable with ``job.stop()``).

    Example::

        job = workbench.jobs.ping(cluster=wb.Hosts(["node1", "node2"]), run_dir="/shared/p")
        job.wait()   # "finished": every process joined and the sums were right
    """
    where = "ping: "
    if run_dir is not None:
        check_path(run_dir, "run_dir", where=where)
    if isinstance(hold, bool) or not isinstance(hold, (int, float)) or not 0 <= hold < 1e9:
        raise (TypeError if not isinstance(hold, (int, float)) else ValueError)(
            f"{where}hold={hold!r} must be the seconds to keep all-reducing, e.g. hold=0")
    local = _local(processes, devices_per_process, platform, heartbeat_timeout, where)
    target = _cluster(cluster, where) if cluster is not None else local
    run_dir = Path(run_dir or f"runs/ping-{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    return target.submit(Submission(run_dir=run_dir, command=ping_command(hold), what="ping"))


def attach(run_dir: str | os.PathLike[str]) -> Job:
    """Watches the job of ``run_dir`` again (e.g. after a kernel restart), whoever started it.

    A job submitted to SLURM (``run_dir/slurm.json``) is found in any state, queued,
    running or ended: its state comes from SLURM. A job started over ssh
    (``run_dir/hosts.json``) or as local processes is found while it runs.

    Raises:
      NoJobError: (a FileNotFoundError) no running job holds ``run_dir`` (and none was
        submitted to SLURM).
    """
    path = check_path(run_dir, "run_dir", where="wb.attach: ")
    kind = next((k for k in KINDS if k.recorded(path)), Local)
    return kind.attach(path)
