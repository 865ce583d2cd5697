"""A run's profiles as the server serves them: ``profiles/<step>/report.json`` checked.

``trainer.profile()`` writes each trace into ``<run_dir>/profiles/<first traced step>/``
with ``report.json`` beside it: the plan's predicted seconds per term and the measured
seconds of the same term, the largest disagreement in words, tokens/s during and outside
the profile. This module reads those files without JAX (the server never imports it) and
keeps only what readers may trust: finite numbers, text cut to length, at most
:data:`MAX_PROFILES` profiles of at most :data:`MAX_BYTES` each. A file that cannot be used
is listed with its ``problem`` instead of breaking the response.
"""
from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

from workbench import _runs as runs
from workbench._run_file import read_file, resolves_inside

__all__ = ["MAX_BYTES", "MAX_PROFILES", "read_profiles", "stamp"]

PROFILES = "profiles"
REPORT = "report.json"
MAX_PROFILES = 50      # the most recent ones by step; older ones stay on disk
MAX_BYTES = 4 * 2**20  # a report is ~10 KB: anything far larger was not written by the trainer
MAX_SCAN = 10_000      # profile folders looked at per run
MAX_ROWS = 200
MAX_OPS = 20
_TEXT = 2000


def _entries(run_dir: Path) -> list[tuple[str, os.stat_result]]:
    """``(folder name, stat of its report.json)`` of every profile folder with a report
    (at most :data:`MAX_SCAN` folders looked at). ``profiles/`` leading out of the run
    directory lists nothing; a step folder or report leading out of it is listed with
    the stat of the link itself, and :func:`read_profiles` says why it is not served."""
    out: list[tuple[str, os.stat_result]] = []
    if not resolves_inside(run_dir / PROFILES, run_dir):
        return out
    try:
        with os.scandir(run_dir / PROFILES) as it:
            folders = list(itertools.islice(it, MAX_SCAN))
    except OSError:
        return out
    for d in folders:
        report = Path(d.path) / REPORT
        try:
            if not d.is_dir():
                continue
            if not resolves_inside(d.path, run_dir):
                out.append((d.name, d.stat(follow_symlinks=False)))
            elif os.path.lexists(report):
                out.append((d.name, os.stat(report) if resolves_inside(report, run_dir)
                            else os.lstat(report)))
        except OSError:
            continue   # no report (yet): a trace being taken, or one taken with directory=
    return out


def _step(name: str) -> int | None:
    """The first traced step of a folder ``"12"`` or ``"12-2"`` (a second profile there)."""
    head = name.split("-", 1)[0]
    return int(head) if head.isdigit() and len(head) < 16 else None


def _order(name: str) -> tuple[int, int, str]:
    step = _step(name)
    return (step if step is not None else -1, len(name), name)


def stamp(run_dir: Path) -> tuple[tuple[str, int, int], ...]:
    """What changes when a report is written, replaced or removed (polled by the index)."""
    return tuple(sorted((n, st.st_mtime_ns, st.st_size) for n, st in _entries(run_dir)))


def summaries(run_dir: Path) -> list[dict[str, Any]]:
    """``[{"name": "12", "step": 12, "updated": <mtime>}]``, oldest first (run detail)."""
    entries = sorted(_entries(run_dir), key=lambda e: _order(e[0]))[-MAX_PROFILES:]
    return [{"name": n, "step": _step(n), "updated": st.st_mtime} for n, st in entries]


def _num(v: Any) -> float | None:
    return runs._as_float(v)


def _text(v: Any) -> str:
    return v[:_TEXT] if isinstance(v, str) else ""


def _row(r: Any) -> dict[str, Any] | None:
    if not isinstance(r, dict) or not isinstance(r.get("name"), str):
        return None
    pred, meas = _num(r.get("predicted")), _num(r.get("measured"))
    if pred is None or meas is None:
        return None
    axes = r.get("axes")
    count = r.get("count")
    return {"name": r["name"][:200], "predicted": pred, "measured": meas,
            "kind": _text(r.get("kind"))[:100],
            "axes": [a[:100] for a in axes if isinstance(a, str)] if isinstance(axes, list) else [],
            "count": count if isinstance(count, int) and not isinstance(count, bool) else 0,
            "wait": _num(r.get("wait")) or 0.0, "note": _text(r.get("note")),
            "ratio": meas / pred if pred > 0 else None}


def _op(o: Any) -> dict[str, Any] | None:
    if not isinstance(o, dict) or _num(o.get("seconds")) is None:
        return None
    return {"name": _text(o.get("name"))[:300], "category": _text(o.get("category"))[:50],
            "seconds": _num(o.get("seconds")), "source": _text(o.get("source"))[:300]}


def clean_report(data: Any) -> tuple[dict[str, Any], list[str]]:
    """A parsed ``report.json`` reduced to checked fields, and what was dropped."""
    if not isinstance(data, dict):
        return {"rows": []}, [f"holds a JSON {type(data).__name__}, not an object"]
    problems: list[str] = []
    raw = data.get("rows") if isinstance(data.get("rows"), list) else []
    rows = [r for r in (_row(x) for x in raw[:MAX_ROWS]) if r is not None]
    if len(rows) != len(raw[:MAX_ROWS]):
        problems.append(f"{len(raw[:MAX_ROWS]) - len(rows)} of {len(raw[:MAX_ROWS])} rows lack "
                        "a name and finite predicted and measured seconds")
    if len(raw) > MAX_ROWS:
        problems.append(f"only the first {MAX_ROWS} of its {len(raw)} rows are served")
    tps = data.get("tokens_per_s") if isinstance(data.get("tokens_per_s"), dict) else {}
    tps = {k: float(v) for k, v in tps.items()
           if k in ("outside", "during") and (_num(v) or 0) > 0}
    mesh = data.get("mesh") if isinstance(data.get("mesh"), dict) else {}
    ops = data.get("top_ops") if isinstance(data.get("top_ops"), list) else []
    steps = data.get("steps")
    out = {"rows": rows, "verdict": _text(data.get("verdict")),
           "plan_name": _text(data.get("plan_name"))[:200],
           "device_kind": _text(data.get("device_kind"))[:200],
           "mesh": {str(k)[:50]: v for k, v in mesh.items()
                    if isinstance(v, int) and not isinstance(v, bool)},
           "steps": steps if isinstance(steps, int) and not isinstance(steps, bool) else None,
           "tokens_per_s": tps,
           "overhead": tps["outside"] / tps["during"] - 1.0 if len(tps) == 2 else None,
           "calibrated": data.get("calibrated") is True,
           "top_ops": [o for o in (_op(x) for x in ops[:MAX_OPS]) if o is not None]}
    return out, problems


def read_profiles(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The run's profiles, oldest first: ``{"name", "step", "path", "updated", "problem",
    "rows", "verdict", ...}`` (see :func:`clean_report`). Each report is read by the one
    safe reader of run files (``workbench._run_file``: a regular file inside the run directory,
    symlinks resolved, at most :data:`MAX_BYTES`, never blocking). A report that cannot be
    read keeps its name and says why in ``problem``, with no rows."""
    run_dir = Path(run_dir)
    out = []
    for item in summaries(run_dir):
        path = run_dir / PROFILES / item["name"] / REPORT
        where = f"{PROFILES}/{item['name']}/{REPORT}"
        problems: list[str] = []
        try:
            raw = read_file(path, inside=run_dir, max_bytes=MAX_BYTES)
            data = json.loads(raw)
            report, problems = clean_report(runs.json_safe(data))
        except IsADirectoryError:
            report, problems = {"rows": []}, ["is a directory, not a file"]
        except (OSError, ValueError, RecursionError) as e:
            why = str(e).replace(f"{path} ", "", 1)[:300]
            report, problems = {"rows": []}, [f"cannot be read ({why})"]
        out.append({**item, "path": f"{PROFILES}/{item['name']}", **report,
                    "problem": f"{where} {'; '.join(problems)}" if problems else None})
    return out
