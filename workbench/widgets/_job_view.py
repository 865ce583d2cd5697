"""The Job widget: status per process, live loss/MFU from the run directory, log tails, Stop."""
from __future__ import annotations

import math
import threading
from typing import Any

import anywidget
import traitlets

from workbench import _runs as runs
from workbench.widgets import _assets
from workbench.jobs._job import Job, read_tail

__all__ = ["JobView", "job_payload", "job_widget"]

MAX_POINTS = 400  # curve points sent to the browser (older ones thinned evenly)
TAIL_LINES = 8

def _thin(points: list[list[float]], n: int = MAX_POINTS) -> list[list[float]]:
    """At most ``n`` points, evenly spaced, always keeping the last one."""
    if len(points) <= n:
        return points
    stride = math.ceil(len(points) / n)
    kept = points[::stride]
    return kept if kept[-1] is points[-1] else [*kept, points[-1]]


def job_payload(job: Job, records: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Everything the Job widget shows, as JSON: status, processes, latest metrics, curves, logs.

    Args:
      job: the job.
      records: its step records so far (default: read from the run directory).
    """
    records = runs.read_metrics(job.run_dir) if records is None else records
    last = records[-1] if records else {}
    curve = lambda key: _thin([[r["step"], r[key]] for r in records
                               if isinstance(r.get(key), (int, float))])
    procs = [{"index": p.index, "pid": p.pid, "state": p.state, "returncode": p.returncode,
              "log": str(p.log)} for p in job.processes]
    return {
        "run_dir": str(job.run_dir), "name": job.run_dir.name, "status": job.status,
        "done": job.done, "platform": job.platform,
        "devices_per_process": job.devices_per_process, "processes": procs,
        "step": last.get("step", 0), "target_steps": job.target_steps,
        "latest": {k: last.get(k) for k in ("loss", "mfu", "mfu_fp8", "step_time",
                                            "tokens_per_s", "peak_source")},
        "loss": curve("loss"), "mfu": curve("mfu"),
        "failure": job.failure["message"] if job.failure else None,
        "tails": {str(p.index): read_tail(p.log, TAIL_LINES) for p in job.processes},
        "scheduler": job.scheduler,
    }


class JobView(anywidget.AnyWidget):
    """Live view of a :class:`~workbench.jobs.Job`; refreshes once a second until it ends.

    It only reads the job and its run directory (the same files the lab panel reads);
    the Stop button calls ``job.stop()`` (SIGTERM: checkpoint, then exit).
    """

    _esm = _assets.esm("job")
    _css = _assets.css("job")
    payload = traitlets.Dict({}).tag(sync=True)

    def __init__(self, job: Job, *, interval: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.job, self.interval = job, interval
        self._tail = runs.MetricsTail(job.run_dir)
        self._records: list[dict[str, Any]] = []
        self._closed = threading.Event()
        self.refresh()
        self.on_msg(self._on_msg)
        if not job.done:
            threading.Thread(target=self._loop, daemon=True,
                             name=f"workbench-jobview:{job.run_dir.name}").start()

    def refresh(self) -> None:
        """Reads what is new in the run directory and sends the payload."""
        steps, _ = self._tail.poll()
        self._records.extend(steps)
        self.payload = job_payload(self.job, self._records)

    def close(self) -> None:
        """Stops refreshing and closes the widget."""
        self._closed.set()
        super().close()

    def _loop(self) -> None:
        while not self._closed.wait(self.interval):
            done = self.job.done
            self.refresh()
            if done:
                return

    def _on_msg(self, _widget: Any, content: dict[str, Any], _buffers: Any) -> None:
        if content.get("type") == "stop" and not self.job.done:
            threading.Thread(target=self.job.stop, daemon=True).start()


def job_widget(job: Job, **options: Any) -> JobView:
    """``wb.show(job)``: the live :class:`JobView` of a launched job."""
    return JobView(job, **options)
