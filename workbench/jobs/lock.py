"""The run-directory lock: one job (or notebook trainer) at a time per run directory.

``<run_dir>/job.lock`` is created atomically (``O_CREAT | O_EXCL``) and holds the
host, the launcher's pid and the worker pids. A second launch into the same run
directory is refused while any of those processes lives; a lock whose processes are all
dead on this host is stale and is taken over with a warning. Locks from another host
cannot be checked from here: the error says how to clear one by hand.
"""
from __future__ import annotations

import json
import os
import socket
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from workbench.runs import pid_alive, pid_start_time, read_run

__all__ = ["JobRunningError", "RunLock", "pid_alive"]

LOCK_NAME = "job.lock"


class JobRunningError(RuntimeError):
    """A job (or a trainer) is already running in this run directory."""


class RunLock:
    """``<run_dir>/job.lock``: refuses a second job in a running run directory.

    Args:
      run_dir: the run directory (created if missing).
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.held = False

    def read(self) -> dict[str, Any] | None:
        """The current holder (``host``, ``pid``, ``pids``, ``created``), or None."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"host": None, "pid": None, "pids": [], "corrupt": True}
        return data if isinstance(data, dict) else {"host": None, "pid": None, "pids": []}

    @staticmethod
    def holder_alive(holder: dict[str, Any]) -> bool | None:
        """True/False for a holder on this host; None when it is on another host."""
        if holder.get("host") != socket.gethostname():
            return None
        starts = holder.get("starts") or {}
        pids = [holder.get("pid"), *holder.get("pids", [])]
        return any(pid_alive(p, starts.get(str(p))) for p in pids)

    def acquire(self, pids: Iterable[int] = (), **info: Any) -> None:
        """Takes the lock for this process (and ``pids``), or raises if a live job holds it.

        Raises:
          JobRunningError: a live job holds the lock, or a job on another host does.
        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._refuse_running_trainer()
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self.read() or {}
                alive = self.holder_alive(holder)
                if alive is False or holder.get("corrupt"):
                    warnings.warn(f"taking over the stale lock {self.path}: its job (pid "
                                  f"{holder.get('pid')}, workers {holder.get('pids')}) is no "
                                  "longer running", stacklevel=3)
                    self.path.unlink(missing_ok=True)
                    continue
                raise JobRunningError(self._busy_message(holder, alive)) from None
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self._record(pids, info), f)
            self.held = True
            return
        raise JobRunningError(f"could not take {self.path}: another launch keeps taking it")

    def update(self, pids: Iterable[int], **info: Any) -> None:
        """Records the worker pids (atomically) once they are started."""
        if not self.held:
            raise RuntimeError(f"{self.path} is not held by this process")
        tmp = self.path.with_name(f".{LOCK_NAME}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self._record(pids, info)), encoding="utf-8")
        os.replace(tmp, self.path)

    def release(self) -> None:
        """Removes the lock if this process still holds it."""
        if self.held:
            holder = self.read() or {}
            if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                self.path.unlink(missing_ok=True)
            self.held = False

    def _record(self, pids: Iterable[int], info: dict[str, Any]) -> dict[str, Any]:
        pids = [int(p) for p in pids]
        starts = {str(p): pid_start_time(p) for p in [os.getpid(), *pids]}
        return {"host": socket.gethostname(), "pid": os.getpid(), "pids": pids,
                "starts": starts, "created": time.time(), **info}

    def _busy_message(self, holder: dict[str, Any], alive: bool | None) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("created") or 0))
        who = (f"pid {holder.get('pid')} with workers {holder.get('pids')} on host "
               f"{holder.get('host')}, since {since}")
        if alive is None:
            return (f"run directory {self.run_dir} is locked by a job on another host ({who}). "
                    f"Stop that job first; if it is gone (its host crashed), delete {self.path} "
                    "and launch again, or launch into another run_dir")
        return (f"run directory {self.run_dir} already has a running job ({who}). Stop it with "
                f"job.stop() (or `kill -TERM {holder.get('pid')}`), wait for it with job.wait(), "
                "or launch into another run_dir; workbench.jobs.attach(run_dir) watches it")

    def _refuse_running_trainer(self) -> None:
        """A notebook Trainer writing this run directory right now also blocks a launch."""
        try:
            run = read_run(self.run_dir)
        except (OSError, ValueError, TypeError):
            return
        pid = run.get("pid")
        if (run.get("status") == "running" and run.get("host") == socket.gethostname()
                and pid != os.getpid() and pid_alive(pid, run.get("pid_start"))
                and not self.path.exists()):
            raise JobRunningError(
                f"run directory {self.run_dir} is being trained right now by pid {pid} on this "
                "host (run.json status 'running'), e.g. a notebook Trainer. Interrupt it (its "
                "checkpoint is kept) or launch into another run_dir")
