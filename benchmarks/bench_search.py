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
search's seconds. Each size keeps the other's rows already in ``benchmarks/results.json``
(the pod cases' were measured by hand, hours here) until a run of that size replaces them.

Each case searched exhaustively also gets a row of the formula's rank of the exhaustive
best (``analytic_rank``: the order the exact pass compiles in; 1 when the formula ranks
like the compiler, ``workbench.perf._refit``, so the default search's first compile is
its final best).

Search times depend on the load of the machine (the TPU compiler's threads share it):
each row's notes give the load average at its start and end.
"""
from __future__ import annotations

import json
import os
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


def _rows_kept(size: str, exhaustive: bool) -> list[dict[str, Any]]:
    """The other size's rows already in results.json: a small run keeps the pod cases'
    (measured by hand, hours here), a pod run the small cases'; a run without the
    exhaustive searches also keeps its own size's formula-rank rows (it cannot redo them)."""
    path = Path(__file__).resolve().parent / "results.json"
    small = {f"wb.search {label}: default best = exhaustive best" for label in SMALL.values()}
    small |= {_rank_name(name, *_cases("small")[name][1:4]) for name in SMALL}
    ranks = {_rank_name(name, *case[1:4]) for name, case in _cases(size).items()}
    rows = json.loads(path.read_text()) if path.exists() else []
    return [{k: v for k, v in r.items() if k != "module"} for r in rows
            if r.get("module") == "bench_search" and (
                (r["name"] in small) == (size == "pod")
                or (not exhaustive and r["name"] in ranks))]


def run() -> list[dict[str, Any]]:
    """One row per case: small cases, the default search's compile count (ok when its best
    equals the exhaustive exact best); pod cases, its seconds (ok also under 60 s)."""
    import workbench as wb
    from workbench.planning import _compile

    size = os.environ.get("WB_BENCH_SEARCH", "small")
    exhaustive = os.environ.get("WB_BENCH_SEARCH_EXHAUSTIVE", "1") != "0"
    rows = []
    for name, (cfg, hw, batch, seq, opts) in _cases(size).items():
        with tempfile.TemporaryDirectory() as cache:
            os.environ["WORKBENCH_CACHE"] = cache
            _compile.clear_cache()
            load0 = _load()
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
            rows.append({"name": f"wb.search {name} on {hw}, batch {batch} x {seq}: default "
                                 "search (top_k 3, workers 2)",
                         "value": round(took, 1), "unit": "s",
                         "target": "< 60 s, best = exhaustive best",
                         "ok": same is not False and took < 60, "notes": notes})
        else:
            n_full = "?" if full is None else _compiled(full)
            rows.append({"name": f"wb.search {SMALL[name]}: default best = exhaustive best",
                         "value": _compiled(res), "unit": f"compiles (of {n_full})",
                         "target": "best = exhaustive best", "ok": same,
                         "notes": notes + "; tests/test_search_exact.py"})
    return _rows_kept(size, exhaustive) + rows
