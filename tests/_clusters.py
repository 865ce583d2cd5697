"""Real schedulers and servers on loopback for the cluster tests: SLURM (munge, slurmctld,
slurmd) and OpenSSH's sshd, each started in a temporary folder and stopped afterwards.

Both come from Debian (``make clusters`` installs slurm-wlm, munge and openssh-server; ``make
test`` runs it first). Where they are missing the tests skip with that fix, except in CI
(``CI=true``), where a missing scheduler fails the run instead of hiding it.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo",
                  "scancel", "srun")
SSH_BINARIES = ("sshd", "ssh", "ssh-keygen")
_SBIN = ("/usr/sbin", "/sbin")


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (f"{d}/{name}" for d in _SBIN if os.access(f"{d}/{name}", os.X_OK)), None)


def require(binaries: tuple[str, ...], what: str) -> dict[str, str]:
    """Paths of ``binaries``; skips (fails under CI=true) naming the fix when one is missing."""
    found = {b: _which(b) for b in binaries}
    missing = [b for b, p in found.items() if p is None]
    if missing:
        msg = (f"{what} is not installed (missing {', '.join(missing)}); run `make clusters` "
               "as root (apt-get install --no-install-recommends slurm-wlm munge openssh-server)")
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg)
        pytest.skip(msg)
    if os.geteuid() != 0:
        msg = f"{what} tests start daemons as root (slurmd, sshd); run them as root"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg)
        pytest.skip(msg)
    return {b: str(p) for b, p in found.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(pred, timeout: float, what: str, logs: list[Path]) -> None:
    t_end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > t_end:
            tails = "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}"
                              for p in logs if p.exists())
            raise RuntimeError(f"{what} not ready within {timeout} s\n{tails}")
        time.sleep(0.2)


#: One node, two partitions (``urgent`` preempts ``debug`` by requeueing its jobs). The
#: schedulers run every second (``sched_interval``, ``bf_interval``; SLURM's defaults are
#: 60 and 30 s): a pending job whose start time (``--begin``, a requeue's hold released by
#: ``scontrol``) passes without another event waited for the next periodic pass, with the
#: node idle. Measured on one core, tests/test_clusters.py: 253 -> 174 s (the preempted job
#: 80 -> 45 s, the requeue on a signal 78 -> 58 s), the same states and losses checked.
SLURM_CONF = """\
ClusterName=workbench-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket}
StateSaveLocation={state}
SlurmdSpoolDir={spool}
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
KillWait=30
MinJobAge=600
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=urgent Nodes={host} MaxTime=INFINITE State=UP PriorityTier=10
"""


class LocalSlurm:
    """munged + slurmctld + slurmd on 127.0.0.1, configured in ``root``; ``env`` points the
    SLURM commands at it (``SLURM_CONF``)."""

    def __init__(self, root: Path) -> None:
        self.bins = require(SLURM_BINARIES, "SLURM (slurm-wlm + munge)")
        self.root, self.procs = root, []
        self.host = socket.gethostname().split(".")[0]
        self.cpus = os.cpu_count() or 1
        self.conf = root / "slurm.conf"
        self.env = {"SLURM_CONF": str(self.conf)}

    def start(self) -> LocalSlurm:
        r = self.root
        for d in ("state", "spool", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        (r / "munge").chmod(0o700)
        sock = r / "munge" / "munge.socket"
        self._spawn([self.bins["munged"], "-F", "-f", f"--socket={sock}", f"--key-file={key}",
                     f"--pid-file={r}/munge/munged.pid", f"--log-file={r}/munge/munged.log",
                     f"--seed-file={r}/munge/munged.seed"], r / "munged.out")
        _wait(sock.exists, 20, "munged", [r / "munge" / "munged.log", r / "munged.out"])
        self.conf.write_text(SLURM_CONF.format(
            host=self.host, ctld_port=free_port(), slurmd_port=free_port(), socket=sock,
            state=r / "state", spool=r / "spool", root=r, cpus=self.cpus))
        env = {**os.environ, **self.env}
        self._spawn([self.bins["slurmctld"], "-D", "-i", "-f", str(self.conf)],
                    r / "slurmctld.out", env)
        self._spawn([self.bins["slurmd"], "-D", "-f", str(self.conf)], r / "slurmd.out", env)
        logs = [r / "slurmctld.log", r / "slurmd.log", r / "slurmctld.out", r / "slurmd.out"]
        _wait(lambda: self._node_state() in ("idle", "mixed", "allocated"), 60,
              "the SLURM node", logs)
        return self

    def _node_state(self) -> str:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[0]} exited with {p.returncode}; see {self.root}")
        out = subprocess.run([self.bins["sinfo"], "-h", "-N", "-o", "%T"], capture_output=True,
                             text=True, env={**os.environ, **self.env}, check=False)
        states = {line.strip().rstrip("*~#") for line in out.stdout.split()}  # one per partition
        return states.pop() if len(states) == 1 else ""

    def _spawn(self, argv: list[str], out: Path, env: dict[str, str] | None = None) -> None:
        with open(out, "ab") as f:
            self.procs.append(subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, env=env,
                                               start_new_session=True))

    def stop(self) -> None:
        """Cancels what is left and ends the daemons (slurmd, slurmctld, munged)."""
        subprocess.run([self.bins["scancel"], "--full", "-u", "root"], check=False,
                       capture_output=True, env={**os.environ, **self.env})
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


SSHD_CONFIG = """\
Port {port}
ListenAddress 127.0.0.1
HostKey {root}/host_key
PidFile {root}/sshd.pid
AuthorizedKeysFile {root}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
AcceptEnv none
LogLevel ERROR
"""


def running_slurm(directory: Path):
    """A started :class:`LocalSlurm` in ``directory`` with ``SLURM_CONF`` pointing at it
    for the caller's tests (a generator for a module fixture: yields the cluster, then
    stops it and puts ``SLURM_CONF`` back)."""
    cluster = LocalSlurm(directory).start()
    old = os.environ.get("SLURM_CONF")
    os.environ.update(cluster.env)
    try:
        yield cluster
    finally:
        cluster.stop()
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


class LocalSshd:
    """OpenSSH's sshd on 127.0.0.1 at a high port, with a key pair made for this test only."""

    def __init__(self, root: Path) -> None:
        self.bins = require(SSH_BINARIES, "OpenSSH (openssh-server)")
        self.root, self.port, self.proc = root, free_port(), None
        self.key = root / "client_key"

    def start(self) -> LocalSshd:
        r = self.root
        r.mkdir(parents=True, exist_ok=True)
        r.chmod(0o700)
        for name in ("host_key", "client_key"):
            subprocess.run([self.bins["ssh-keygen"], "-q", "-t", "ed25519", "-N", "", "-f",
                            str(r / name)], check=True)
        (r / "authorized_keys").write_text((r / "client_key.pub").read_text())
        (r / "sshd_config").write_text(SSHD_CONFIG.format(port=self.port, root=r))
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege separation dir
        with open(r / "sshd.out", "ab") as f:
            self.proc = subprocess.Popen([self.bins["sshd"], "-D", "-e", "-f",
                                          str(r / "sshd_config")], stdout=f,
                                         stderr=subprocess.STDOUT, start_new_session=True)

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {(r / 'sshd.out').read_text()}")
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        _wait(ready, 20, "sshd", [r / "sshd.out"])
        return self

    @property
    def options(self) -> list[str]:
        """ssh options that reach this server with the test's key, trusting its host key."""
        return ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "LogLevel=ERROR"]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
