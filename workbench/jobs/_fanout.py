"""Starting, watching and stopping one worker per host over ssh: what ``Hosts`` and
``TPUSlice`` (``workbench.jobs._hosts``) share.

One local ``ssh`` process per host runs, on that host::

    cd <workdir> && export WORKBENCH_JOB=<token> ... && echo "[workbench] worker pid $$ ..." \\
      && exec <python> -m workbench train --config <run_dir>/config.json --run-dir <run_dir> \\
         --coordinator <host 0>:<port> --num-processes N --process-id i

Its output streams into ``<run_dir>/logs/process-<i>.log`` here, and ssh exits with the
worker's exit code, so the :class:`~workbench.jobs.Job` sees each worker end (a dead
worker, or a lost connection: 255) and stops the others. Signals go to the remote worker
itself (``ssh <host> kill -TERM <pid>``): ``job.stop()`` makes every worker checkpoint at
an agreed step. ``<run_dir>/hosts.json`` records the cluster and the ssh pids, so
``attach`` finds the job again from this host.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from workbench.jobs import _storage as storage
from workbench.jobs._fields import shell_path
from workbench.jobs._job import Job, NoJobError, _Pid, exit_file, read_tail
from workbench.jobs._protocol import Submission, check_mesh
from workbench.jobs._worker import EXIT_FILE_ENV, train_command
from workbench._run_lock import LAUNCHED_ENV, RunLock

__all__ = ["HOSTS_FILE", "HostsError"]

HOSTS_FILE = "hosts.json"
_PID_LINE = re.compile(r"^\[workbench\] worker pid (\d+) on ")


class HostsError(RuntimeError):
    """A host launch cannot start: ssh or gcloud is missing, or the slice is unknown."""


def tool_path(name: str, fix: str) -> str:
    """The path of ``name`` on PATH, or a :class:`HostsError` with ``fix``."""
    path = shutil.which(name)
    if path is None:
        raise HostsError(f"`{name}` is not on PATH on this machine; {fix}")
    return path


def _launcher(run_dir: Path) -> str | None:
    """The kind ``hosts.json`` names ("Hosts", "TPUSlice"), None without one; an unreadable
    record counts as ``Hosts`` (its attach then says what is wrong with it)."""
    try:
        return json.loads((run_dir / HOSTS_FILE).read_text(encoding="utf-8"))["launcher"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return "Hosts"


class _FanOut:
    """What ``Hosts`` and ``TPUSlice`` share: start, watch and signal one worker per host,
    and find the job again (``hosts.json`` names the kind that started it)."""

    tool: str   # what starts a worker on its host: "ssh" or "gcloud"
    tasks: int
    devices_per_task: int | None
    platform: str | None
    python: str | None
    workdir: str | None
    env: Mapping[str, str]
    setup: Sequence[str]
    connect_timeout: int
    start_timeout: float

    def remote_argv(self, i: int, command: str) -> list[str]:
        raise NotImplementedError

    def worker_args(self, i: int) -> list[str]:
        raise NotImplementedError

    def host_names(self) -> list[str]:
        raise NotImplementedError

    def start_fix(self, i: int) -> str:
        """What to check when worker ``i`` could not be started."""
        raise NotImplementedError

    def remote_command(self, i: int, run_dir: Path, token: str, *, steps: int | None = None,
                       extra: Sequence[str] = (),
                       command: Sequence[str] | None = None) -> str:
        """The shell command worker ``i`` runs on its host (``steps``: train to this many
        steps; ``extra``: the launch's ``workbench train`` options, ``worker.train_args``;
        ``command``: another worker subcommand instead of ``train``, e.g. ``ping``)."""
        env = {LAUNCHED_ENV: token, "PYTHONUNBUFFERED": "1",
               EXIT_FILE_ENV: str(exit_file(run_dir / "logs" / f"process-{i}.log")),
               **({"JAX_PLATFORMS": self.platform} if self.platform else {}), **self.env}
        command = train_command(run_dir) if command is None else command
        argv = [self.python or "python3", "-m", "workbench", *command, *self.worker_args(i),
                *([] if steps is None else ["--steps", str(steps)]), *extra]
        if self.platform:
            argv += ["--platform", self.platform]
        if self.devices_per_task and self.platform in ("cpu", None):
            argv += ["--devices-per-process", str(self.devices_per_task)]
        parts = [*self.setup, f"cd {shell_path(self.workdir or os.getcwd())}",
                 "export " + " ".join(f"{k}={shlex.quote(str(v))}" for k, v in env.items()),
                 'echo "[workbench] worker pid $$ on $(hostname)"',
                 f"exec {shell_path(argv[0])} {shlex.join(argv[1:])}"]
        return " && ".join(parts)

    def submit(self, submission: Submission) -> Job:
        """Locks the run directory, writes the submission's files, starts one ssh per
        host; returns the Job once every worker has started on its host."""
        run_dir, target_steps = submission.run_dir, submission.target_steps
        self.remote_argv(0, "true")  # ssh / gcloud missing: say so before touching disk
        check_mesh(submission.mesh, self.tasks, self.devices_per_task)
        storage.warn_if_not_shared(run_dir, self.host_names())
        lock = RunLock(run_dir)
        lock.acquire(what="hosts")
        procs: list[Any] = []
        try:
            logs_dir = run_dir / "logs"
            logs_dir.mkdir(parents=True, exist_ok=True)
            for name, text in submission.files.items():
                (run_dir / name).write_text(text, encoding="utf-8")
            logs, commands = [], []
            for i in range(self.tasks):
                log = logs_dir / f"process-{i}.log"
                exit_file(log).unlink(missing_ok=True)
                argv = self.remote_argv(i, self.remote_command(
                    i, run_dir, lock.token or "", extra=submission.options,
                    command=submission.command))
                with open(log, "ab") as f:
                    f.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} launch: "
                            f"{shlex.join(argv)}\n".encode())
                    f.flush()
                    procs.append(_Remote(subprocess.Popen(
                        argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                        start_new_session=True), self, i, log))
                logs.append(log)
                commands.append(argv)
            record = {"launcher": type(self).__name__, "cluster": _asdict(self),
                      "ssh_pids": [p.pid for p in procs], "logs": [str(p) for p in logs],
                      "target_steps": target_steps, "host": socket.gethostname()}
            (run_dir / HOSTS_FILE).write_text(json.dumps(record, indent=1), encoding="utf-8")
            lock.update([p.pid for p in procs], what="hosts", logs=[str(p) for p in logs],
                        target_steps=target_steps, platform=self.platform)
            self._wait_started(procs)
        except BaseException:
            for p in procs:
                if p.popen.poll() is None and _remote_pid(p.log) is not None:
                    p.send_signal_remote(signal.SIGKILL)   # the worker on its host, too
                p.popen.kill()
                p.popen.wait()
            lock.release()
            raise
        return Job(run_dir, procs, logs, lock=lock, commands=commands,
                   devices_per_process=self.devices_per_task, platform=self.platform,
                   target_steps=target_steps)

    def _wait_started(self, procs: list[_Remote]) -> None:
        """Waits until every worker printed its pid on its host (ssh connected and the
        setup lines ran), at most ``start_timeout`` seconds.

        Raises:
          HostsError: a worker's ssh (or gcloud) ended before its worker started, or one
            has not started in time; the message names the host, the log and what to check.
        """
        t_end = time.monotonic() + self.start_timeout
        pending = list(range(len(procs)))
        hosts = self.host_names()
        while pending:
            for i in list(pending):
                rc = procs[i].popen.poll()   # before the log: an ended one has written all
                if _remote_pid(procs[i].log) is not None:
                    pending.remove(i)
                elif rc is not None:
                    raise HostsError(self._start_failure(procs, pending))
            if pending and time.monotonic() > t_end:
                names = ", ".join(f"{i} ({hosts[i]})" for i in pending)
                raise HostsError(
                    f"worker(s) {names} did not start within start_timeout="
                    f"{self.start_timeout:g} s: no '[workbench] worker pid' line in "
                    f"{procs[pending[0]].log}. The host may be unreachable or a setup line "
                    f"may wait for input. {self.start_fix(pending[0])}; if the setup lines "
                    "take longer, raise start_timeout")
            if pending:
                time.sleep(0.05)

    def _start_failure(self, procs: list[_Remote], pending: list[int],
                       grace: float = 1.0) -> str:
        """The message for workers whose ssh (or gcloud) ended before they started: every
        pending one that has ended within ``grace`` seconds of the first, in worker order
        (two hosts that fail alike fail in either order; the message starts with the
        lowest), each with its exit status and the last lines of its log."""
        t_end = time.monotonic() + grace
        while True:
            ended = [i for i in pending if _remote_pid(procs[i].log) is None
                     and procs[i].popen.poll() is not None]
            if len(ended) == len(pending) or time.monotonic() > t_end:
                break
            time.sleep(0.05)
        hosts, tool = self.host_names(), self.tool

        def why(i: int) -> str:
            tail = " | ".join(line.strip() for line in _log_lines(procs[i].log)[-4:])
            return (f"{tool} exited with {procs[i].popen.returncode} before the worker ran "
                    f"({tail or 'no output'}; log {procs[i].log})")

        first, *others = ended
        also = "".join(f"; worker {i} did not start on {hosts[i]} either: {why(i)}"
                       for i in others)
        return (f"worker {first} did not start on {hosts[first]}: {why(first)}{also}. "
                f"{self.start_fix(first)}")

    def signal_worker(self, i: int, log: Path, sig: int) -> None:
        """Sends ``sig`` to worker ``i`` on its host (its pid is the first line it printed)."""
        pid = _remote_pid(log)
        if pid is None:
            return
        name = signal.Signals(sig).name.removeprefix("SIG")
        subprocess.run(self.remote_argv(i, f"kill -{name} {pid}"), capture_output=True,
                       stdin=subprocess.DEVNULL, timeout=60, check=False)

    @classmethod
    def recorded(cls, run_dir: Path) -> bool:
        """Whether ``run_dir/hosts.json`` records a job started by this kind."""
        return _launcher(run_dir) == cls.__name__

    @classmethod
    def attach(cls, run_dir: Path) -> Job:
        """Watches the ssh job recorded in ``run_dir/hosts.json`` (started from this host).

        Raises:
          NoJobError: its workers are not running any more.
        """
        record = json.loads((run_dir / HOSTS_FILE).read_text(encoding="utf-8"))
        lock = RunLock(run_dir)
        holder = lock.read() or {}
        if RunLock.holder_alive(holder) is not True:
            raise NoJobError(f"no ssh job is running in run_dir={str(run_dir)!r} from this "
                             f"host (no live {lock.path}); read its results with "
                             "workbench._runs")
        kind = {k.__name__: k for k in _FanOut.__subclasses__()}[record["launcher"]]
        cluster = kind(**record["cluster"])
        starts = holder.get("starts") or {}
        logs = [Path(p) for p in record["logs"]]
        procs = [_AttachedRemote(_Pid(pid, starts.get(str(pid)), exit_file(log)), cluster, i,
                                 log)
                 for i, (pid, log) in enumerate(zip(record["ssh_pids"], logs))]
        return Job(run_dir, procs, logs, lock=None, attached=True,
                   platform=record.get("platform"), target_steps=record.get("target_steps"))


def _log_lines(log: Path) -> list[str]:
    return read_tail(log, 20, raw=True)


def _remote_pid(log: Path) -> int | None:
    for line in read_tail(log, 10**6, raw=True):
        m = _PID_LINE.match(line)
        if m:
            return int(m.group(1))
    return None


class _Remote:
    """The local ssh process of worker ``i``; signals reach the remote worker."""

    def __init__(self, popen: Any, cluster: _FanOut, i: int, log: Path) -> None:
        self.popen, self.cluster, self.i, self.log = popen, cluster, i, log
        self.pid = popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        return self.popen.poll()

    def send_signal_remote(self, sig: int) -> None:
        try:
            self.cluster.signal_worker(self.i, self.log, sig)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if sig == signal.SIGKILL and self.popen.poll() is None:
            self.popen.kill()  # the connection too: nothing is left to wait for


def _asdict(cluster: _FanOut) -> dict[str, Any]:
    d = dataclasses.asdict(cluster)  # type: ignore[call-overload]
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


class _AttachedRemote(_Remote):
    def poll(self) -> int | None:
        return self.popen.poll()

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def send_signal_remote(self, sig: int) -> None:
        try:
            self.cluster.signal_worker(self.i, self.log, sig)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if sig == signal.SIGKILL:
            try:
                os.kill(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

