"""The server's view of the run roots: found runs, their tails, summaries and sparklines.

Pure bookkeeping over ``workbench.runs`` (no tornado, no jax). All methods are
thread-safe: the extension calls them from a worker thread so that reading a large
metrics file never blocks the server's event loop.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench import runs

SPARK_POINTS = 64  # a sparkline keeps between 64 and 128 evenly strided points
SUMMARY_KEYS = ("loss", "mfu", "hfu", "tokens_per_s", "step_time", "grad_norm", "lr")
PREDICTION_SUMMARY_KEYS = ("step_seconds", "mfu", "bound", "source")


class RunWatch:
    """One run directory followed incrementally: ``run.json`` and new metrics lines."""

    def __init__(self, rid: str, path: Path) -> None:
        self.id = rid
        self.path = path
        self.tail = runs.MetricsTail(path)
        self.meta: dict[str, Any] = {}
        self.events: list[dict[str, Any]] = []
        self._meta_stamp: tuple[int, int] | None = None
        self._status = ""
        self._spark_steps: list[int] = []
        self._spark_loss: list[float | None] = []
        self._stride = 1
        self._lock = threading.Lock()

    def refresh(self) -> tuple[list[dict[str, Any]], bool, bool]:
        """Reads what changed: ``(new step records, run.json/status changed, tail reset)``."""
        with self._lock:
            changed = False
            try:
                st = os.stat(self.path / runs.RUN_JSON)
                stamp = (st.st_mtime_ns, st.st_size)
                if stamp != self._meta_stamp:
                    self.meta, self._meta_stamp, changed = (served_meta(runs.read_run(self.path)),
                                                            stamp, True)
            except (OSError, ValueError, TypeError):
                pass  # mid-replace or gone: the next poll (or a scan) sorts it out
            status = runs.effective_status(self.meta) if self.meta else "running"
            changed = changed or status != self._status
            self._status = status
            resets = self.tail.resets
            records, events = self.tail.poll()
            reset = self.tail.resets != resets
            if reset:
                self._spark_steps, self._spark_loss, self._stride = [], [], 1
            self.events = (self.events + events)[-100:]
            for rec in records:
                self._add_spark(rec)
            return records, changed, reset

    def _add_spark(self, rec: dict[str, Any]) -> None:
        if (self.tail.records_seen - 1) % self._stride:
            return
        loss = rec.get("loss")
        self._spark_steps.append(rec["step"])
        self._spark_loss.append(loss if isinstance(loss, (int, float)) else None)
        if len(self._spark_steps) >= 2 * SPARK_POINTS:  # halve the resolution, double stride
            self._spark_steps, self._spark_loss = self._spark_steps[::2], self._spark_loss[::2]
            self._stride *= 2

    def read(self, since: int, limit: int | None) -> list[dict[str, Any]]:
        """Step records above ``since`` (what ``refresh`` has seen)."""
        with self._lock:
            return self.tail.read(since, limit)

    def detail(self) -> dict[str, Any]:
        """``run.json`` with the URL ``id``, the file's own id as ``uid`` and recent events."""
        with self._lock:
            return {**self.meta, "uid": self.meta.get("id"), "id": self.id,
                    "status": self._status or "running", "events": list(self.events)}

    def summary(self) -> dict[str, Any]:
        """What the runs list shows: status, step, last metrics, sparkline."""
        with self._lock:
            last = self.tail.last_record or {}
            meta = self.meta
            out: dict[str, Any] = {
                "id": self.id, "uid": meta.get("id"), "name": meta.get("name", self.id),
                "status": self._status or "running",
                "step": max(int(meta.get("step") or 0), int(last.get("step") or 0)),
                "target_steps": meta.get("target_steps"), "created": meta.get("created"),
                "updated": max(float(meta.get("updated") or 0), float(last.get("time") or 0)),
                "config_hash": meta.get("config_hash"), "device_kind": meta.get("device_kind"),
                "peak_source": last.get("peak_source", meta.get("peak_source")),
                "points": self.tail.records_seen,
                "spark": {"step": list(self._spark_steps), "loss": list(self._spark_loss)},
            }
            out.update({k: last.get(k) for k in SUMMARY_KEYS})
            pred = meta.get("prediction")
            out["prediction"] = None if pred is None else {
                k: pred[k] for k in PREDICTION_SUMMARY_KEYS if k in pred}
            return out


def served_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """``run.json`` as the server sends it: strict JSON (a hand-edited ``NaN`` becomes
    null) and ``prediction`` checked field by field (``runs.clean_prediction``; None when
    absent or unusable), so no run.json breaks a response or the lab's views."""
    out = runs.json_safe(meta)
    out["prediction"] = runs.clean_prediction(meta.get("prediction"))
    return out


@dataclass
class Change:
    """What one poll found for one run."""

    watch: RunWatch
    records: list[dict[str, Any]] = field(default_factory=list)
    meta_changed: bool = False
    reset: bool = False


class RunIndex:
    """The runs under a list of roots, found by a bounded-depth scan and polled.

    Args:
      roots: run roots; ids under ``roots[0]`` are relative paths, ``"k:path"`` otherwise.
      max_depth: how deep below each root to look for ``run.json``.
      scan_interval: seconds between directory scans for new or removed runs.
    """

    def __init__(self, roots: Sequence[str | os.PathLike[str]], *, max_depth: int = 4,
                 scan_interval: float = 2.0) -> None:
        self.roots = [Path(r) for r in roots]
        self.max_depth = max_depth
        self.scan_interval = scan_interval
        self.watches: dict[str, RunWatch] = {}
        self._next_scan = -float("inf")
        self._lock = threading.RLock()

    def watch(self, rid: str) -> RunWatch:
        """The watch of run ``rid`` (resolved safely inside the roots; raises
        ``ValueError`` for malformed ids, ``FileNotFoundError`` for unknown runs)."""
        path = runs.resolve_run(self.roots, rid)
        with self._lock:
            w = self.watches.get(rid)
            if w is None or w.path != path:
                w = self.watches[rid] = RunWatch(rid, path)
        return w

    def scan(self) -> tuple[list[str], list[str]]:
        """Re-walks the roots: ``(added ids, removed ids)``.

        The next scan is due after ``scan_interval`` or ten times this scan's duration,
        whichever is longer, so a huge root costs at most ~10% of one core.
        """
        t0 = time.monotonic()
        found: dict[str, Path] = {}
        for k, root in enumerate(self.roots):
            for d in runs.find_run_dirs(root, self.max_depth):
                rid = runs.run_id(root, d)
                found.setdefault(rid if k == 0 else f"{k}:{rid}", d)
        with self._lock:
            now = time.monotonic()
            self._next_scan = now + max(self.scan_interval, 10 * (now - t0))
            added = [rid for rid in found if rid not in self.watches]
            removed = [rid for rid, w in self.watches.items()
                       if rid not in found and not (w.path / runs.RUN_JSON).is_file()]
            for rid in added:
                self.watches[rid] = RunWatch(rid, found[rid])
            for rid in removed:
                del self.watches[rid]
        return added, removed

    def poll(self, force_scan: bool = False) -> tuple[list[Change], list[str]]:
        """Scans when due, then refreshes every run: ``(changes, removed ids)``."""
        removed: list[str] = []
        if force_scan or time.monotonic() >= self._next_scan:
            _, removed = self.scan()
        with self._lock:
            watches = list(self.watches.values())
        changes = []
        for w in watches:
            records, meta_changed, reset = w.refresh()
            if records or meta_changed or reset:
                changes.append(Change(w, records, meta_changed, reset))
        return changes, removed

    def summaries(self) -> list[dict[str, Any]]:
        """Summaries of every run found, most recently updated first."""
        with self._lock:
            watches = [w for w in self.watches.values() if w.meta]
        return sorted((w.summary() for w in watches), key=lambda s: -s["updated"])
