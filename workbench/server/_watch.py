"""One run directory as the server follows it: ``run.json``, the metrics tail, its summary
(status, last metrics, sparkline) and detail.

Pure bookkeeping over ``workbench._runs`` (no tornado, no jax); thread-safe (reads run in
the server's worker threads).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from workbench import _runs as runs
from workbench.server import _profiles as profiles

SPARK_POINTS = 64  # a sparkline keeps between 64 and 128 evenly strided points
SUMMARY_KEYS = ("loss", "mfu", "mfu_fp8", "hfu", "tokens_per_s", "step_time", "grad_norm",
                "lr")
PREDICTION_SUMMARY_KEYS = ("step_seconds", "mfu", "mfu_fp8", "bound", "source", "band")


class RunWatch:
    """One run directory followed incrementally: ``run.json`` and new metrics lines.

    Nothing a run's files hold makes its methods raise: an unreadable ``run.json`` gives
    status ``"error"``, malformed lines are skipped, and both are described by
    :attr:`problem`.
    """

    def __init__(self, rid: str, path: Path) -> None:
        self.id = rid
        self.path = path
        self.tail = runs.MetricsTail(path)
        self.meta: dict[str, Any] = {}
        self.meta_error: str | None = None  # why run.json cannot be read
        self.meta_problems: list[str] = []  # fields of run.json that were ignored
        self.internal_error: str | None = None
        self.gone = False  # run.json was missing at the last refresh
        self.seen = False  # run.json was looked at (refresh or refresh_meta)
        self.initial = False  # found by the index's first scan (listed by pages, not news)
        self.events: list[dict[str, Any]] = []
        self._meta_stamp: tuple[int, int, int] | None = None
        self._status = ""
        self._problem: str | None = None
        self._spark_steps: list[int] = []
        self._spark_loss: list[float | None] = []
        self._stride = 1
        self._disk: tuple[tuple[int, int, int] | None, ...] | None = None  # at last refresh
        self._profiles: tuple[tuple[str, int, int], ...] = ()
        self.profiles: list[dict[str, Any]] = []  # profiles/<step>/report.json: name, step
        self._lock = threading.Lock()

    @property
    def listed(self) -> bool:
        """Whether the runs list shows it (it has a run.json, readable or not)."""
        return bool(self.meta) or self.meta_error is not None

    @property
    def problem(self) -> str | None:
        """What could not be read, in words (``run.json`` or metrics lines); None if nothing."""
        parts = [self.internal_error, self.meta_error, *self.meta_problems, self.tail.problem]
        text = "; ".join(p for p in parts if p)
        return (text if len(text) <= 2000 else text[:1997] + "...") or None

    def refresh(self) -> tuple[list[dict[str, Any]], bool, bool]:
        """Reads what changed: ``(new step records, run.json/status/problem changed, tail
        reset)``."""
        with self._lock:
            try:
                return self._refresh()
            except Exception as e:  # noqa: BLE001 - a bug reading one run must stay with it
                self.internal_error = f"could not be read: {type(e).__name__}: {e}"[:500]
                changed = self._problem != self.problem
                self._problem = self.problem
                return [], changed, False

    def refresh_meta(self) -> None:
        """Reads ``run.json`` only (what the runs list sorts by); the next :meth:`refresh`
        reads the rest."""
        with self._lock:
            try:
                self._read_meta()
            except Exception as e:  # noqa: BLE001 - as in refresh
                self.internal_error = f"could not be read: {type(e).__name__}: {e}"[:500]

    def stale(self) -> bool:
        """Whether :meth:`refresh` may find something: never refreshed, ``run.json`` or the
        metrics file changed on disk since (two stats), a live run (its writer may die),
        or the last refresh failed."""
        return (self._disk is None or self._disk != self._disk_stamp()
                or self._status == "running" or self.internal_error is not None)

    @property
    def refreshed(self) -> bool:
        """Whether :meth:`refresh` ran (its summary is known)."""
        return bool(self._status)

    def baseline(self) -> None:
        """Takes what is on disk now as known without reading it: :meth:`stale` says when
        it changes (the first look of a budgeted poll at a run found by the first scan)."""
        with self._lock:
            self._disk = self._disk_stamp()

    def _disk_stamp(self) -> tuple[tuple[int, int, int] | None, ...]:
        out = []
        for p in (self.path / runs.RUN_JSON, self.tail.path):
            try:
                st = os.stat(p)
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append(None)
        return tuple(out)

    def _read_meta(self) -> bool:
        """Reads ``run.json`` if it changed; whether it (or the error reading it) changed."""
        changed = False
        self.gone = False
        self.seen = True
        try:
            st = os.stat(self.path / runs.RUN_JSON)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp != self._meta_stamp:
                self._meta_stamp, changed = stamp, True
                try:
                    self.meta, self.meta_problems = served_meta(
                        runs.read_run(self.path, contained=True))
                    self.meta_error = None
                except FileNotFoundError:
                    self._meta_stamp = None  # replaced right now: read it next time
                except (OSError, ValueError) as e:
                    self.meta_error = str(e)
        except FileNotFoundError:
            self.gone = True  # a scan removes the run
        except OSError as e:
            changed, self.meta_error = self.meta_error != str(e), str(e)
        return changed

    def _refresh(self) -> tuple[list[dict[str, Any]], bool, bool]:
        disk = self._disk_stamp()
        changed = self._read_meta()
        if self.meta_error is not None:
            status = "error"
        else:
            status = runs.effective_status(self.meta) if self.meta else "running"
        changed = changed or status != self._status
        self._status = status
        resets = self.tail.resets
        records, events = self.tail.poll()
        reset = self.tail.resets != resets
        if reset:
            self._spark_steps, self._spark_loss, self._stride = [], [], 1
            self.events = []
        self.events = (self.events + events)[-100:]
        stamp = profiles.stamp(self.path)   # a profile's report written: run detail changes
        if stamp != self._profiles:
            self._profiles, self.profiles, changed = stamp, profiles.summaries(self.path), True
        for rec in records:
            self._add_spark(rec)
        self.internal_error = None
        self._disk = disk
        problem = self.problem
        changed = changed or problem != self._problem
        self._problem = problem
        return records, changed, reset

    def _add_spark(self, rec: dict[str, Any]) -> None:
        if (self.tail.records_seen - 1) % self._stride or "loss" not in rec:
            return
        self._spark_steps.append(rec["step"])
        self._spark_loss.append(number(rec["loss"]))  # NaN, inf, null: a gap
        if len(self._spark_steps) >= 2 * SPARK_POINTS:  # halve the resolution, double stride
            self._spark_steps, self._spark_loss = self._spark_steps[::2], self._spark_loss[::2]
            self._stride *= 2

    def read(self, since: int, limit: int | None) -> list[dict[str, Any]]:
        """Step records above ``since`` (what ``refresh`` has seen)."""
        with self._lock:
            return self.tail.read(since, limit)

    def detail(self) -> dict[str, Any]:
        """``run.json`` with the URL ``id``, the file's own id as ``uid``, recent events,
        ``problem`` and ``profiles`` (``[{"name", "step", "updated"}]``: the reports that
        ``GET .../profiles`` serves)."""
        with self._lock:
            return {**self.meta, "uid": self.meta.get("id"), "id": self.id,
                    "name": self.meta.get("name") or _display(self.path.name),
                    "status": self._status or "running", "events": list(self.events),
                    "problem": self._problem, "profiles": list(self.profiles)}

    def summary(self) -> dict[str, Any]:
        """What the runs list shows: status, step, last metrics, sparkline, problem."""
        with self._lock:
            last = self.tail.last_record or {}
            meta = self.meta
            out: dict[str, Any] = {
                "id": self.id, "uid": meta.get("id"),
                "name": meta.get("name") or _display(self.path.name),
                "status": self._status or "running",
                "step": max(meta.get("step") or 0, last.get("step") or 0),
                "target_steps": meta.get("target_steps"), "created": meta.get("created"),
                "updated": max(meta.get("updated") or 0.0, number(last.get("time")) or 0.0),
                "config_hash": meta.get("config_hash"), "device_kind": meta.get("device_kind"),
                "peak_source": _text(last.get("peak_source")) or meta.get("peak_source"),
                "points": self.tail.records_seen,
                "spark": {"step": list(self._spark_steps), "loss": list(self._spark_loss)},
                "problem": self._problem,
            }
            out.update({k: number(last.get(k)) for k in SUMMARY_KEYS})
            pred = runs.clean_prediction(meta.get("prediction"))
            out["prediction"] = None if pred is None else {
                k: pred[k] for k in PREDICTION_SUMMARY_KEYS if k in pred}
            return out


def number(v: Any) -> float | int | None:
    """A finite number as itself; anything else (NaN, inf, text, bools, null) as None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return v if runs._as_float(v) is not None else None


def _display(name: str) -> str:
    """A folder name as text to show: bytes that are not UTF-8 become U+FFFD."""
    return os.fsencode(name).decode("utf-8", "replace")


def _text(v: Any) -> str | None:
    return v[:200] if isinstance(v, str) else None


def served_meta(meta: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``run.json`` as the server sends it, and what in it was ignored: strict JSON (a
    hand-edited ``NaN`` becomes null), known fields type-checked (``runs.check_run``) and
    ``prediction`` checked field by field (``runs.clean_prediction``; None when absent or
    unusable), so no run.json breaks a response or the lab's views."""
    out, problems = runs.check_run(meta)
    out["prediction"] = runs.clean_prediction(meta.get("prediction"))
    return out, problems
