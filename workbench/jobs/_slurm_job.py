"""A submitted SLURM job as a :class:`~workbench.jobs.Job`: the scheduler's state and its
history (queued, running, requeued, ended), each task's exit and log, stop = ``scancel``.

The state comes from ``scontrol show job`` (what slurmctld holds: pending, running and
recently ended jobs), then from ``sacct`` once slurmctld forgets an ended job (where the
cluster keeps accounting), else from the run directory. A requeued job keeps its id: its
restarts show in the history, and its tasks' logs get one ``===== ... start N`` header each.
The batch script writes the number of the start that runs into ``logs/slurm-<id>.start``: the
tasks' exit files belong to that start, and a start SLURM ended before its script ran (e.g. a
requeued job started again within a second of its requeue, whose credential slurmd still
holds revoked) shows as such instead of as the previous start's checkpointed stop.
"""
from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from typing import Any

from workbench import _runs as runs
from workbench.jobs._job import Job, ProcessInfo, _describe_exit, exit_file, read_tail
from workbench.jobs._sbatch import SlurmError, run_command
from workbench.jobs._worker import EXIT_STOPPED
from workbench._run_lock import RunLock

__all__ = ["SlurmJob", "query_state"]

QUEUED = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "SUSPENDED",
          "RESIZING", "STOPPED", "SPECIAL_EXIT", "PREEMPTED")
RUNNING = ("RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT")
FINAL = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "PREEMPTED")
_POLL_S = 1.0


def query_state(job_id: str) -> dict[str, Any]:
    """The scheduler's view of ``job_id``: ``state``, ``reason``, ``nodes``, ``restarts``,
    ``exit_code``, ``requeue`` and ``source`` ("scontrol", "sacct" or "gone")."""
    out = run_command(["scontrol", "-o", "show", "job", job_id], timeout=30)
    if out.returncode == 0 and "JobState=" in out.stdout:
        kv = dict(re.findall(r"(\w+)=(\S*)", out.stdout))
        return {"state": kv.get("JobState", "UNKNOWN"), "reason": kv.get("Reason", "None"),
                "nodes": kv.get("NodeList", ""), "restarts": int(kv.get("Restarts", 0) or 0),
                "exit_code": kv.get("ExitCode", ""), "requeue": kv.get("Requeue") == "1",
                "time_limit": kv.get("TimeLimit", ""), "source": "scontrol"}
    acct = run_command(["sacct", "-n", "-P", "-X", "-j", job_id, "-o",
                        "State,NodeList,ExitCode"], timeout=30) if _has("sacct") else None
    if acct is not None and acct.returncode == 0 and acct.stdout.strip():
        state, nodes, code = (acct.stdout.strip().splitlines()[-1].split("|") + ["", ""])[:3]
        return {"state": state.split()[0], "reason": "None", "nodes": nodes, "restarts": 0,
                "exit_code": code, "requeue": False, "source": "sacct"}
    return {"state": "UNKNOWN", "reason": "no longer known to slurmctld and no accounting "
            "(sacct)", "nodes": "", "restarts": 0, "exit_code": "", "requeue": False,
            "source": "gone"}


def _has(cmd: str) -> bool:
    import shutil

    return shutil.which(cmd) is not None


class _Task:
    """One SLURM task of the job: its exit code comes from the ``process-<i>.exit`` file
    the worker writes as it exits (the batch script clears it at every start)."""

    def __init__(self, log: Path) -> None:
        self.pid: int | None = None
        self._exit = exit_file(log)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        try:
            self.returncode = int(self._exit.read_text().strip())
        except (OSError, ValueError):
            self.returncode = None
        return self.returncode


class SlurmJob(Job):
    """A job submitted to SLURM (``wb.launch(cfg, cluster=wb.Slurm(...))``): the same Job,
    its processes are the job's tasks, and ``scheduler`` tells what SLURM says.

    Attributes:
      job_id: the SLURM job id.
      history: every scheduler state seen, in order (``time``, ``state``, ``reason``,
        ``nodes``, ``restarts``).
    """

    def __init__(self, run_dir: Path, record: dict[str, Any], *, lock: RunLock | None,
                 attached: bool = False) -> None:
        self.job_id = str(record["job_id"])
        self.record = record
        self.history: list[dict[str, Any]] = []
        self._sched: dict[str, Any] = {"state": "SUBMITTED", "reason": "None", "nodes": "",
                                       "restarts": 0, "source": "sbatch"}
        n = int(record.get("tasks") or 1)
        logs = [Path(run_dir) / "logs" / f"process-{i}.log" for i in range(n)]
        super().__init__(Path(run_dir), [_Task(p) for p in logs], logs, lock=lock,
                         attached=attached, platform=record.get("platform"),
                         devices_per_process=record.get("devices_per_task"),
                         target_steps=record.get("target_steps"),
                         commands=[["sbatch", record.get("script", "")]])

    # ------------------------------------------------------------------ state
    @property
    def scheduler(self) -> dict[str, Any]:
        """``name`` "slurm", ``job_id``, ``state`` (PENDING, RUNNING, COMPLETED, ...),
        ``reason`` (why it waits), ``nodes``, ``restarts`` and the ``history`` of states."""
        return {"name": "slurm", "job_id": self.job_id, **self._sched,
                "history": list(self.history)}

    @property
    def processes(self) -> list[ProcessInfo]:
        return [ProcessInfo(i, p.pid, self._states[i], p.returncode, self.logs[i])
                for i, p in enumerate(self._procs)]

    def stop(self, timeout: float = 120.0) -> str:
        """Cancels the job (``scancel``): running tasks get SIGTERM, save a checkpoint at an
        agreed step and exit; a relaunch into the same run directory continues.

        Returns:
          The final status ("stopped", or "finished"/"failed" if that happened first).
        """
        with self._mutex:
            if self._done.is_set():
                return self._status
            self._stop_requested = True
        out = run_command(["scancel", self.job_id])
        if out.returncode != 0 and not self._done.is_set():
            raise SlurmError(f"scancel {self.job_id} failed: {out.stderr.strip()}")
        if not self._done.wait(timeout):
            self._note = f"killed after not stopping within {timeout:g} s of scancel"
            run_command(["scancel", "--full", "--signal=KILL", self.job_id])
            self._done.wait(60)
        return self._status

    def tail(self, n: int = 20, process: int | None = None) -> str:
        s = self._sched
        head = [f"--- SLURM job {self.job_id}: {s['state']}"
                + (f" ({s['reason']})" if s.get("reason") not in (None, "None") else "")
                + (f" on {s['nodes']}" if s.get("nodes") else "")
                + (f", restarted {s['restarts']}x" if s.get("restarts") else "")]
        out = self.run_dir / "logs" / f"slurm-{self.job_id}.out"
        if process is None and s["state"] not in RUNNING and out.exists():
            head += [f"--- batch script output {out}", *read_tail(out, n, raw=True)]
        for info in self.processes:
            if process is not None and info.index != process:
                continue
            rc = "" if info.returncode is None else f", {_describe_exit(info.returncode)}"
            head.append(f"--- task {info.index} ({info.state}{rc}) {info.log}")
            head.extend(read_tail(info.log, n))
        return "\n".join(head)

    def __repr__(self) -> str:
        p, s = self.progress(), self._sched
        of = f" of {p['target_steps']}" if p["target_steps"] else ""
        where = f" on {s['nodes']}" if s.get("nodes") and s["state"] in RUNNING else ""
        why = f" ({s['reason']})" if s["state"] in QUEUED and s.get("reason") != "None" else ""
        head = (f"Job({str(self.run_dir)!r}, SLURM job {self.job_id}: {s['state']}{why}{where}, "
                f"{len(self._procs)} tasks, {self._status}, step {p['step']}{of})")
        if s.get("restarts"):
            head += f"\nrequeued {s['restarts']}x: " + " -> ".join(h["state"] for h in self.history)
        if self._failure:
            head += "\n" + self._failure["message"]
        if self._note:
            head += f"\n{self._note}"
        return head

    # ------------------------------------------------------------------ monitor
    def _signal_all(self, sig: signal.Signals) -> None:
        name = signal.Signals(sig).name.removeprefix("SIG")
        run_command(["scancel", f"--signal={name}", self.job_id])

    def _watch(self) -> None:
        self._status = "queued"
        try:
            while not self._done.is_set():
                s = query_state(self.job_id)
                self._observe(s)
                if self._final(s):
                    self._finish_slurm(s)
                    return
                time.sleep(_POLL_S)
        except Exception as e:  # noqa: BLE001 - the monitor must never die silently
            self._note = f"job monitor error: {type(e).__name__}: {e}"
            self._status = "failed"
            self._finish_slurm({**self._sched, "state": "UNKNOWN"})

    def _observe(self, s: dict[str, Any]) -> None:
        last = self.history[-1] if self.history else None
        if last and s["restarts"] > last["restarts"]:  # requeued (however briefly it showed)
            self.history.append({**last, "time": time.time(), "state": "REQUEUED",
                                 "restarts": s["restarts"]})
            last = self.history[-1]
        key = (s["state"], s["reason"], s["nodes"], s["restarts"])
        if last is None or key != (last["state"], last["reason"], last["nodes"],
                                   last["restarts"]):
            self.history.append({"time": time.time(), "state": s["state"],
                                 "reason": s["reason"], "nodes": s["nodes"],
                                 "restarts": s["restarts"]})
        with self._mutex:
            self._sched = s
            running = s["state"] in RUNNING
            self._status = "running" if running else "queued" if s["state"] in QUEUED \
                else self._status
            stale = self._never_ran(s)  # the exit files are an earlier start's
            for i, p in enumerate(self._procs):
                code = None if stale else p.poll()
                self._states[i] = ("queued" if s["state"] in QUEUED else
                                   "running" if code is None else self._task_state(code))

    @staticmethod
    def _task_state(code: int) -> str:
        return "finished" if code == 0 else "stopped" if code == EXIT_STOPPED else "failed"

    def _never_ran(self, s: dict[str, Any]) -> bool:
        """Whether the batch script of the job's current start (``restarts + 1``) has not run
        (yet, or ever: SLURM ended the job while starting it)."""
        try:
            started = int((self.run_dir / "logs" / f"slurm-{self.job_id}.start").read_text())
        except (OSError, ValueError):
            started = 0
        return started < int(s.get("restarts") or 0) + 1

    def _final(self, s: dict[str, Any]) -> bool:
        if s["state"] == "UNKNOWN":
            return s["source"] == "gone"
        if s["state"] not in FINAL:
            return False
        # a preempted (or failed node's) job with requeue goes back to the queue
        return not (s["state"] in ("PREEMPTED", "NODE_FAIL") and s.get("requeue"))

    def _finish_slurm(self, s: dict[str, Any]) -> None:
        state = s["state"]
        codes = [p.poll() for p in self._procs]  # of the latest start that ran
        never_ran = state not in ("UNKNOWN", "CANCELLED") and self._never_ran(s)
        with self._mutex:
            self._states = ["killed" if c is None else self._task_state(c) for c in codes]
            if state == "COMPLETED":
                self._status = "finished"
            elif state == "CANCELLED" or (state == "FAILED" and not never_ran and codes and all(
                    c == EXIT_STOPPED for c in codes)):
                self._status = "stopped"
            elif state == "UNKNOWN":
                self._status = _status_from_run(self.run_dir)
            else:
                self._status = "failed"
                self._fail_slurm(s, [None] * len(codes) if never_ran else codes, never_ran)
        self._close_run(self._status)
        if self._lock is not None:
            self._lock.release()
        else:
            lock = RunLock(self.run_dir)
            holder = lock.read() or {}
            if str(holder.get("slurm_job")) == self.job_id:
                lock.path.unlink(missing_ok=True)
        self._done.set()

    def _fail_slurm(self, s: dict[str, Any], codes: list[int | None],
                    never_ran: bool = False) -> None:
        bad = [i for i, c in enumerate(codes) if c not in (None, 0, EXIT_STOPPED)]
        i = bad[0] if bad else 0
        start = int(s.get("restarts") or 0) + 1
        if bad:
            lines = read_tail(self.logs[i], 20)
            reason = f"task {i} {_describe_exit(codes[i])}"  # type: ignore[arg-type]
        else:
            out = self.run_dir / "logs" / f"slurm-{self.job_id}.out"
            lines = read_tail(out, 20, raw=True) or read_tail(self.logs[i], 20)
            if never_ran:
                reason = (f"its start {start} (after {start - 1} requeue(s)) never ran its batch "
                          "script" if start > 1 else "its batch script never ran")
            elif codes and all(c == EXIT_STOPPED for c in codes):
                reason = (f"every task saved a checkpoint and stopped (exit {EXIT_STOPPED}) on "
                          "SLURM's SIGTERM")
            else:
                reason = "no task recorded an exit"
            reason += f" (SLURM: exit code {s.get('exit_code')}, reason {s.get('reason')})"
        step = self.progress()["step"]
        requeue = bool((self.record.get("request") or {}).get("requeue"))
        limit = s.get("time_limit")
        fix = {"TIMEOUT": (f"It hit its time limit ({limit}) before it could requeue: raise "
                           "wb.Slurm(signal_before=) above the time one checkpoint takes, or "
                           "time=. " if requeue else
                           f"It hit its time limit ({limit}): raise wb.Slurm(time=), or pass "
                           "requeue=True to checkpoint and requeue before the limit. "),
               "OUT_OF_MEMORY": "It ran out of host memory: ask for more (extra=['--mem=...']). ",
               "NODE_FAIL": "A node failed: relaunch (or requeue=True). "}.get(s["state"], "")
        if never_ran and not fix:
            fix = ("SLURM ended the job while starting it; slurmctld's log says why (e.g. "
                   "'Killing non-startable batch job: Job credential revoked' for a requeued "
                   "job started again within a second of its requeue). ")
        self._failure = {
            "process": i, "pid": None, "returncode": codes[i], "reason": reason, "step": step,
            "last_lines": lines, "slurm_state": s["state"],
            "message": f"SLURM job {self.job_id} {s['state']}: {reason} at step {step}. {fix}"
                       "Its last log lines:\n  " + "\n  ".join(lines)
                       + f"\nLaunch again into {self.run_dir} to continue from the last "
                         "checkpoint."}


def _status_from_run(run_dir: Path) -> str:
    try:
        status = runs.read_run(run_dir).get("status")
    except (OSError, ValueError):
        return "failed"
    return {"completed": "finished", "interrupted": "stopped"}.get(status, "failed")
