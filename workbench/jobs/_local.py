"""Jobs on this machine: ``Local`` starts every worker process here, as a ``Cluster``.

Each worker is ``python -m workbench <command>`` with the coordinator (127.0.0.1 at a free
port), the process count and its own index on the command line, so what runs here is
exactly what ``srun`` or a TPU pod runs.
"""
from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from workbench._validate import check_int
from workbench._xla_flags import cpu_device_count, cpu_device_flags
from workbench.jobs._job import Job, NoJobError, _Pid, exit_file
from workbench.jobs._protocol import Submission, check_mesh
from workbench.jobs._worker import EXIT_FILE_ENV, IMPORT_ROOT, train_command
from workbench._run_lock import LAUNCHED_ENV, RunLock

__all__ = ["PLATFORMS", "Local", "default_platform", "free_port"]

#: The platforms a launched process may use (``JAX_PLATFORMS``).
PLATFORMS = ("cpu", "gpu", "tpu")


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


def _child_env(platform: str, devices_per_process: int | None, token: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS=platform)
    env[LAUNCHED_ENV] = token  # the workers write under the launcher's run-dir lock
    # a W&B service of this process (a notebook that used wandb) is not the workers': a
    # worker killed inside it leaves its run "in use" there, and its resume fails
    env.pop("WANDB_SERVICE", None)
    # The workers import the same workbench as this process, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (IMPORT_ROOT, env.get("PYTHONPATH")) if p)
    if platform == "cpu" and devices_per_process:
        env["XLA_FLAGS"] = cpu_device_flags(env.get("XLA_FLAGS", ""), devices_per_process)
    return env


def _one_process_per_tpu_host(processes: int, platform: str | None) -> None:
    """Refuses several processes on one TPU VM (each would claim every chip)."""
    if platform == "tpu" and processes > 1:
        raise ValueError(f"launch(processes={processes}) on a TPU VM: run one process per "
                         "host, i.e. processes=1 here, and start `python -m workbench train` "
                         "on every worker of a pod (docs/clusters.md; cluster=wb.TPUSlice(...) "
                         "does it from here)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Local:
    """Run the job's workers as processes on this machine (``wb.launch(cfg, processes=2)``
    is ``wb.launch(cfg, cluster=wb.Local(processes=2))``).

    Attributes:
      processes: worker processes; with more than one they join through a coordinator on
        127.0.0.1 (the gloo collectives on CPU), with one it runs without
        ``jax.distributed``, as a notebook Trainer does.
      devices_per_process: simulated CPU devices per process (CPU), or GPUs per process
        (one-host GPU launch: process ``i`` takes GPUs ``i*M .. i*M+M-1``); None: all /
        JAX's default.
      platform: "cpu", "gpu" or "tpu" (default: :func:`default_platform`, found without
        starting JAX's backends here).
      heartbeat_timeout: seconds after which a silent process counts as dead (default 15).

    Example::

        job = wb.launch(cfg, cluster=wb.Local(processes=2, devices_per_process=4),
                        run_dir="runs/tiny-2x4")
    """

    processes: int = 1
    devices_per_process: int | None = None
    platform: str | None = None
    heartbeat_timeout: int | None = None

    def __post_init__(self) -> None:
        where = "wb.Local: "
        check_int(self.processes, "processes", where=where, fix="e.g. processes=2")
        for name in ("devices_per_process", "heartbeat_timeout"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name, where=where)
        if self.platform is not None and self.platform not in PLATFORMS:
            raise (ValueError if isinstance(self.platform, str) else TypeError)(
                f"{where}platform={self.platform!r} is not one of {PLATFORMS}; leave it out "
                f"for this machine's ({default_platform()!r})")
        _one_process_per_tpu_host(self.processes, self.platform)

    @property
    def tasks(self) -> int:
        """Worker processes (``processes``)."""
        return self.processes

    @property
    def devices_per_task(self) -> int | None:
        """Devices of each worker (``devices_per_process``)."""
        return self.devices_per_process

    def _local_devices(self, platform: str) -> int | None:
        """Devices each worker gets: ``devices_per_process``, else on CPU what the workers'
        environment gives (this process's ``XLA_FLAGS``), else unknown (None)."""
        if self.devices_per_process or platform != "cpu":
            return self.devices_per_process
        return cpu_device_count(os.environ)

    def _argv(self, i: int, command: Sequence[str], platform: str,
              port: int | str) -> list[str]:
        """Worker ``i``'s argv: the subcommand and how it joins the job."""
        argv = [sys.executable, "-m", "workbench", *command, "--platform", platform]
        if self.processes > 1:
            argv += ["--coordinator", f"127.0.0.1:{port}", "--num-processes",
                     str(self.processes), "--process-id", str(i)]
        else:  # one process: exactly what a notebook Trainer does, no jax.distributed
            argv += ["--distributed", "off"]
        if self.devices_per_process:
            argv += ["--devices-per-process", str(self.devices_per_process)]
        if self.heartbeat_timeout:
            argv += ["--heartbeat-timeout", str(self.heartbeat_timeout)]
        return argv

    def remote_command(self, i: int, run_dir: Path, token: str, *, steps: int | None = None,
                       extra: Sequence[str] = (),
                       command: Sequence[str] | None = None) -> str:
        """The command line worker ``i`` runs here, with its environment (a preview; the
        coordinator's ``<port>`` is picked free when the job starts)."""
        command = train_command(Path(run_dir)) if command is None else command
        options = [*([] if steps is None else ["--steps", str(steps)]), *extra]
        platform = self.platform or default_platform()
        env = {LAUNCHED_ENV: token, "JAX_PLATFORMS": platform}
        argv = self._argv(i, [*command, *options], platform, port="<port>")
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv)])

    def submit(self, submission: Submission) -> Job:
        """Locks the run directory, writes the submission's files, starts the workers."""
        platform = self.platform or default_platform()
        check_mesh(submission.mesh, self.processes, self._local_devices(platform))
        run_dir = submission.run_dir
        _one_process_per_tpu_host(self.processes, platform)
        what, target = submission.what, submission.target_steps
        lock = RunLock(run_dir)
        lock.acquire(what=what)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for name, text in submission.files.items():
                tmp = run_dir / f".{name}.tmp"
                tmp.write_text(text, encoding="utf-8")
                os.replace(tmp, run_dir / name)
            port = free_port()
            logs = run_dir / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            env = _child_env(platform, self.devices_per_process, lock.token or "")
            log_paths, commands = [], []
            for i in range(self.processes):
                argv = self._argv(i, [*submission.command, *submission.options], platform,
                                  port)
                log_path = logs / f"process-{i}.log"
                exit_file(log_path).unlink(missing_ok=True)
                with open(log_path, "ab") as log:
                    log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} launch: "
                              f"{shlex.join(argv)}\n".encode())
                    log.flush()
                    # own session: a Ctrl-C in the terminal/kernel reaches the launcher,
                    # which turns it into a coordinated stop, not N uncoordinated interrupts
                    procs.append(subprocess.Popen(
                        argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                        env={**env, EXIT_FILE_ENV: str(exit_file(log_path))},
                        cwd=os.getcwd(), start_new_session=True))
                log_paths.append(log_path)
                commands.append(argv)
            lock.update([p.pid for p in procs], what=what, platform=platform,
                        logs=[str(p) for p in log_paths], target_steps=target)
        except BaseException:
            for p in procs:
                p.kill()
            lock.release()
            raise
        return Job(run_dir, procs, log_paths, lock=lock, commands=commands,
                   devices_per_process=self.devices_per_process, platform=platform,
                   target_steps=target)

    @classmethod
    def recorded(cls, run_dir: Path) -> bool:
        """Whether ``run_dir`` holds a run-directory lock (``job.lock``)."""
        return RunLock(run_dir).path.exists()

    @classmethod
    def attach(cls, run_dir: Path) -> Job:
        """The processes running in ``run_dir`` on this host (their pids are in the lock).

        Raises:
          NoJobError: no running job holds ``run_dir`` on this host.
        """
        lock = RunLock(run_dir)
        holder = lock.read()
        if not holder or RunLock.holder_alive(holder) is not True:
            raise NoJobError(f"no job is running in run_dir={str(run_dir)!r} on this host (no "
                             f"live {lock.path}); read its results with workbench._runs")
        starts, pids = holder.get("starts") or {}, holder.get("pids", [])
        logs = [Path(p) for p in holder.get("logs") or
                [Path(run_dir) / "logs" / f"process-{i}.log" for i in range(len(pids))]]
        procs = [_Pid(p, starts.get(str(p)), exit_file(log)) for p, log in zip(pids, logs)]
        return Job(Path(run_dir), procs, logs, lock=None, attached=True,
                   platform=holder.get("platform"), target_steps=holder.get("target_steps"))
