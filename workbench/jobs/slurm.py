"""Submitting a training job to SLURM from a cell: the ``Slurm`` request, its batch script,
checks against the cluster (partitions, nodes, time limit, shared storage), and ``sbatch``.

The batch script runs ``srun python -m workbench train`` (the command every local worker
runs); each task joins through ``jax.distributed.initialize()``'s SLURM detection. It asks
SLURM for ``--requeue`` and a SIGTERM ``signal_before`` seconds before the time limit: on
SIGTERM every task agrees on a step, saves a checkpoint there and exits with
``EXIT_STOPPED``; the script then puts the job back in the queue (``scontrol requeue``), and
the next start resumes from that checkpoint. A preemption or ``scontrol requeue`` sends the
same SIGTERM (then SIGKILL after the cluster's ``KillWait``).

Plain ``sbatch``, not submitit: the worker already is a command line, and submitit's own
parts do not fit here. It pickles a Python callable (the notebook and the nodes would need
the same pickled classes), its SIGUSR2 checkpoint-and-requeue handler runs in task 0 alone
(every task must checkpoint at the same step: JAX's preemption sync point on SIGTERM), and
its state watcher reads ``sacct``, which needs slurmdbd. Here the states come from
``scontrol`` / ``squeue`` (``sacct`` once SLURM forgets the job, where accounting exists).
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import workbench
from workbench._xla_flags import cpu_device_flags
from workbench.jobs import fields
from workbench.run_lock import LAUNCHED_ENV

__all__ = ["SLURM_FILE", "Slurm", "SlurmError", "available", "batch_script", "check",
           "parse_time", "request", "run_command", "worker_argv"]

SLURM_FILE = "slurm.json"  # <run_dir>/slurm.json: the job id, the script, how it was asked
_TOOLS_FIX = ("the SLURM client commands (sbatch, squeue, scontrol, scancel, sinfo) must be on "
              "PATH where the notebook runs: open the notebook on the cluster's login node, or "
              "install the cluster's SLURM client (Debian: `apt-get install slurm-client`) and "
              "point SLURM_CONF at its slurm.conf")


class SlurmError(RuntimeError):
    """SLURM refused the request, or its commands are missing here (the message says why)."""


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
               data_changed: str | None = None) -> str:
        """The batch script ``wb.launch(cfg, cluster=self, run_dir=run_dir, steps=...,
        data_changed=...)`` submits (``<token>`` stands for the run directory lock's
        token). Nothing is written."""
        from workbench.jobs.worker import check_data_changed, train_args

        check_data_changed(data_changed, "Slurm.script: ")
        run_dir = Path(run_dir).absolute()
        return batch_script(self, run_dir,
                            worker_argv(self, run_dir, train_args(steps, data_changed)),
                            "<token>")


def worker_argv(slurm: Slurm, run_dir: Path, extra: Sequence[str] = ()) -> list[str]:
    """The command every task runs (``srun`` starts it once per task); ``extra``: the
    launch's ``workbench train`` options (``worker.train_args``)."""
    argv = [slurm.python or sys.executable, "-m", "workbench", "train", "--config",
            str(run_dir / "config.json"), "--run-dir", str(run_dir), *extra]
    if slurm.worker_platform:
        argv += ["--platform", slurm.worker_platform]
    if slurm.devices_per_task and slurm.worker_platform == "cpu":
        argv += ["--devices-per-process", str(slurm.devices_per_task)]
    elif slurm.worker_platform == "gpu" and slurm.gpus_per_node:
        per_task = slurm.devices_per_task or slurm.gpus_per_node // slurm.tasks_per_node
        argv += ["--devices-per-process", str(per_task)]
    return argv


def parse_time(value: str | int) -> int:
    """Seconds of a SLURM time limit ("MM", "MM:SS", "HH:MM:SS", "D-HH[:MM[:SS]]")."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return 60 * value
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", str(value).strip())
    if not m or str(value).strip() in ("0", ""):
        raise ValueError(f"wb.Slurm(time={value!r}) is not a SLURM time limit; use minutes "
                         "(\"90\"), \"HH:MM:SS\" (\"1:30:00\") or \"D-HH:MM:SS\"")
    d, a, b, c = (int(x) if x else None for x in m.groups())
    if d is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
        return d * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:
        return a * 3600 + b * 60 + c
    return a * 60 + (b or 0)


def run_command(argv: Sequence[str], *, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Runs a SLURM command; a missing command raises :class:`SlurmError` naming the fix."""
    if shutil.which(argv[0]) is None:
        raise SlurmError(f"`{argv[0]}` is not on PATH: {_TOOLS_FIX}")
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                          check=False)


def available() -> bool:
    """Whether a SLURM controller answers here (``sinfo`` runs and lists a partition)."""
    if shutil.which("sinfo") is None:
        return False
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True,
                             timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and bool(out.stdout.strip())


# ----------------------------------------------------------------------------- checks
def _partitions() -> dict[str, dict[str, Any]]:
    """Partition -> {"nodes": [hostnames], "default": bool} (from ``sinfo``)."""
    out = run_command(["sinfo", "-h", "-N", "-o", "%P|%N"])
    if out.returncode != 0:
        raise SlurmError(f"`sinfo` failed ({out.stderr.strip()}): is slurmctld reachable from "
                         f"here? Check with `sinfo`; {_TOOLS_FIX}")
    parts: dict[str, dict[str, Any]] = {}
    for line in out.stdout.split():
        name, _, node = line.partition("|")
        default = name.endswith("*")
        p = parts.setdefault(name.rstrip("*"), {"nodes": [], "default": False})
        p["default"] |= default
        if node not in p["nodes"]:
            p["nodes"].append(node)
    return parts


def check(slurm: Slurm, run_dir: Path, *, checkpoint_every: int | None) -> list[str]:
    """Checks ``slurm`` against the cluster before anything is written.

    Returns:
      The nodes of the partition the job would use.

    Raises:
      SlurmError: the SLURM commands are missing, the partition does not exist, or it has
        fewer nodes than asked.

    Warns (UserWarning): a time limit shorter than one checkpoint interval (as measured in
      ``run_dir`` before) or than ``signal_before``.
    """
    parts = _partitions()
    name = slurm.partition or next((k for k, v in parts.items() if v["default"]), None)
    if name not in parts:
        raise SlurmError(f"wb.Slurm(partition={slurm.partition!r}): the cluster has no such "
                         f"partition; it has {sorted(parts)} (see `sinfo`)" if slurm.partition
                         else f"the cluster has no default partition; pass wb.Slurm(partition="
                              f"...) with one of {sorted(parts)}")
    nodes = parts[name]["nodes"]
    if slurm.nodes > len(nodes):
        raise SlurmError(f"wb.Slurm(nodes={slurm.nodes}): partition {name!r} has only "
                         f"{len(nodes)} node(s) ({', '.join(nodes)}); ask for at most "
                         f"{len(nodes)}, or pick a larger partition ({sorted(parts)})")
    if slurm.time is not None:
        _check_time(slurm, run_dir, checkpoint_every)
    return nodes


def _check_time(slurm: Slurm, run_dir: Path, checkpoint_every: int | None) -> None:
    limit = parse_time(slurm.time)  # type: ignore[arg-type]
    if slurm.requeue and limit <= slurm.signal_before:
        warnings.warn(f"wb.Slurm(time={slurm.time!r}) is {limit} s, not more than "
                      f"signal_before={slurm.signal_before} s: SLURM asks the job to checkpoint "
                      "and requeue as soon as it starts. Raise time or lower signal_before",
                      stacklevel=4)
    from workbench import runs

    times = [r["step_time"] for r in runs.read_metrics(run_dir)
             if isinstance(r.get("step_time"), (int, float))][-20:]
    if checkpoint_every and times:
        every_s = checkpoint_every * sorted(times)[len(times) // 2]
        if every_s > limit:
            warnings.warn(f"wb.Slurm(time={slurm.time!r}) is {limit} s, shorter than one "
                          f"checkpoint interval ({checkpoint_every} steps x "
                          f"{every_s / checkpoint_every:.3g} s/step measured in {run_dir} = "
                          f"{every_s:.0f} s): a job killed at its limit keeps no new steps. "
                          "Lower checkpoint_every, raise time, or keep requeue=True (it "
                          "checkpoints on the time-limit signal)", stacklevel=4)


# ----------------------------------------------------------------------------- the script
def check_paths(run_dir: Path) -> None:
    """Refuses a run directory (or working directory) whose name would break the script."""
    fix = "rename it without newlines or other control characters"
    what = "wb.launch(cluster=wb.Slurm(...)): the run directory"
    fields.path_text(run_dir, what, fix)
    if "%" in str(run_dir):
        raise ValueError(f"{what} {str(run_dir)!r} holds '%': SLURM reads it in the job's "
                         "--output path as a pattern (%j is the job id), so the job's output "
                         "would go elsewhere; use a run directory without '%'")
    fields.path_text(os.getcwd(), "wb.launch(cluster=wb.Slurm(...)): the working directory",
                     fix + " (it is the job's --chdir), or os.chdir elsewhere first")


def default_job_name(run_dir: Path) -> str:
    """``wb-<run dir name>``, any character a job name may not hold replaced by ``_``."""
    return "wb-" + re.sub(r"[^A-Za-z0-9_.+:@%=,-]", "_", run_dir.name)


def sbatch_word(text: str) -> str:
    """``text`` as one argument of an ``#SBATCH`` line.

    sbatch reads those lines with its own parser (``_get_argument`` in src/sbatch/opt.c):
    quotes group, an unquoted ``#`` starts a comment, and a backslash escapes the next
    character inside quotes too, so ``shlex.quote`` is not enough: anything beyond the
    characters that need no quoting goes in double quotes with ``\\`` and ``"`` escaped.
    """
    if re.fullmatch(r"[A-Za-z0-9_@%+=:,./-]+", text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def batch_script(slurm: Slurm, run_dir: Path, worker: Sequence[str], token: str) -> str:
    """The ``sbatch`` script that runs ``worker`` in every task (see the module docstring).

    Every ``#SBATCH`` option is one quoted word as sbatch reads them (:func:`sbatch_word`),
    every value exported or run is shell-quoted, and a run directory or working directory
    with a newline is refused: nothing in the script can end a line early.
    """
    check_paths(run_dir)
    logs = run_dir / "logs"
    q = shlex.quote
    opts = [f"--job-name={slurm.job_name or default_job_name(run_dir)}",
            f"--nodes={slurm.nodes}", f"--ntasks-per-node={slurm.tasks_per_node}",
            f"--chdir={os.getcwd()}", f"--output={logs}/slurm-%j.out", "--open-mode=append",
            "--requeue" if slurm.requeue else "--no-requeue"]
    for flag, value in (("--gpus-per-node", slurm.gpus_per_node),
                        ("--cpus-per-task", slurm.cpus_per_task),
                        ("--partition", slurm.partition), ("--account", slurm.account),
                        ("--time", None if slurm.time is None else str(slurm.time).strip())):
        if value is not None:
            opts.append(f"{flag}={value}")
    if slurm.requeue:
        opts.append(f"--signal=TERM@{slurm.signal_before}")
    opts += list(slurm.extra)
    root = str(Path(workbench.__file__).resolve().parent.parent)
    env = {"PYTHONUNBUFFERED": "1", LAUNCHED_ENV: token}
    platform = slurm.worker_platform
    if platform:
        env["JAX_PLATFORMS"] = platform
    if platform == "cpu" and slurm.devices_per_task:
        # the submitter's other XLA flags travel on (sbatch exports its environment too);
        # only the device count is the task's own
        env["XLA_FLAGS"] = cpu_device_flags(os.environ.get("XLA_FLAGS", ""),
                                            slurm.devices_per_task)
    env.update(slurm.env)
    # this workbench first on the path, unless env= gives the whole PYTHONPATH
    exports = ([] if "PYTHONPATH" in env else
               [f'export PYTHONPATH={q(root)}"${{PYTHONPATH:+:$PYTHONPATH}}"'])
    exports += [f"export {k}={q(str(v))}" for k, v in env.items()]
    task = ("export WORKBENCH_EXIT_FILE=" + shlex.quote(str(logs)) +
            "/process-$SLURM_PROCID.exit; exec \"$@\"")
    lines = ["#!/bin/bash", "# written by wb.launch(cluster=wb.Slurm(...)); see workbench.jobs.slurm",
             *[f"#SBATCH {sbatch_word(o)}" for o in opts], "",
             "start=$(( ${SLURM_RESTART_COUNT:-0} + 1 ))",
             # the tasks' exit files are this start's from here on; the notebook tells a start
             # that never ran (SLURM ended the job as it started it again) by the start file
             f"for ((i = 0; i < SLURM_NTASKS; i++)); do rm -f {shlex.quote(str(logs))}"
             "/process-$i.exit; done",
             f"echo \"$start\" > {shlex.quote(str(logs))}/slurm-$SLURM_JOB_ID.start",
             *slurm.setup, *exports,
             f"cd {shlex.quote(os.getcwd())}",
             "for ((i = 0; i < SLURM_NTASKS; i++)); do",
             "  echo \"===== $(date '+%F %T') launch: SLURM job $SLURM_JOB_ID, start $start, on "
             f"$SLURM_JOB_NODELIST\" >> {shlex.quote(str(logs))}/process-$i.log",
             "done",
             f"srun --kill-on-bad-exit=1 --output={shlex.quote(str(logs))}/process-%t.log "
             f"--open-mode=append bash -c {shlex.quote(task)} wb {fields.shell_path(worker[0])} "
             f"{shlex.join(worker[1:])}",
             "rc=$?",
             "echo \"[workbench] srun exited with $rc (start $start)\"",
             *([] if not slurm.requeue else [
                 # every task checkpointed on SIGTERM (the time-limit signal): requeue
                 "if [ $rc -eq 75 ]; then",
                 "  echo \"[workbench] stopped with a checkpoint: requeueing job $SLURM_JOB_ID\"",
                 "  scontrol requeue \"$SLURM_JOB_ID\" && exit 0",
                 "fi"]),
             "exit $rc", ""]
    return "\n".join(lines)


def request(slurm: Slurm) -> dict[str, Any]:
    d = dataclasses.asdict(slurm)
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}
