"""Submitting a job to SLURM from a cell: ``Slurm``, the request and its ``Cluster`` side
(submit with ``sbatch``, find the job again from ``<run_dir>/slurm.json``).

The batch script and the checks against the cluster are ``workbench.jobs._sbatch``; the
submitted job, with the scheduler's states, is ``workbench.jobs._slurm_job``.

Plain ``sbatch``, not submitit: the worker already is a command line, and submitit's own
parts do not fit here. It pickles a Python callable (the notebook and the nodes would need
the same pickled classes), its SIGUSR2 checkpoint-and-requeue handler runs in task 0 alone
(every task must checkpoint at the same step: JAX's preemption sync point on SIGTERM), and
its state watcher reads ``sacct``, which needs slurmdbd. Here the states come from
``scontrol`` / ``squeue`` (``sacct`` once SLURM forgets the job, where accounting exists).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from workbench.jobs import _fields as fields, _storage as storage
from workbench.jobs._protocol import Submission, check_mesh
from workbench.jobs._sbatch import (SLURM_FILE, SlurmError, available, batch_script, check,
                                   check_paths, parse_time, request, run_command, worker_argv)
from workbench.jobs._slurm_job import SlurmJob
from workbench.jobs._worker import check_consent, train_args
from workbench._run_lock import RunLock

__all__ = ["SLURM_FILE", "Slurm", "SlurmError", "available", "batch_script", "check",
           "parse_time", "request", "run_command", "worker_argv"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Slurm:
    """Where and how to run a job on a SLURM cluster (``wb.launch(cfg, cluster=wb.Slurm(...))``).

    Attributes:
      nodes: nodes to allocate.
      tasks_per_node: worker processes per node (one per GPU, or one per host on TPU/CPU).
      gpus_per_node: GPUs per node (``--gpus-per-node``); None asks for none.
      cpus_per_task: CPU cores per task (``--cpus-per-task``).
      devices_per_task: on CPU, simulated devices per task (``XLA_FLAGS``); on GPU, GPUs
        each task uses (default: SLURM's share).
      partition: the partition (``-p``); None: the cluster's default.
      time: time limit in SLURM's syntax ("90", "1:30:00", "2-00:00:00"); None: the
        partition's default.
      account: the account to charge (``-A``).
      requeue: go back to the queue when preempted or near the time limit (with a
        checkpoint) instead of ending.
      signal_before: seconds before the time limit SLURM sends SIGTERM (the checkpoint).
      platform: "cpu", "gpu" or "tpu" for the workers (default: "gpu" when
        ``gpus_per_node`` is set, else JAX's default on the node).
      python: the Python that runs the worker on the nodes (default: this kernel's).
      setup: shell lines run on the node before the workers (``module load cuda``,
        ``source ~/venv/bin/activate``), one line each, written as given.
      env: environment variables for the workers.
      extra: further ``sbatch`` options, one per entry, each passed as one argument
        (``["--qos=high", "--constraint=a100"]``).
      job_name: the SLURM job name (default ``wb-<run dir name>``): letters, digits and
        ``_ . - + : @ % = ,``.

    Every field is checked here (type, range, and no newline, quote, ``$`` or backtick
    where a name is expected): a bad request fails before anything is written.
    """

    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    devices_per_task: int | None = None
    partition: str | None = None
    time: str | int | None = None
    account: str | None = None
    requeue: bool = True
    signal_before: int = 120
    platform: str | None = None
    python: str | None = None
    setup: Sequence[str] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    extra: Sequence[str] = ()
    job_name: str | None = None

    def __post_init__(self) -> None:
        where = "wb.Slurm"
        for name in ("nodes", "tasks_per_node", "signal_before"):
            fields.optional_int(getattr(self, name), name, where)
        for name in ("gpus_per_node", "cpus_per_task", "devices_per_task"):
            fields.optional_int(getattr(self, name), name, where,
                                fix=f"pass a positive int, or {name}=None")
        if self.time is not None:
            if isinstance(self.time, str):
                fields.one_line(self.time, "time", where, example="'1:30:00'")
            parse_time(self.time)
        if not isinstance(self.requeue, bool):
            raise TypeError(f"wb.Slurm(requeue={self.requeue!r}): requeue must be True (go back "
                            "to the queue with a checkpoint when preempted or near the time "
                            "limit) or False")
        for name, example in (("partition", "'gpu'"), ("account", "'my-lab'"),
                              ("job_name", "'my-run'")):
            if getattr(self, name) is not None:
                fields.word(getattr(self, name), name, where, example=example)
        fields.platform(self.platform, where)
        if self.python is not None:
            fields.one_line(self.python, "python", where, example="'/opt/venv/bin/python'")
        set_ = object.__setattr__
        set_(self, "setup", fields.lines(self.setup, "setup", where,
                                         example="['module load cuda']"))
        set_(self, "extra", fields.lines(self.extra, "extra", where,
                                         example="['--qos=high']", each="one sbatch option"))
        for i, opt in enumerate(self.extra):
            if not opt.startswith("-"):
                raise ValueError(f"wb.Slurm(extra={list(self.extra)!r}): extra[{i}]={opt!r} is "
                                 "not an sbatch option; give one option per entry, e.g. "
                                 "extra=['--qos=high', '--constraint=a100']")
        set_(self, "env", fields.env_vars(self.env, where))
        if self.gpus_per_node and self.gpus_per_node % self.tasks_per_node:
            raise ValueError(f"wb.Slurm(gpus_per_node={self.gpus_per_node}, tasks_per_node="
                             f"{self.tasks_per_node}): every task takes the same number of "
                             "GPUs; use tasks_per_node=1 (one process drives all GPUs) or "
                             f"tasks_per_node={self.gpus_per_node} (one per GPU)")

    @property
    def tasks(self) -> int:
        """Worker processes in the job (``nodes * tasks_per_node``)."""
        return self.nodes * self.tasks_per_node

    @property
    def worker_platform(self) -> str | None:
        return self.platform or ("gpu" if self.gpus_per_node else None)

    def script(self, run_dir: str | os.PathLike[str], *, steps: int | None = None,
               data_changed: str | None = None, restart: str | None = None) -> str:
        """The batch script ``wb.launch(cfg, cluster=self, run_dir=run_dir, steps=...,
        data_changed=..., restart=...)`` submits (``<token>`` stands for the run directory lock's
        token). Nothing is written."""

        check_consent("data_changed", data_changed, "Slurm.script: ")
        check_consent("restart", restart, "Slurm.script: ")
        run_dir = Path(run_dir).absolute()
        return batch_script(self, run_dir,
                            worker_argv(self, run_dir, train_args(steps, data_changed, restart)),
                            "<token>")

    def remote_command(self, i: int, run_dir: Path, token: str, *, steps: int | None = None,
                       extra: Sequence[str] = (),
                       command: Sequence[str] | None = None) -> str:
        """The command ``srun`` runs in every task (``i`` is ``SLURM_PROCID``; the batch
        script exports the environment and ``token``: :meth:`script` shows it whole)."""
        options = [*([] if steps is None else ["--steps", str(steps)]), *extra]
        return shlex.join(worker_argv(self, Path(run_dir).absolute(), options, command))

    def submit(self, submission: Submission) -> SlurmJob:
        """Checks the request against the cluster, locks the run directory, writes the
        submission's files and the batch script, runs ``sbatch``.

        Raises:
          SlurmError: missing commands, an unknown partition, too many nodes, or sbatch's
            refusal.
          JobRunningError: the run directory belongs to a job still queued or running.
        """
        run_dir = submission.run_dir
        check_paths(run_dir)   # a newline in a path would end a line of the script
        nodes = check(self, run_dir, checkpoint_every=submission.checkpoint_every)
        check_mesh(submission.mesh, self.tasks, self.devices_per_task)  # after SLURM's own
        storage.warn_if_not_shared(run_dir, nodes)
        lock = RunLock(run_dir)
        lock.acquire(what="slurm")
        try:
            (run_dir / "logs").mkdir(parents=True, exist_ok=True)
            (run_dir / "slurm").mkdir(exist_ok=True)
            for name, text in submission.files.items():
                (run_dir / name).write_text(text, encoding="utf-8")
            worker = worker_argv(self, run_dir, submission.options, submission.command)
            script = run_dir / "slurm" / "job.sbatch"
            script.write_text(batch_script(self, run_dir, worker, lock.token or ""))
            out = run_command(["sbatch", "--parsable", str(script)])
            if out.returncode != 0:
                raise SlurmError(f"sbatch refused the job: {out.stderr.strip()} (script "
                                 f"{script}; check the partition, nodes, GPUs and time limit "
                                 "against `sinfo`)")
            job_id = out.stdout.strip().split(";")[0]
            record = {"scheduler": "slurm", "job_id": job_id, "script": str(script),
                      "submitted": time.time(), "host": socket.gethostname(),
                      "slurm_conf": os.environ.get("SLURM_CONF"), "tasks": self.tasks,
                      "platform": self.worker_platform,
                      "devices_per_task": self.devices_per_task,
                      "target_steps": submission.target_steps, "request": request(self)}
            lock.update([], what="slurm", slurm_job=job_id, slurm_conf=record["slurm_conf"])
            tmp = run_dir / f".{SLURM_FILE}.tmp"
            tmp.write_text(json.dumps(record, indent=1), encoding="utf-8")
            os.replace(tmp, run_dir / SLURM_FILE)
        except BaseException:
            lock.release()
            raise
        return SlurmJob(run_dir, record, lock=lock)

    @classmethod
    def recorded(cls, run_dir: Path) -> bool:
        """Whether ``run_dir/slurm.json`` records a submitted job."""
        return (run_dir / SLURM_FILE).exists()

    @classmethod
    def attach(cls, run_dir: Path) -> SlurmJob:
        """The job recorded in ``run_dir/slurm.json``, in any state: queued, running or
        ended (its state comes from SLURM)."""
        record = json.loads((run_dir / SLURM_FILE).read_text(encoding="utf-8"))
        return SlurmJob(run_dir, record, lock=None, attached=True)
