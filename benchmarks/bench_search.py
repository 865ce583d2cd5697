"""wb.search: how many compiles the default search takes, how long, and whether its best is
the best of the exhaustive exact run (issue 48 item 3).

Three cases, each searched twice in one process with a fresh plan cache: the default
search (the analytic ranking, then the TPU compiler on the analytic best ``top_k`` and on
the candidates that could still beat them, ``search._next_batch``, ``workers`` at once)
and ``exact="all"`` (every candidate that fits by formula compiled: the reference).

``WB_BENCH_SEARCH=small`` (the default) runs the cases of ``tests/test_search_exact.py``
(tiny dense, tiny MoE, tiny at 2048 tokens on v5e-8: minutes on 2 cores); a row is the
default search's compile count, ok when its best layout and compiled step equal the
reference's. ``pod`` runs the issue's cases: 7B on v5p-128 (batch 128 x 4096),
Mixtral-8x7B on v5p-128 (batch 128 x 4096) and 7B at 32768 tokens (batch 16), each
compile minutes on 2 cores, so the exhaustive references take hours there
(``WB_BENCH_SEARCH_EXHAUSTIVE=0`` skips them, for either size); a row is the default
search's seconds. ``WB_BENCH_SEARCH_CASES`` (comma-separated, e.g. ``dense 7b``) runs only those cases.
A run keeps the rows already in ``benchmarks/results.json`` that it does not measure
again (hand-measured rows, the other size's and cases', the exhaustive comparisons a run
without them skips). A pod case's default search runs with ``wait=False``, polled: its row
says when the final best's compiled row was in the table and when the exact pass ended.

Each case searched exhaustively also gets a row of the formula's rank of the exhaustive
best (``analytic_rank``: the order the exact pass compiles in; 1 when the formula ranks
like the compiler, ``workbench.perf._refit``, so the default search's first compile is
its final best).

Search times depend on the load of the machine (the TPU compiler's threads share it):
each row's notes give the load average at its start and end.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

#: what a small case's row is called: its name and what it varies
SMALL = {
    "dense tiny": "tiny dense on v5e-8, batch 16 x 128 (dp/fsdp/tp/fsdp_tp x remat none/full)",
    "moe moe-tiny": "moe-tiny on v5e-8, batch 16 x 128 (fsdp/fsdp_tp/ep/fsdp_ep, remat none)",
    "long tiny 2048": "tiny at 2048 tokens on v5e-8, batch 8 x 2048 (fsdp/fsdp_tp x remat "
                      "none/full)",
}


def _cases(size: str) -> dict[str, tuple[Any, str, int, int, dict[str, Any]]]:
    from workbench.models import GPTConfig

    if size == "pod":
        b7 = GPTConfig.preset("7b")
        return {"dense 7b": (b7, "v5p-128", 128, 4096, {}),
                "moe mixtral-8x7b": (GPTConfig.preset("mixtral-8x7b"), "v5p-128", 128, 4096,
                                     {"remat": ("dots", "full")}),
                "long 7b 32k": (b7.replace(seq_len=32768), "v5p-128", 16, 32768, {})}
    tiny = GPTConfig.preset("tiny")
    return {"dense tiny": (tiny, "v5e-8", 16, 128, {"remat": ("none", "full")}),
            "moe moe-tiny": (GPTConfig.preset("moe-tiny"), "v5e-8", 16, 128,
                             {"remat": ("none",),
                              "strategies": ("fsdp", "fsdp_tp", "ep", "fsdp_ep")}),
            "long tiny 2048": (tiny.replace(seq_len=2048), "v5e-8", 8, 2048,
                               {"remat": ("none", "full"), "strategies": ("fsdp", "fsdp_tp")})}


#: a pod case's row of the default search's seconds: what it names (its label and
#: candidates are filled in)
POD_LABELS = {"dense 7b": "7b on v5p-128, batch 128 x 4096",
              "moe mixtral-8x7b": "mixtral-8x7b on v5p-128, batch 128 x 4096",
              "long 7b 32k": "7b at 32768 tokens on v5p-128, batch 16 x 32768"}


def _time_row_name(name: str, candidates: int) -> str:
    return (f"wb.search {POD_LABELS[name]} ({candidates} candidates): the default search "
            "(top_k 3, workers 2)")


def _superseded(row_name: str, name: str) -> bool:
    """Whether an earlier row ``row_name`` is a pod case ``name``'s default-search time
    (any candidate count; "the default search now" as the hand-measured rows said)."""
    return re.fullmatch(rf"wb\.search {re.escape(POD_LABELS[name])} \(\d+ candidates\): "
                        r"the default search( now)? \(top_k 3, workers 2\)", row_name) is not None


def _timed_search(cfg: Any, hw: str, batch: int, seq: int, opts: dict[str, Any]
                  ) -> tuple[Any, float, float | None]:
    """The default search with ``wait=False``, polled: (its result, its seconds, the
    seconds when its final best's compiled row had landed, None if it was never
    compiled)."""
    import workbench as wb

    t0 = time.perf_counter()
    res = wb.search(cfg, hw, batch=batch, seq=seq, progress=False, wait=False, **opts)
    seen: list[tuple[float, str]] = []   # (seconds, the compiled best's layout) as it moved
    while True:
        try:
            res.wait(timeout=0.5)
            break
        except TimeoutError:
            pass
        with contextlib.suppress(ValueError):
            row = res.best_row
            if row["source"] != "estimate" and (not seen or seen[-1][1] != row["layout"]):
                seen.append((time.perf_counter() - t0, row["layout"]))
    took = time.perf_counter() - t0
    final = res.best_row["layout"]
    at = next((t for t, lay in reversed(seen) if lay != final), None)
    landed = next((t for t, lay in seen if lay == final and (at is None or t > at)), took)
    return res, took, landed if res.best_row["source"] != "estimate" else None


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def _compiled(res: Any) -> int:
    return sum(r["source"] != "estimate" for r in res.rows)


def _rank_name(name: str, hw: str, batch: int, seq: int) -> str:
    return f"wb.search {name} on {hw}, batch {batch} x {seq}: the formula's rank of the " \
           "exhaustive best"


def _rank_row(name: str, hw: str, batch: int, seq: int, full: Any, size: str
              ) -> dict[str, Any]:
    """The formula's rank (``analytic_rank``, the order the exact pass compiles in) of the
    exhaustive search's best: 1 when the formula ranks like the compiler, so the default
    search's first compile is its final best (issue 59 item 3)."""
    best = full.best_row
    rank = best["analytic_rank"]
    first = min((r for r in full.rows if r["analytic_rank"] is not None),
                key=lambda r: r["analytic_rank"], default=None)
    return {"name": _rank_name(name, hw, batch, seq), "value": rank, "unit": "formula rank",
            "target": "1 (the formula's first is the exhaustive best)", "ok": rank == 1,
            "notes": f"exhaustive best {best['layout']} {best['step_seconds'] * 1e3:.4g} ms "
                     f"compiled, {best['analytic_step_seconds'] * 1e3:.4g} ms by formula; "
                     f"the formula's first: "
                     + ("none" if first is None else
                        f"{first['layout']} ({first['analytic_step_seconds'] * 1e3:.4g} ms)")
                     + f"; {_compiled(full)} of {len(full.rows)} candidates compiled "
                       "(exact='all'); workbench.perf._refit"
                     + ("; tests/test_search_exact.py" if size == "small" else "")}


def _rows_kept(fresh: list[dict[str, Any]], ran: list[str]) -> list[dict[str, Any]]:
    """The rows already in results.json that this run did not measure again: every
    bench_search row but those named as a ``fresh`` one and the default-search times of
    the pod cases ``ran`` (rows measured by hand, the other size's and cases', and the
    exhaustive searches' when this run skipped them, stay)."""
    path = Path(__file__).resolve().parent / "results.json"
    names = {r["name"] for r in fresh}
    rows = json.loads(path.read_text()) if path.exists() else []
    return [{k: v for k, v in r.items() if k != "module"} for r in rows
            if r.get("module") == "bench_search" and r["name"] not in names
            and not any(n in POD_LABELS and _superseded(r["name"], n) for n in ran)]


def run() -> list[dict[str, Any]]:
    """One row per case: small cases, the default search's compile count (ok when its best
    equals the exhaustive exact best); pod cases, its seconds (ok also under 60 s)."""
    import workbench as wb
    from workbench.planning import _compile

    size = os.environ.get("WB_BENCH_SEARCH", "small")
    exhaustive = os.environ.get("WB_BENCH_SEARCH_EXHAUSTIVE", "1") != "0"
    cases = _cases(size)
    only = [c.strip() for c in os.environ.get("WB_BENCH_SEARCH_CASES", "").split(",")
            if c.strip()]
    unknown = sorted(set(only) - set(cases))
    if unknown:
        raise ValueError(f"WB_BENCH_SEARCH_CASES: {unknown} are not {size} cases; the "
                         f"{size} cases: {sorted(cases)}")
    rows, ran, landed = [], [], None
    for name, (cfg, hw, batch, seq, opts) in cases.items():
        if only and name not in only:
            continue
        ran.append(name)
        with tempfile.TemporaryDirectory() as cache:
            os.environ["WORKBENCH_CACHE"] = cache
            _compile.clear_cache()
            load0 = _load()
            if size == "pod":
                res, took, landed = _timed_search(cfg, hw, batch, seq, opts)
            else:
                t0 = time.perf_counter()
                res = wb.search(cfg, hw, batch=batch, seq=seq, progress=False, **opts)
                took = time.perf_counter() - t0
            load1 = _load()
            full, t_full = None, None
            if exhaustive:
                t0 = time.perf_counter()
                full = wb.search(cfg, hw, batch=batch, seq=seq, progress=False,
                                 exact="all", **opts)
                t_full = time.perf_counter() - t0
        best = res.best_row
        same = None if full is None else (
            best["layout"] == full.best_row["layout"]
            and best["step_seconds"] == full.best_row["step_seconds"])
        stop = next((n for n in res.notes if n.startswith("exact pass:")), "")
        notes = (f"default: {_compiled(res)} of {len(res.rows)} candidates compiled in "
                 f"{took:.0f} s, best {best['layout']} {best['step_seconds'] * 1e3:.4g} ms "
                 f"({best['source']}); {stop}"
                 + ("" if full is None else
                    f"; exhaustive ({_compiled(full)} compiled, {t_full:.0f} s): best "
                    f"{full.best_row['layout']} {full.best_row['step_seconds'] * 1e3:.4g} ms: "
                    f"{'same' if same else 'DIFFERENT'}")
                 + f"; load average {load0} at start, {load1} after the default search")
        if full is not None:
            rows.append(_rank_row(name, hw, batch, seq, full, size))
        if size == "pod":
            when = "never compiled" if landed is None else f"{landed:.0f} s"
            rows.append({"name": _time_row_name(name, len(res.rows)),
                         "value": round(took, 1), "unit": "s",
                         "target": "< 60 s" if name != "long 7b 32k" else "< 120 s",
                         "ok": same is not False and took < (
                             120 if name == "long 7b 32k" else 60),
                         "notes": f"cold (a fresh plan cache), wait=False polled every "
                                  f"0.5 s: the final best's compiled row in the table at "
                                  f"{when}, the exact pass ended at {took:.0f} s; " + notes})
        else:
            n_full = "?" if full is None else _compiled(full)
            rows.append({"name": f"wb.search {SMALL[name]}: default best = exhaustive best",
                         "value": _compiled(res), "unit": f"compiles (of {n_full})",
                         "target": "best = exhaustive best", "ok": same,
                         "notes": notes + "; tests/test_search_exact.py"})
    return _rows_kept(rows, ran) + rows
