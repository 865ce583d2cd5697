"""Teaching material: how long each notebook takes top to bottom, and how long a learner
waits for an exercise's verdict.

Notebooks run exactly as ``tests/test_notebooks.py`` runs them (a fresh kernel each, no
simulated-device flag inherited, a scratch working directory); the target is the
issue's "under 2 minutes each". Exercise latency is the time of ``Exercise.check`` for
the answer a learner types: the compiled exercises lower and compile a small program on
the 8-device mesh, the others only ask JAX for shardings. The value is the first check
in the process (compilation included, what a learner waits for); the note gives the
median of 5 repeats (JAX caches the compilation).
"""
from __future__ import annotations

import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK_TARGET_S = 120.0
CHECK_TARGET_S = 2.0


def _exercise_latency() -> list[dict[str, Any]]:
    import workbench as wb
    from workbench.exercises import exercises

    rows = []
    for ex in exercises():
        times = []
        for _ in range(6):
            t0 = time.perf_counter()
            wb.exercise(ex.name).check(ex.solution)
            times.append(time.perf_counter() - t0)
        first, again = times[0], statistics.median(times[1:])
        rows.append({"name": f"exercise check latency: {ex.name}", "value": round(first, 4),
                     "unit": "s", "target": f"< {CHECK_TARGET_S:g} s",
                     "ok": first < CHECK_TARGET_S,
                     "notes": (f"notebook {ex.notebook}; first check (any compilation included); the same "
                               f"answer again: {again * 1e3:.1f} ms (median of 5)")})
    return rows


def _notebook_times() -> list[dict[str, Any]]:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_notebooks import NOTEBOOKS, run_notebook  # the test's own runner

    rows = []
    for path in NOTEBOOKS:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                _, seconds = run_notebook(path, pathlib.Path(tmp))
                ok, note = seconds < NOTEBOOK_TARGET_S, "fresh kernel, top to bottom"
            except Exception as e:  # noqa: BLE001 - report the failure as a row
                seconds, ok, note = float("nan"), False, f"failed: {type(e).__name__}"
        rows.append({"name": f"notebook run time: {path.stem}", "value": round(seconds, 1),
                     "unit": "s", "target": f"< {NOTEBOOK_TARGET_S:g} s", "ok": ok,
                     "notes": note})
    return rows


def run() -> list[dict[str, Any]]:
    """Exercise latencies (in this process), then every notebook in its own kernel."""
    return _exercise_latency() + _notebook_times()


if __name__ == "__main__":
    for row in run():
        print(row)
