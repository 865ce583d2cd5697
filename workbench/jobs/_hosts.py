"""The same worker command on every host over ssh: plain hosts (``Hosts``) and the workers
of a Cloud TPU VM slice (``TPUSlice``, through ``gcloud compute tpus tpu-vm ssh``).

Both are :class:`~workbench.jobs.Cluster` kinds; what they share (starting one ssh per
host, watching it, signalling the remote worker, finding the job again) is
``workbench.jobs._fanout``. Worker ``i`` of ``Hosts`` runs on ``hosts[i]`` and joins the
coordinator on the first host; on a TPU slice every worker runs the same command through
``gcloud compute tpus tpu-vm ssh <name> --zone=<zone> --project=<project> --worker=<i>
--command=...``, and the workers join through ``jax.distributed.initialize()``'s Cloud TPU
detection (no coordinator on the command line).
"""
from __future__ import annotations

import dataclasses
import json
import shlex
import socket
import subprocess
from collections.abc import Mapping, Sequence
from typing import ClassVar

from workbench.jobs import _fields as fields
from workbench.jobs._fanout import HOSTS_FILE, HostsError, _FanOut, tool_path
from workbench.jobs._fanout import _remote_pid  # noqa: F401 - tests read it from here

__all__ = ["HOSTS_FILE", "Hosts", "HostsError", "TPUSlice"]


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

    tool: ClassVar[str] = "ssh"
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
        ssh = tool_path("ssh", "install OpenSSH's client (Debian: `apt-get install "
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
      ssh_flags: further ``gcloud ... ssh`` flags (``["--internal-ip"]``,
        ``["--tunnel-through-iap"]``).
      connect_timeout, start_timeout: as in :class:`Hosts` (ssh's ``ConnectTimeout``
        reaches it through ``--ssh-flag``).
    """

    tool: ClassVar[str] = "gcloud"
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
        return tool_path(self.gcloud, "install the Google Cloud CLI (cloud.google.com/sdk: "
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
