"""Starting a job's worker processes on this machine: ``launch`` (training) and ``ping``.

Each worker is ``python -m workbench train --config <run_dir>/config.json`` with the
coordinator (127.0.0.1 at a free port), the process count and its own index on the
command line, so what runs here is exactly what ``srun`` or a TPU pod runs.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import workbench
from workbench._validate import check_int, check_path
from workbench._xla_flags import cpu_device_flags
from workbench.jobs.hosts import Hosts, TPUSlice
from workbench.jobs.job import Job, exit_file
from workbench.jobs.slurm import Slurm
from workbench.jobs.slurm_job import submit_slurm
from workbench.run_lock import LAUNCHED_ENV, RunLock
from workbench.jobs.worker import EXIT_FILE_ENV, check_data_changed, train_args

__all__ = ["default_platform", "free_port", "launch", "ping"]

#: The platforms a launched process may use (``JAX_PLATFORMS``).
PLATFORMS = ("cpu", "gpu", "tpu")

CONFIG_NAME = "config.json"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_platform() -> str:
    """The platform the workers use, found without starting JAX's backends here.

    ``JAX_PLATFORMS`` if set; JAX's default backend if this process already started it;
    else what JAX would pick: a TPU or CUDA plugin with its device present, else CPU.
    (Starting the GPU backend in the launching kernel would take the GPUs' memory from
    the workers.)
    """
    env = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip()
    if env:
        return env
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        import jax

        return jax.default_backend()
    has = importlib.util.find_spec
    if has("libtpu") is not None and (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/*")):
        return "tpu"
    cuda = any(has(f"jax_cuda{v}_plugin") is not None for v in (12, 13))
    if cuda and glob.glob("/dev/nvidia[0-9]*"):
        return "gpu"
    return "cpu"


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


def _check_mesh(mesh: dict[str, int], processes: int, devices_per_process: int | None) -> None:
    """Refuses a mesh larger than the devices the launch gives (before any process starts)."""
    if not devices_per_process or any(v == -1 for v in mesh.values()):
        return
    need, have = math.prod(mesh.values()), processes * devices_per_process
    if need > have:
        raise ValueError(f"config.mesh {mesh} needs {need} devices, but the launch gives "
                         f"processes={processes} x devices_per_process={devices_per_process} "
                         f"= {have}; launch more processes/devices, or use a mesh of {have} "
                         "devices (one axis may be -1, e.g. {'data': -1})")


def _child_env(platform: str, devices_per_process: int | None, token: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS=platform)
    env[LAUNCHED_ENV] = token  # the workers write under the launcher's run-dir lock
    # The workers import the same workbench as this process, installed or not.
    root = str(Path(workbench.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    if platform == "cpu" and devices_per_process:
        env["XLA_FLAGS"] = cpu_device_flags(env.get("XLA_FLAGS", ""), devices_per_process)
    return env


def _start(run_dir: Path, subcommand: list[str], *, processes: int,
           devices_per_process: int | None, platform: str | None,
           heartbeat_timeout: int | None, what: str, target_steps: int | None,
           files: dict[str, str] | None = None) -> Job:
    """Locks ``run_dir``, writes ``files`` into it, starts the workers, returns their Job."""
    if not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes must be a positive int, got {processes!r}")
    platform = platform or default_platform()
    if platform == "tpu" and processes > 1:
        raise ValueError(f"launch(processes={processes}) on a TPU VM: run one process per "
                         "host, i.e. processes=1 here, and start `python -m workbench train` "
                         "on every worker of a pod (README: 'Running on GPU, TPU pods and "
                         "SLURM')")
    lock = RunLock(run_dir)
    lock.acquire(what=what)
    try:
        for name, text in (files or {}).items():
            tmp = run_dir / f".{name}.tmp"
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, run_dir / name)
        port = free_port()
        logs = run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = _child_env(platform, devices_per_process, lock.token or "")
        procs, log_paths, commands = [], [], []
        for i in range(processes):
            argv = [sys.executable, "-m", "workbench", *subcommand, "--platform", platform]
            if processes > 1:
                argv += ["--coordinator", f"127.0.0.1:{port}", "--num-processes",
                         str(processes), "--process-id", str(i)]
            else:  # one process: exactly what a notebook Trainer does, no jax.distributed
                argv += ["--distributed", "off"]
            if devices_per_process:
                argv += ["--devices-per-process", str(devices_per_process)]
            if heartbeat_timeout:
                argv += ["--heartbeat-timeout", str(heartbeat_timeout)]
            log_path = logs / f"process-{i}.log"
            exit_file(log_path).unlink(missing_ok=True)
            with open(log_path, "ab") as log:
                log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} launch: "
                          f"{shlex.join(argv)}\n".encode())
                log.flush()
                # own session: a Ctrl-C in the terminal/kernel reaches the launcher, which
                # turns it into a coordinated stop, not into N uncoordinated interrupts
                procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL,
                                              env={**env, EXIT_FILE_ENV: str(exit_file(log_path))},
                                              cwd=os.getcwd(), start_new_session=True))
            log_paths.append(log_path)
            commands.append(argv)
        lock.update([p.pid for p in procs], what=what, platform=platform,
                    logs=[str(p) for p in log_paths], target_steps=target_steps)
    except BaseException:
        for p in locals().get("procs", []):
            p.kill()
        lock.release()
        raise
    return Job(run_dir, procs, log_paths, lock=lock, commands=commands,
               devices_per_process=devices_per_process, platform=platform,
               target_steps=target_steps)


def launch(config: Any, processes: int = 1, devices_per_process: int | None = None,
           run_dir: str | os.PathLike[str] | None = None, *, steps: int | None = None,
           platform: str | None = None, heartbeat_timeout: int | None = None,
           cluster: Any = None, data_changed: str | None = None) -> Job:
    """Launches ``config`` as a multi-process ``jax.distributed`` training job on this machine,
    or on a cluster: SLURM (``cluster=wb.Slurm(...)``), hosts over ssh (``wb.Hosts``) or a
    Cloud TPU VM slice (``wb.TPUSlice``).

    Writes ``<run_dir>/config.json`` and starts ``processes`` workers, each running
    ``python -m workbench train --config <run_dir>/config.json``; they join through a
    coordinator on 127.0.0.1 (gloo collectives on CPU). Process 0 writes the metrics to
    the run directory, so the lab panel and the Job widget show them live. Launching
    again into the same run directory continues from its last checkpoint.

    Args:
      config: a ``TrainConfig`` (or a dict of its fields, or a path to CONFIG.json).
      processes: number of worker processes.
      devices_per_process: simulated CPU devices per process (CPU), or GPUs per process
        (one-host GPU launch: process i takes GPUs i*M .. i*M+M-1); None: all/JAX default.
      run_dir: the run directory (default ``runs/launch-<time>``); on shared storage
        when the job spans hosts.
      steps: train until this many steps in total (default: ``config.steps``).
      platform: "cpu", "gpu" or "tpu" (default: :func:`default_platform`).
      heartbeat_timeout: seconds after which a silent process counts as dead (default 15).
      cluster: where to run instead of this machine: a ``wb.Slurm``, ``wb.Hosts`` or
        ``wb.TPUSlice`` (then ``processes``/``devices_per_process`` come from it).
      data_changed: None, or "ok" to continue a run whose data (files or tokenizer)
        changed since it was recorded (``wb.Trainer(data_changed="ok")``; without it the
        workers refuse, naming what changed).

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
    if run_dir is not None:
        check_path(run_dir, "run_dir", where="wb.launch: ")
    if platform is not None and platform not in PLATFORMS:
        raise (ValueError if isinstance(platform, str) else TypeError)(
            f"wb.launch: platform={platform!r} is not one of {PLATFORMS}; leave it out for "
            f"this machine's ({default_platform()!r})")
    if heartbeat_timeout is not None:
        check_int(heartbeat_timeout, "heartbeat_timeout", where="wb.launch: ",
                  fix="seconds, e.g. heartbeat_timeout=60")
    run_dir = Path(run_dir or f"runs/launch-{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    text = _config_text(config)
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"wb.launch: the config {str(config)[:200]!r} is not valid JSON: "
                         f"{err}; write it with TrainConfig.to_json()") from None
    from workbench.train.config import TrainConfig

    TrainConfig.from_dict(fields)  # a bad config is refused here: no directory, no process
    for name, value in (("processes", processes), ("devices_per_process", devices_per_process),
                        ("steps", steps)):
        if value is not None:
            check_int(value, name, where="wb.launch: ")
    check_data_changed(data_changed, "wb.launch: ")
    target = steps if steps is not None else fields.get("steps")
    extra = train_args(steps, data_changed)
    if cluster is not None:
        return _launch_on(cluster, run_dir, text, fields, extra=extra, target=target)
    _check_mesh(fields.get("mesh") or {}, processes, devices_per_process)
    sub = ["train", "--config", str(run_dir / CONFIG_NAME), "--run-dir", str(run_dir),
           *extra]
    return _start(run_dir, sub, processes=processes, devices_per_process=devices_per_process,
                  platform=platform, heartbeat_timeout=heartbeat_timeout, what="train",
                  target_steps=target, files={CONFIG_NAME: text})


def _launch_on(cluster: Any, run_dir: Path, text: str, fields: dict[str, Any], *,
               extra: list[str], target: int | None) -> Job:
    """``launch(cluster=...)``: SLURM (``jobs.slurm_job``) or hosts over ssh (``jobs.hosts``)."""
    if not isinstance(cluster, (Slurm, Hosts, TPUSlice)):
        raise TypeError(f"wb.launch(cluster={cluster!r}): pass a wb.Slurm, wb.Hosts or "
                        "wb.TPUSlice")
    _check_mesh(fields.get("mesh") or {}, cluster.tasks, cluster.devices_per_task)
    if isinstance(cluster, Slurm):
        return submit_slurm(cluster, run_dir, text, extra=extra, target_steps=target)
    return cluster.submit(run_dir, text, extra=extra, target_steps=target)


def ping(processes: int = 2, devices_per_process: int | None = None,
         run_dir: str | os.PathLike[str] | None = None, *, hold: float = 0.0,
         platform: str | None = None, heartbeat_timeout: int | None = None) -> Job:
    """Starts a job that only checks ``jax.distributed`` and a cross-process all-reduce.

    Useful before a long launch (and on a new machine): the job finishes in seconds, and
    its logs show every process, its devices and the all-reduce against a hand count.

    Args:
      processes, devices_per_process, run_dir, platform, heartbeat_timeout: as in launch.
      hold: keep all-reducing for this many seconds (stoppable with ``job.stop()``).
    """
    run_dir = Path(run_dir or f"runs/ping-{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    sub: Sequence[str] = ["ping", "--hold", str(hold)]
    return _start(run_dir, list(sub), processes=processes,
                  devices_per_process=devices_per_process, platform=platform,
                  heartbeat_timeout=heartbeat_timeout, what="ping", target_steps=None)
