"""The run-directory lock: one writer at a time per run directory, whoever it is (the runs
layer: the Trainer and the launchers both take it).

Every writer of a run directory takes ``<run_dir>/job.lock`` while it writes: a
``wb.launch`` launcher for its whole job (its workers find the lock's token in their
environment and write under it), a ``wb.Trainer`` (in a notebook, a script or ``python -m
workbench train``) while it restores, moves a damaged checkpoint aside or runs. The file
is created atomically (``O_CREAT | O_EXCL``) and holds the host, the pid (and a launch's
worker pids), their start times, when it was taken, what holds it and a random token.

A second writer is refused (:class:`JobRunningError`) with who holds it (pid, host, since
when) and how to proceed. A lock whose processes are all dead on this host is stale and is
taken over with a warning; a lock from another host cannot be checked from here: the error
says how to clear it by hand. Within one process, a second holder is refused only while
the first one holds it (e.g. a Trainer running in another thread). Locks held for a block
(:meth:`RunLock.hold`) are released at interpreter exit; a launcher's lock stays while its
workers live. A directory that cannot be written raises :class:`RunDirNotWritable` with
the path and the fix, before anything else is touched.
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import socket
import subprocess
import threading
import time
import uuid
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from workbench._runs import pid_alive, pid_start_time, read_run

__all__ = ["LAUNCHED_ENV", "JobRunningError", "RunDirNotWritable", "RunLock", "pid_alive"]

LOCK_NAME = "job.lock"
#: Set by the local launcher in its workers' environment: the token of the lock it holds.
LAUNCHED_ENV = "WORKBENCH_JOB"

_HELD: dict[str, RunLock] = {}       # lock path -> the RunLock of this process holding it
_HELD_MUTEX = threading.Lock()
_AT_EXIT: list[bool] = []            # [True] once _release_all is registered (first lock)


_SLURM_FINAL = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED")


def slurm_job_alive(job_id: str, conf: str | None = None) -> bool | None:
    """Whether SLURM job ``job_id`` is still queued or running (``squeue``); None when
    squeue is missing or does not answer (then nobody here can tell)."""
    env = dict(os.environ, **({"SLURM_CONF": conf} if conf and os.path.exists(conf) else {}))
    try:
        out = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"],
                             capture_output=True, text=True, timeout=30, env=env, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return False if "Invalid job id" in out.stderr else None
    states = out.stdout.split()
    return bool(states) and states[0] not in _SLURM_FINAL


class JobRunningError(RuntimeError):
    """Another writer (a job or a trainer) holds this run directory right now."""


class RunDirNotWritable(PermissionError):
    """The run directory (or its lock file) cannot be created or written."""


def _release_all() -> None:
    """At interpreter exit: removes the locks this process holds for a block (a Trainer's);
    a launcher's lock stays while its workers live (``attach`` finds them after a restart)."""
    with _HELD_MUTEX:
        held = [lock for lock in _HELD.values() if lock._depth]
    for lock in held:
        with contextlib.suppress(Exception):
            lock.release()


def _held(lock: RunLock) -> None:
    """Records ``lock`` as held by this process; the first one registers
    :func:`_release_all` at exit (importing this module registers nothing)."""
    with _HELD_MUTEX:
        _HELD[lock._key()] = lock
        if not _AT_EXIT:
            atexit.register(_release_all)
            _AT_EXIT.append(True)


class RunLock:
    """``<run_dir>/job.lock``: refuses a second writer in a run directory.

    Args:
      run_dir: the run directory (created by :meth:`acquire` if missing).

    Example::

        lock = RunLock("runs/tiny")
        with lock.hold(what="trainer"):
            ...   # write checkpoints and metrics
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.held = False
        self.token: str | None = None
        self._depth = 0

    # ------------------------------------------------------------------ reading
    def read(self) -> dict[str, Any] | None:
        """The current holder (``host``, ``pid``, ``pids``, ``created``, ...), or None."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RecursionError):
            return {"host": None, "pid": None, "pids": [], "corrupt": True}
        return data if isinstance(data, dict) else {"host": None, "pid": None, "pids": [],
                                                    "corrupt": True}

    @staticmethod
    def holder_alive(holder: dict[str, Any]) -> bool | None:
        """True/False for a holder on this host; None when it is on another host.

        A lock held for a SLURM job (``slurm_job``) lives as long as the job does, wherever
        it runs: SLURM says (``squeue``); None when no SLURM command answers here.
        """
        if holder.get("slurm_job"):
            return slurm_job_alive(str(holder["slurm_job"]), holder.get("slurm_conf"))
        if holder.get("host") != socket.gethostname():
            return None
        starts = holder.get("starts") if isinstance(holder.get("starts"), dict) else {}
        pids = holder.get("pids") if isinstance(holder.get("pids"), list) else []
        return any(pid_alive(p, starts.get(str(p))) for p in [holder.get("pid"), *pids])

    def covered_by_launcher(self) -> bool:
        """Whether this process is a worker of the launched job that holds the lock (its
        environment carries the lock's token): it writes under the launcher's lock."""
        token = os.environ.get(LAUNCHED_ENV)
        if not token:
            return False
        holder = self.read() or {}
        return holder.get("token") == token and self.holder_alive(holder) is not False

    # ------------------------------------------------------------------ taking
    def acquire(self, pids: Iterable[int] = (), **info: Any) -> None:
        """Takes the lock for this process (and ``pids``), or raises if a live writer holds it.

        Args:
          pids: further processes the lock stands for (a launch's workers).
          **info: recorded in the lock file (``what``: "train", "ping", "trainer", ...).

        Raises:
          JobRunningError: a live writer holds the lock, or one on another host does.
          RunDirNotWritable: the run directory or its lock file cannot be written.
        """
        self._make_dir()
        self._refuse_running_trainer()
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self.read() or {}
                if self._mine(holder):
                    other = _HELD.get(self._key())
                    if other is not None and other is not self and other.held:
                        raise JobRunningError(self._busy_message(holder, True, here=True)) \
                            from None
                    self._remove()   # left behind by this process: no other holder here
                    continue
                alive = self.holder_alive(holder)
                if alive is False or holder.get("corrupt"):
                    what = "unreadable" if holder.get("corrupt") else (
                        f"its writer (pid {holder.get('pid')}, workers {holder.get('pids')}) "
                        "is no longer running")
                    warnings.warn(f"taking over the stale lock {self.path}: {what}",
                                  stacklevel=3)
                    self._remove()
                    continue
                raise JobRunningError(self._busy_message(holder, alive)) from None
            except OSError as e:
                raise self._not_writable(e) from e
            self.token = uuid.uuid4().hex
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(self._record(pids, info), f)
            except OSError as e:
                self.path.unlink(missing_ok=True)
                raise self._not_writable(e) from e
            self.held = True
            _held(self)
            return
        raise JobRunningError(f"could not take {self.path}: another writer keeps taking it")

    @contextlib.contextmanager
    def hold(self, **info: Any) -> Iterator[RunLock]:
        """Holds the lock for a block (re-entrant): taken on entry unless this object holds
        it already or this process is a worker of the launch that holds it; released on
        leaving the block that took it, whatever ends it (an error, KeyboardInterrupt)."""
        if self.held or self._depth or self.covered_by_launcher():
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
            return
        self.acquire(pids=[os.getpid()], **info)
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1
            self.release()

    def update(self, pids: Iterable[int], **info: Any) -> None:
        """Records the worker pids (atomically) once they are started."""
        if not self.held:
            raise RuntimeError(f"{self.path} is not held by this process")
        tmp = self.path.with_name(f".{LOCK_NAME}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self._record(pids, info)), encoding="utf-8")
        os.replace(tmp, self.path)

    def release(self) -> None:
        """Removes the lock if this object still holds it."""
        if not self.held:
            return
        holder = self.read() or {}
        if holder.get("token") == self.token or (
                holder.get("token") is None and holder.get("pid") == os.getpid()
                and holder.get("host") == socket.gethostname()):
            self._remove()
        self.held = False
        with _HELD_MUTEX:
            if _HELD.get(self._key()) is self:
                del _HELD[self._key()]

    # ------------------------------------------------------------------ helpers
    def _key(self) -> str:
        return os.path.realpath(self.path)

    def _remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _mine(self, holder: dict[str, Any]) -> bool:
        """Whether the lock file names this very process (same host, pid and start)."""
        if holder.get("host") != socket.gethostname() or holder.get("pid") != os.getpid():
            return False
        starts = holder.get("starts") if isinstance(holder.get("starts"), dict) else {}
        start = starts.get(str(os.getpid()))
        return start is None or start == pid_start_time(os.getpid())

    def _make_dir(self) -> None:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            pass
        except OSError as e:
            raise self._not_writable(e) from e
        if not self.run_dir.is_dir():
            raise RunDirNotWritable(errno.ENOTDIR, f"run_dir {str(self.run_dir)!r} (or a parent "
                                    "of it) exists but is not a directory; pass a directory path")

    def _not_writable(self, error: OSError) -> OSError:
        full = error.errno in (errno.ENOSPC, errno.EDQUOT)
        if error.errno not in (errno.EACCES, errno.EPERM, errno.EROFS) and not full:
            return error
        why = os.strerror(error.errno) if error.errno else str(error)
        fix = ("free disk space there, or pass a run_dir on another disk" if full else
               "make it writable (e.g. `chmod -R u+w` it, or remount it read-write), or pass "
               "a run_dir in a writable place. To only read a finished run, use "
               "workbench._runs.read_metrics(run_dir)")
        return RunDirNotWritable(
            error.errno,
            f"run directory {str(self.run_dir)!r} cannot be written ({why}: "
            f"{error.filename or self.path}). A run directory receives checkpoints, run.json "
            f"and metrics.jsonl: {fix}")

    def _record(self, pids: Iterable[int], info: dict[str, Any]) -> dict[str, Any]:
        pids = [int(p) for p in pids]
        starts = {str(p): pid_start_time(p) for p in dict.fromkeys([os.getpid(), *pids])}
        return {"host": socket.gethostname(), "pid": os.getpid(), "pids": pids,
                "starts": starts, "created": time.time(), "token": self.token, **info}

    def _busy_message(self, holder: dict[str, Any], alive: bool | None, *,
                      here: bool = False) -> str:
        created = holder.get("created")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(
            created if isinstance(created, (int, float)) and not isinstance(created, bool)
            else 0))
        pid, host = holder.get("pid"), holder.get("host")
        if alive is None:
            who = f"pid {pid} with workers {holder.get('pids')} on host {host}, since {since}"
            return (f"run directory {self.run_dir} is locked by a writer on another host "
                    f"({who}). Stop it first; if it is gone (its host crashed), delete "
                    f"{self.path} and start again, or use another run_dir")
        if holder.get("slurm_job"):
            return (f"run directory {self.run_dir} belongs to SLURM job {holder['slurm_job']}, "
                    f"which is still queued or running (since {since}). Two jobs would "
                    "overwrite each other's checkpoints, so this one was refused and nothing "
                    f"was changed. Stop it with job.stop() (or `scancel {holder['slurm_job']}`), "
                    "watch it with wb.attach(run_dir), or use another run_dir")
        if holder.get("what") == "trainer":
            where = "a Trainer in this process (another thread)" if here else \
                "a wb.Trainer (a notebook kernel, a script or `python -m workbench train`)"
            return (f"run directory {self.run_dir} is being trained right now by pid {pid} on "
                    f"host {host}, since {since}: {where}. Two writers would overwrite each "
                    "other's checkpoints, so this one was refused and nothing was changed. "
                    f"Wait for that run to finish, or stop it (interrupt its cell, or `kill "
                    f"-TERM {pid}`: it stops at the next step with a checkpoint), then run "
                    "again here: it continues from that checkpoint. Or use another run_dir.")
        who = f"pid {pid} with workers {holder.get('pids')} on host {host}, since {since}"
        return (f"run directory {self.run_dir} already has a running job ({who}). Stop it with "
                f"job.stop() (or `kill -TERM {pid}`), wait for it with job.wait(), "
                "or launch into another run_dir; workbench.jobs.attach(run_dir) watches it")

    def _refuse_running_trainer(self) -> None:
        """A writer that marks run.json 'running' without the lock (a RunWriter used by hand)
        also blocks a second writer while its process lives."""
        try:
            run = read_run(self.run_dir)
        except (OSError, ValueError, TypeError, RecursionError, UnicodeDecodeError):
            return
        pid = run.get("pid")
        if (run.get("status") == "running" and run.get("host") == socket.gethostname()
                and pid != os.getpid() and pid_alive(pid, run.get("pid_start"))
                and not self.path.exists()):
            raise JobRunningError(
                f"run directory {self.run_dir} is being written right now by pid {pid} on this "
                "host (run.json status 'running'), e.g. a notebook Trainer. Interrupt it (its "
                "checkpoint is kept) or use another run_dir")
