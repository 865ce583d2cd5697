"""A running multi-process job: status, per-process logs, wait, stop, and fault handling.

A monitor thread polls the worker processes four times a second. The first process
that exits with an error makes the job ``failed`` (naming that process, its exit
code or signal, and its last log lines); the others are killed at once, because a job
missing one process can only hang in its next collective. Committed Orbax checkpoints
are atomic, so killing loses at most the steps since the last one, and a relaunch into
the same run directory continues from there.
"""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workbench._display import Displayable
from workbench import _runs as runs
from workbench._run_lock import RunLock, pid_alive
from workbench._validate import check_bool
from workbench.jobs._worker import EXIT_STOPPED

__all__ = ["Job", "NoJobError", "ProcessInfo", "exit_file", "read_tail"]

STATUSES = ("queued", "running", "finished", "failed", "stopped")  # queued: SLURM only
_POLL_S = 0.25
_GLOO_CHATTER = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks")


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """One worker process of a job.

    Attributes:
      index: its process index (``jax.process_index()``); 0 writes the metrics.
      pid: its OS pid (None for a SLURM task: it runs on a node).
      state: "running", "finished", "stopped", "failed" or "killed" (by the launcher
        after another process failed).
      returncode: its exit status (negative: killed by that signal); None while running.
      log: its log file.
    """

    index: int
    pid: int | None
    state: str
    returncode: int | None
    log: Path


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def read_tail(path: Path, n: int = 20, max_bytes: int = 256 * 1024, *,
              raw: bool = False) -> list[str]:
    """The last ``n`` lines a log file got since its latest ``===== ... launch`` header.

    Gloo's "Rank k is connected to m peer ranks" chatter is left out unless ``raw``.
    """
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except FileNotFoundError:
        return []
    starts = [i for i, line in enumerate(lines) if line.startswith("===== ")]
    if starts:
        lines = lines[starts[-1] + 1:]
    if not raw:
        lines = [line for line in lines if not _GLOO_CHATTER.match(line)]
    return lines[-n:] if n > 0 else []


class _Pid:
    """A worker this Python process did not start (see :func:`attach`).

    Its exit code comes from the ``process-<i>.exit`` file the worker writes as it exits;
    a worker that left none was killed (reported as SIGKILL).
    """

    def __init__(self, pid: int, start: str | None, exit_file: Path) -> None:
        self.pid, self._start, self._exit_file = pid, start, exit_file
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not pid_alive(self.pid, self._start):
            try:
                self.returncode = int(self._exit_file.read_text().strip())
            except (OSError, ValueError):
                self.returncode = -int(signal.SIGKILL)
        return self.returncode


class Job(Displayable):
    """A multi-process training job started by :func:`workbench.jobs`.

    Attributes:
      run_dir: the run directory (config.json, run.json, metrics.jsonl, logs/, checkpoints).
      logs: one log file per process (stdout and stderr).
    """

    def __init__(self, run_dir: Path, procs: Sequence[subprocess.Popen[bytes] | _Pid],
                 logs: Sequence[Path], *, lock: RunLock | None, commands: Sequence[Any] = (),
                 devices_per_process: int | None = None, platform: str | None = None,
                 target_steps: int | None = None, attached: bool = False) -> None:
        attached = check_bool(attached, "attached", where="wb.Job: ")
        self.run_dir, self.logs = Path(run_dir), [Path(p) for p in logs]
        self.commands, self.platform = list(commands), platform
        self.devices_per_process, self.target_steps = devices_per_process, target_steps
        self.started = time.time()
        self._procs, self._lock, self._attached = list(procs), lock, attached
        self._states: list[str] = ["running"] * len(self._procs)
        self._status, self._failure, self._stop_requested = "running", None, False
        self._note: str | None = None
        self._done = threading.Event()
        self._mutex = threading.Lock()  # job state
        self._metrics_mutex = threading.Lock()  # the metrics reader
        self._metrics = runs.MetricsTail(self.run_dir)
        self._monitor = threading.Thread(target=self._watch, daemon=True,
                                         name=f"workbench-job:{self.run_dir.name}")
        self._monitor.start()

    # ------------------------------------------------------------------ state
    @property
    def status(self) -> str:
        """"running", "finished", "failed" or "stopped" ("queued": waiting in SLURM's queue)."""
        return self._status

    @property
    def scheduler(self) -> dict[str, Any] | None:
        """What the cluster's scheduler says (SLURM jobs: state, reason, nodes, history)."""
        return None

    @property
    def done(self) -> bool:
        """Whether every process has exited and the job's status is final."""
        return self._done.is_set()

    @property
    def failure(self) -> dict[str, Any] | None:
        """For a failed job: ``process``, ``pid``, ``returncode``, ``reason``, ``last_lines``."""
        return self._failure

    @property
    def processes(self) -> list[ProcessInfo]:
        """Every worker process with its state and exit status."""
        return [ProcessInfo(i, p.pid, self._states[i], p.returncode, self.logs[i])
                for i, p in enumerate(self._procs)]

    def progress(self) -> dict[str, Any]:
        """The run's latest metrics: ``step``, ``target_steps``, ``loss``, ... (from process 0)."""
        with self._metrics_mutex:
            self._metrics.poll()
            last = dict(self._metrics.last_record or {})
        return {**last, "step": last.get("step", 0), "target_steps": self.target_steps}

    def metrics(self, since: int = 0) -> list[dict[str, Any]]:
        """Step records written by process 0 so far (the same ``metrics.jsonl`` the lab reads)."""
        return runs.read_metrics(self.run_dir, since=since)

    # ------------------------------------------------------------------ control
    def wait(self, timeout: float | None = None) -> str:
        """Blocks until every process has exited; returns the final status.

        Interrupting ``wait`` (Ctrl-C) stops waiting, not the job: use :meth:`stop`.

        Raises:
          TimeoutError: still running after ``timeout`` seconds (the job keeps running).
        """
        if not self._done.wait(timeout):
            p = self.progress()
            raise TimeoutError(f"job {self.run_dir} still running after {timeout} s (step "
                               f"{p['step']} of {p['target_steps']}); call wait() again, or "
                               "stop() to checkpoint and end it")
        return self._status

    def stop(self, timeout: float = 120.0) -> str:
        """Asks every process to checkpoint and exit (SIGTERM), and waits for them.

        The processes agree on the step to stop at (JAX's preemption sync point), save a
        checkpoint there and exit; a relaunch into the same run directory continues.
        Processes still alive after ``timeout`` seconds are killed.

        Returns:
          The final status ("stopped", or "finished"/"failed" if that happened first).
        """
        with self._mutex:
            if self._done.is_set():
                return self._status
            self._stop_requested = True
        self._signal_all(signal.SIGTERM)
        if not self._done.wait(timeout):
            self._note = f"killed after not stopping within {timeout:g} s of SIGTERM"
            self._signal_all(signal.SIGKILL)
            self._done.wait(30)
        return self._status

    def tail(self, n: int = 20, process: int | None = None) -> str:
        """The last ``n`` log lines of each process (or of one), under a header per process."""
        out = []
        for info in self.processes:
            if process is not None and info.index != process:
                continue
            rc = "" if info.returncode is None else f", {_describe_exit(info.returncode)}"
            out.append(f"--- process {info.index} (pid {info.pid}, {info.state}{rc}) "
                       f"{info.log}")
            out.extend(read_tail(info.log, n))
        return "\n".join(out)

    # ------------------------------------------------------------------ display
    def __repr__(self) -> str:
        p = self.progress()
        of = f" of {p['target_steps']}" if p["target_steps"] else ""
        head = (f"Job({str(self.run_dir)!r}, {len(self._procs)} processes, {self._status}, "
                f"step {p['step']}{of})")
        if self._failure:
            head += "\n" + self._failure["message"]
        if self._note:
            head += f"\n{self._note}"
        return head

    # ------------------------------------------------------------------ monitor
    def _signal_all(self, sig: signal.Signals) -> None:
        for i, p in enumerate(self._procs):
            if p.poll() is None:
                if hasattr(p, "send_signal_remote"):  # a worker on another host (ssh)
                    p.send_signal_remote(sig)
                    continue
                try:  # the whole process group: the worker and anything it started
                    os.killpg(p.pid, sig) if not self._attached else os.kill(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def _watch(self) -> None:
        try:
            while not self._done.is_set():
                codes = [p.poll() for p in self._procs]
                with self._mutex:
                    self._update_states(codes)
                if all(c is not None for c in codes):
                    self._finish()
                    return
                time.sleep(_POLL_S)
        except Exception as e:  # noqa: BLE001 - the monitor must never die silently
            self._note = f"job monitor error: {type(e).__name__}: {e}"
            self._signal_all(signal.SIGKILL)
            self._finish()

    def _update_states(self, codes: list[int | None]) -> None:
        # Within one poll, a process killed by a signal is the cause and the others that
        # lost their collective peer are the consequence: look at the signalled ones first.
        order = sorted(range(len(codes)), key=lambda i: (not (codes[i] or 0) < 0, i))
        for i in order:
            code = codes[i]
            if code is None or self._states[i] != "running":
                continue
            if code == 0:
                self._states[i] = "finished"
            elif code == EXIT_STOPPED or (self._stop_requested and code == -signal.SIGTERM):
                self._states[i] = "stopped"
            elif self._failure is not None:
                self._states[i] = "killed"
            else:
                self._states[i] = "failed"
                self._fail(i, code)

    def _fail(self, i: int, code: int) -> None:
        time.sleep(0.2)  # let its last lines reach the log file
        lines = read_tail(self.logs[i], 20)
        reason = f"process {i} (pid {self._procs[i].pid}) {_describe_exit(code)}"
        step = self.progress()["step"]
        self._failure = {"process": i, "pid": self._procs[i].pid, "returncode": code,
                         "reason": reason, "step": step, "last_lines": lines,
                         "message": f"job failed: {reason} at step {step}; the other processes "
                                    f"were killed. Its last log lines:\n  "
                                    + "\n  ".join(lines)
                                    + f"\nLaunch again into {self.run_dir} to continue from "
                                      "the last checkpoint."}
        self._status = "failed"
        self._signal_all(signal.SIGKILL)

    def _finish(self) -> None:
        codes = [p.poll() for p in self._procs]
        with self._mutex:
            self._update_states([c if c is not None else -9 for c in codes])
            if self._failure is not None:
                status = "failed"
            elif self._stop_requested or "stopped" in self._states:
                status = "stopped"
            else:
                status = "finished"
            self._status = status
        self._close_run(status)
        if self._lock is not None:
            self._lock.release()
        elif self._attached:  # the launcher that held the lock is gone: clear it
            lock = RunLock(self.run_dir)
            if RunLock.holder_alive(lock.read() or {}) is False:
                lock.path.unlink(missing_ok=True)
        self._done.set()

    def _close_run(self, status: str) -> None:
        """Records the job's outcome in run.json when process 0 could not (it was killed),
        or when process 0 recorded only a consequence of another process's failure (a
        collective that lost its peer): the job knows which process failed first."""
        try:
            run = runs.read_run(self.run_dir)
        except (OSError, ValueError):
            return
        if status in ("running", "finished"):
            return
        first_failed = self._failure is not None and self._failure["process"] != 0
        if run.get("status") != "running" and not (first_failed and run.get("status") == "failed"):
            return
        error = self._failure["message"] if self._failure else self._note
        if run.get("status") == "failed" and run.get("error"):
            error = f"{error}\nProcess 0 then reported: {run['error']}"
        writer = runs.RunWriter(self.run_dir, config=run.get("config") or {})
        writer.event("job", status=status, error=error)
        writer.close("failed" if status == "failed" else "interrupted", error=error)


class NoJobError(FileNotFoundError):
    """``attach(run_dir)`` found no job there (none running on this host, none submitted)."""


def exit_file(log: Path) -> Path:
    """Where the worker logging to ``log`` records its exit code (``process-0.exit``)."""
    return log.with_suffix(".exit")
