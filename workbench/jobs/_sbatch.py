"""SLURM's side of a job: the batch script ``wb.Slurm`` submits, the checks against the
cluster before anything is written (partitions, nodes, time limit, paths), and the SLURM
commands themselves (a missing one named with its fix).

The batch script runs ``srun python -m workbench <command>`` (the command every local
worker runs); each task joins through ``jax.distributed.initialize()``'s SLURM detection.
It asks SLURM for ``--requeue`` and a SIGTERM ``signal_before`` seconds before the time
limit: on SIGTERM every task agrees on a step, saves a checkpoint there and exits with
``EXIT_STOPPED``; the script then puts the job back in the queue (``scontrol requeue``),
and the next start resumes from that checkpoint. A preemption or ``scontrol requeue``
sends the same SIGTERM (then SIGKILL after the cluster's ``KillWait``). Every function
here takes the ``wb.Slurm`` request as its first argument.
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workbench._xla_flags import cpu_device_flags
from workbench.jobs import _fields as fields
from workbench.jobs._worker import IMPORT_ROOT, train_command
from workbench._run_lock import LAUNCHED_ENV

__all__ = ["SLURM_FILE", "SlurmError", "available", "batch_script", "check", "check_paths",
           "parse_time", "request", "run_command", "worker_argv"]

SLURM_FILE = "slurm.json"  # <run_dir>/slurm.json: the job id, the script, how it was asked
_TOOLS_FIX = ("the SLURM client commands (sbatch, squeue, scontrol, scancel, sinfo) must be on "
              "PATH where the notebook runs: open the notebook on the cluster's login node, or "
              "install the cluster's SLURM client (Debian: `apt-get install slurm-client`) and "
              "point SLURM_CONF at its slurm.conf")


class SlurmError(RuntimeError):
    """SLURM refused the request, or its commands are missing here (the message says why)."""


def worker_argv(slurm: Any, run_dir: Path, extra: Sequence[str] = (),
                command: Sequence[str] | None = None) -> list[str]:
    """The command every task of ``slurm`` (a ``wb.Slurm``) runs (``srun`` starts it once
    per task); ``extra``: the launch's ``workbench train`` options (``worker.train_args``);
    ``command``: another worker subcommand than ``train`` (``ping``)."""
    command = train_command(run_dir) if command is None else command
    argv = [slurm.python or sys.executable, "-m", "workbench", *command, *extra]
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


def check(slurm: Any, run_dir: Path, *, checkpoint_every: int | None) -> list[str]:
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


def _check_time(slurm: Any, run_dir: Path, checkpoint_every: int | None) -> None:
    limit = parse_time(slurm.time)  # type: ignore[arg-type]
    if slurm.requeue and limit <= slurm.signal_before:
        warnings.warn(f"wb.Slurm(time={slurm.time!r}) is {limit} s, not more than "
                      f"signal_before={slurm.signal_before} s: SLURM asks the job to checkpoint "
                      "and requeue as soon as it starts. Raise time or lower signal_before",
                      stacklevel=4)
    from workbench import _runs as runs

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


def batch_script(slurm: Any, run_dir: Path, worker: Sequence[str], token: str) -> str:
    """The ``sbatch`` script that runs ``worker`` in every task of ``slurm`` (see the module
    docstring).

    Every ``#SBATCH`` option is one quoted word as sbatch reads them (:func:`sbatch_word`),
    every value exported or run is shell-quoted, and a run directory or working directory
    with a newline is refused: nothing in the script can end a line early.
    """
    check_paths(run_dir)
    logs = run_dir / "logs"
    opts = _sbatch_options(slurm, run_dir, logs)
    exports = _exports(slurm, token)
    task = ("export WORKBENCH_EXIT_FILE=" + shlex.quote(str(logs)) +
            "/process-$SLURM_PROCID.exit; exec \"$@\"")
    lines = ["#!/bin/bash",
             "# written by wb.launch(cluster=wb.Slurm(...)); see workbench.jobs._sbatch",
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


def _sbatch_options(slurm: Any, run_dir: Path, logs: Path) -> list[str]:
    """The ``#SBATCH`` options of ``slurm``'s job, unquoted (``batch_script`` quotes)."""
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
    return opts + list(slurm.extra)


def _exports(slurm: Any, token: str) -> list[str]:
    """The ``export`` lines of the tasks' environment, shell-quoted: unbuffered output,
    the launch token, the platform and CPU device count, ``slurm.env``, and this
    workbench first on ``PYTHONPATH`` (unless ``env`` gives the whole of it)."""
    q = shlex.quote
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
    exports = ([] if "PYTHONPATH" in env else
               [f'export PYTHONPATH={q(IMPORT_ROOT)}"${{PYTHONPATH:+:$PYTHONPATH}}"'])
    return exports + [f"export {k}={q(str(v))}" for k, v in env.items()]


def request(slurm: Any) -> dict[str, Any]:
    d = dataclasses.asdict(slurm)
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}
