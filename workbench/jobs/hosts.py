"""The same worker command on every host over ssh: plain hosts (``Hosts``) and the workers
of a Cloud TPU VM slice (``TPUSlice``, through ``gcloud compute tpus tpu-vm ssh``).

One local ``ssh`` process per host runs, on that host::

    cd <workdir> && export WORKBENCH_JOB=<token> ... && echo "[workbench] worker pid $$ ..." \\
      && exec <python> -m workbench train --config <run_dir>/config.json --run-dir <run_dir> \\
         --coordinator <host 0>:<port> --num-processes N --process-id i

Its output streams into ``<run_dir>/logs/process-<i>.log`` here, and ssh exits with the
worker's exit code, so the :class:`~workbench.jobs.Job` sees each worker end (a dead
worker, or a lost connection: 255) and stops the others. Signals go to the remote worker
itself (``ssh <host> kill -TERM <pid>``): ``job.stop()`` makes every worker checkpoint at
an agreed step. On a TPU slice every worker runs the same command through
``gcloud compute tpus tpu-vm ssh <name> --zone=<zone> --project=<project> --worker=<i>
--command=...``, and the workers join through ``jax.distributed.initialize()``'s Cloud TPU
detection (no coordinator on the command line).
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

from workbench.jobs import fields, storage
from workbench.jobs.job import Job, NoJobError, _Pid, exit_file
from workbench.run_lock import LAUNCHED_ENV, RunLock
from workbench.jobs.worker import EXIT_FILE_ENV

__all__ = ["Hosts", "HostsError", "TPUSlice", "attach_hosts"]

HOSTS_FILE = "hosts.json"
_PID_LINE = re.compile(r"^\[workbench\] worker pid (\d+) on ")


class HostsError(RuntimeError):
    """A host launch cannot start: ssh or gcloud is missing, or the slice is unknown."""


def _tool(name: str, fix: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise HostsError(f"`{name}` is not on PATH on this machine; {fix}")
    return path


class _FanOut:
    """What ``Hosts`` and ``TPUSlice`` share: start, watch and signal one worker per host."""

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
                       extra: Sequence[str] = ()) -> str:
        """The shell command worker ``i`` runs on its host (``steps``: train to this many
        steps; ``extra``: the launch's ``workbench train`` options, ``worker.train_args``)."""
        env = {LAUNCHED_ENV: token, "PYTHONUNBUFFERED": "1",
               EXIT_FILE_ENV: str(exit_file(run_dir / "logs" / f"process-{i}.log")),
               **({"JAX_PLATFORMS": self.platform} if self.platform else {}), **self.env}
        argv = [self.python or "python3", "-m", "workbench", "train", "--config",
                str(run_dir / "config.json"), "--run-dir", str(run_dir), *self.worker_args(i)]
        argv += [*([] if steps is None else ["--steps", str(steps)]), *extra]
        if self.platform:
            argv += ["--platform", self.platform]
        if self.devices_per_task and self.platform in ("cpu", None):
            argv += ["--devices-per-process", str(self.devices_per_task)]
        parts = [*self.setup, f"cd {fields.shell_path(self.workdir or os.getcwd())}",
                 "export " + " ".join(f"{k}={shlex.quote(str(v))}" for k, v in env.items()),
                 'echo "[workbench] worker pid $$ on $(hostname)"',
                 f"exec {fields.shell_path(argv[0])} {shlex.join(argv[1:])}"]
        return " && ".join(parts)

    def submit(self, run_dir: Path, config_text: str, *, extra: Sequence[str] = (),
               target_steps: int | None) -> Job:
        """Locks ``run_dir``, writes the config, starts one ssh per host; returns the Job."""
        self.remote_argv(0, "true")  # ssh / gcloud missing: say so before touching disk
        storage.warn_if_not_shared(run_dir, self.host_names())
        lock = RunLock(run_dir)
        lock.acquire(what="hosts")
        procs: list[Any] = []
        try:
            logs_dir = run_dir / "logs"
            logs_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.json").write_text(config_text, encoding="utf-8")
            logs, commands = [], []
            for i in range(self.tasks):
                log = logs_dir / f"process-{i}.log"
                exit_file(log).unlink(missing_ok=True)
                argv = self.remote_argv(i, self.remote_command(i, run_dir, lock.token or "",
                                                               extra=extra))
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
        tool = "ssh" if isinstance(self, Hosts) else "gcloud"
        while pending:
            for i in list(pending):
                rc = procs[i].popen.poll()   # before the log: an ended one has written all
                if _remote_pid(procs[i].log) is not None:
                    pending.remove(i)
                elif rc is not None:
                    tail = " | ".join(line.strip() for line in _log_lines(procs[i].log)[-4:])
                    raise HostsError(
                        f"worker {i} did not start on {hosts[i]}: {tool} exited with {rc} "
                        f"before the worker ran ({tail or 'no output'}; log "
                        f"{procs[i].log}). {self.start_fix(i)}")
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

    def signal_worker(self, i: int, log: Path, sig: int) -> None:
        """Sends ``sig`` to worker ``i`` on its host (its pid is the first line it printed)."""
        pid = _remote_pid(log)
        if pid is None:
            return
        name = signal.Signals(sig).name.removeprefix("SIG")
        subprocess.run(self.remote_argv(i, f"kill -{name} {pid}"), capture_output=True,
                       stdin=subprocess.DEVNULL, timeout=60, check=False)


def _log_lines(log: Path) -> list[str]:
    from workbench.jobs.job import read_tail

    return read_tail(log, 20, raw=True)


def _remote_pid(log: Path) -> int | None:
    from workbench.jobs.job import read_tail

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


@dataclasses.dataclass(frozen=True)
class Hosts(_FanOut):
    """Run the job on these hosts over ssh (``wb.launch(cfg, cluster=wb.Hosts([...]))``).

    Worker ``i`` runs on ``hosts[i]``; worker 0's host also runs the coordinator.

    Attributes:
      hosts: ssh destinations ("node1", "user@10.0.0.2"), one worker each.
      port: the ssh port (``-p``).
      identity: the private key (``-i``).
      ssh_options: further ssh arguments (``["-o", "ProxyJump=bastion"]``).
      coordinator_port: the port of worker 0's coordinator (default: a free one).
      devices_per_task: simulated CPU devices per worker (CPU); None: all devices.
      platform: "cpu", "gpu" or "tpu" (default: JAX's default on the host).
      python: the Python on the hosts (default ``python3``).
      workdir: the working directory on the hosts (default: this one).
      env: environment variables for the workers.
      setup: shell commands run first on each host (``source venv/bin/activate``), one
        line each.
      connect_timeout: seconds ssh may take to connect (``ConnectTimeout``); a host that
        does not answer fails the launch after this long.
      start_timeout: seconds ``launch`` waits for every worker to start on its host (ssh
        connected and the setup lines done) before it stops them and says which did not.
    """

    hosts: Sequence[str]
    _: dataclasses.KW_ONLY
    port: int | None = None
    identity: str | None = None
    ssh_options: Sequence[str] = ()
    coordinator_port: int | None = None
    devices_per_task: int | None = None
    platform: str | None = None
    python: str | None = None
    workdir: str | None = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    setup: Sequence[str] = ()
    connect_timeout: int = 20
    start_timeout: float = 120

    def __post_init__(self) -> None:
        where, set_ = "wb.Hosts", object.__setattr__
        if isinstance(self.hosts, (str, bytes)) or not isinstance(self.hosts, (list, tuple)) \
                or not self.hosts:
            raise ValueError(f"wb.Hosts({self.hosts!r}): pass a non-empty list of hosts, "
                             "e.g. wb.Hosts(['node1', 'node2'])")
        set_(self, "hosts", tuple(fields.host(h, i) for i, h in enumerate(self.hosts)))
        for name in ("port", "coordinator_port"):
            fields.optional_int(getattr(self, name), name, where, maximum=65535,
                                fix=f"give a TCP port from 1 to 65535, or {name}=None")
        if self.identity is not None:
            set_(self, "identity", fields.one_line(self.identity, "identity", where,
                                                   example="'~/.ssh/id_ed25519'", paths=True))
        set_(self, "ssh_options", fields.lines(self.ssh_options, "ssh_options", where,
                                               example="['-o', 'ProxyJump=bastion']"))
        fields.fanout(self, where)
        if self.coordinator_port is None:
            set_(self, "coordinator_port", _free_port())

    @property
    def tasks(self) -> int:
        return len(self.hosts)

    def host_names(self) -> list[str]:
        return [h.rpartition("@")[2] for h in self.hosts]

    def remote_argv(self, i: int, command: str) -> list[str]:
        ssh = _tool("ssh", "install OpenSSH's client (Debian: `apt-get install "
                           "openssh-client`)")
        # ssh keeps the first value it reads for an option: the user's come first
        argv = [ssh, *self.ssh_options, "-o", "BatchMode=yes",
                "-o", f"ConnectTimeout={self.connect_timeout}",
                "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=3"]
        if self.port:
            argv += ["-p", str(self.port)]
        if self.identity:
            argv += ["-i", str(self.identity)]
        return [*argv, self.hosts[i], command]

    def start_fix(self, i: int) -> str:
        port = f"-p {self.port} " if self.port else ""
        return (f"Check that `ssh {port}{self.hosts[i]} true` works from here without a "
                "password (BatchMode: a key in ssh-agent, or identity=), that the host is up "
                f"and sshd listens; a host that does not answer fails after connect_timeout="
                f"{self.connect_timeout} s")

    def worker_args(self, i: int) -> list[str]:
        if self.tasks == 1:
            return ["--distributed", "off"]
        return ["--coordinator", f"{self.host_names()[0]}:{self.coordinator_port}",
                "--num-processes", str(self.tasks), "--process-id", str(i)]


@dataclasses.dataclass(frozen=True)
class TPUSlice(_FanOut):
    """Run the job on every worker of a Cloud TPU VM slice (``wb.TPUSlice(name, zone, project)``).

    Each worker runs ``gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --project=PROJECT
    --worker=I --command=CMD`` (one per worker, so each has its own log and its own
    stop); the workers join through ``jax.distributed.initialize()``'s Cloud TPU detection.
    ``workers`` (the number of hosts) is read with ``gcloud compute tpus tpu-vm describe``
    unless given.

    Attributes:
      name, zone, project: the TPU VM.
      workers: hosts in the slice (e.g. 4 for a v5p-32); None: ask gcloud.
      python, workdir, env, setup: as in :class:`Hosts`.
      gcloud: the gcloud executable.
      ssh_flags: further ``gcloud ... ssh`` flags (``["--internal-ip"]``, ``["--tunnel-through-iap"]``).
      connect_timeout, start_timeout: as in :class:`Hosts` (ssh's ``ConnectTimeout``
        reaches it through ``--ssh-flag``).
    """

    name: str
    zone: str
    project: str | None = None
    _: dataclasses.KW_ONLY
    workers: int | None = None
    python: str | None = None
    workdir: str | None = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    setup: Sequence[str] = ()
    gcloud: str = "gcloud"
    ssh_flags: Sequence[str] = ()
    platform: str | None = "tpu"
    devices_per_task: int | None = None
    connect_timeout: int = 30
    start_timeout: float = 300

    def __post_init__(self) -> None:
        where, set_ = "wb.TPUSlice", object.__setattr__
        fields.word(self.name, "name", where, example="'my-v5p'")
        fields.word(self.zone, "zone", where, example="'us-east5-a'")
        if self.project is not None:
            fields.word(self.project, "project", where, example="'my-project'")
        fields.optional_int(self.workers, "workers", where,
                            fix="give the number of hosts in the slice (e.g. 4 for a "
                                "v5p-32), or workers=None to ask gcloud")
        set_(self, "gcloud", fields.one_line(self.gcloud, "gcloud", where,
                                             example="'/usr/bin/gcloud'", paths=True))
        set_(self, "ssh_flags", fields.lines(self.ssh_flags, "ssh_flags", where,
                                             example="['--internal-ip']"))
        fields.fanout(self, where)

    def _gcloud(self) -> str:
        return _tool(self.gcloud, "install the Google Cloud CLI (cloud.google.com/sdk: "
                                  "`apt-get install google-cloud-cli` from Google's apt "
                                  "repository) and run `gcloud auth login`, or pass "
                                  "wb.TPUSlice(gcloud='/path/to/gcloud')")

    def _where(self) -> list[str]:
        return [f"--zone={self.zone}", *([f"--project={self.project}"] if self.project else [])]

    def describe_argv(self) -> list[str]:
        """The command that lists the slice's workers."""
        return [self._gcloud(), "compute", "tpus", "tpu-vm", "describe", self.name,
                *self._where(), "--format=json"]

    @property
    def tasks(self) -> int:
        if self.workers is None:
            out = subprocess.run(self.describe_argv(), capture_output=True, text=True,
                                 timeout=120, check=False)
            if out.returncode != 0:
                raise HostsError(f"`{shlex.join(self.describe_argv())}` failed: "
                                 f"{out.stderr.strip()[-500:]}; check the name, zone and "
                                 "project (`gcloud compute tpus tpu-vm list --zone=...`)")
            endpoints = json.loads(out.stdout).get("networkEndpoints") or []
            object.__setattr__(self, "workers", max(1, len(endpoints)))
        return int(self.workers)  # type: ignore[arg-type]

    def host_names(self) -> list[str]:
        return [f"{self.name}-worker-{i}" for i in range(self.tasks)]

    def remote_argv(self, i: int, command: str) -> list[str]:
        # ssh keeps the first value it reads for an option: the user's flags come first
        return [self._gcloud(), "compute", "tpus", "tpu-vm", "ssh", self.name, *self._where(),
                f"--worker={i}", f"--command={command}", *self.ssh_flags,
                f"--ssh-flag=-oConnectTimeout={self.connect_timeout}",
                "--ssh-flag=-oServerAliveInterval=15", "--ssh-flag=-oServerAliveCountMax=3"]

    def start_fix(self, i: int) -> str:
        argv = [self.gcloud, "compute", "tpus", "tpu-vm", "ssh", self.name, *self._where(),
                f"--worker={i}", "--command=true"]
        return (f"Check that `{shlex.join(argv)}` works from here (`gcloud auth login`; "
                "the slice's name, zone and project: `gcloud compute tpus tpu-vm list "
                f"--zone={self.zone}`)")

    def all_workers_argv(self, command: str) -> list[str]:
        """The one-command equivalent: ``--worker=all`` (every worker's output interleaved)."""
        return [self._gcloud(), "compute", "tpus", "tpu-vm", "ssh", self.name, *self._where(),
                "--worker=all", *self.ssh_flags, f"--command={command}"]

    def worker_args(self, i: int) -> list[str]:
        return ["--distributed", "on"]  # JAX's Cloud TPU detection finds the coordinator


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _asdict(cluster: _FanOut) -> dict[str, Any]:
    d = dataclasses.asdict(cluster)  # type: ignore[call-overload]
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def attach_hosts(run_dir: Path) -> Job:
    """Watches the ssh job recorded in ``run_dir/hosts.json`` (started from this host)."""
    record = json.loads((run_dir / HOSTS_FILE).read_text(encoding="utf-8"))
    lock = RunLock(run_dir)
    holder = lock.read() or {}
    if RunLock.holder_alive(holder) is not True:
        raise NoJobError(f"no ssh job is running in run_dir={str(run_dir)!r} from this "
                               f"host (no live {lock.path}); read its results with "
                               "workbench.runs")
    cls = {"Hosts": Hosts, "TPUSlice": TPUSlice}[record["launcher"]]
    cluster = cls(**record["cluster"])
    starts = holder.get("starts") or {}
    logs = [Path(p) for p in record["logs"]]
    procs = [_AttachedRemote(_Pid(pid, starts.get(str(pid)), exit_file(log)), cluster, i, log)
             for i, (pid, log) in enumerate(zip(record["ssh_pids"], logs))]
    return Job(run_dir, procs, logs, lock=None, attached=True, platform=record.get("platform"),
               target_steps=record.get("target_steps"))


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

