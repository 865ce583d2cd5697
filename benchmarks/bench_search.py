"""wb.search: how long the search takes, and whether its best is the best of the
exhaustive exact run (issue 48 item 3).

Three cases, each searched twice in one process with a fresh plan cache: the default
search (the analytic ranking, then the TPU compiler on the analytic best ``top_k``,
``workers`` at once) and ``exact="all"`` (every candidate that fits by formula compiled:
the reference). A row says the default search's time and whether its best layout and
compiled step equal the reference's.

``WB_BENCH_SEARCH=small`` (the default) runs the cases of ``tests/test_search_exact.py``
(tiny dense, tiny MoE, tiny at 2048 tokens on v5e-8: minutes on 2 cores); ``pod`` runs the
issue's cases: 7B on v5p-128 (batch 128 x 4096), Mixtral-8x7B on v5p-128 (batch 128 x
4096) and 7B at 32768 tokens (batch 16), each compile minutes on 2 cores, so the
exhaustive references take hours there (``WB_BENCH_SEARCH_EXHAUSTIVE=0`` skips them).

Search times depend on the load of the machine (the TPU compiler's threads share it):
each row's notes give the load average at its start and end.
"""
from __future__ import annotations

import os
import tempfile
import time
from typing import Any


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


def run() -> list[dict[str, Any]]:
    """One row per case: the default search's seconds; ok when its best equals the
    exhaustive exact best (and, for the pod cases, it took under 60 s)."""
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
        compiled = sum(r["source"] != "estimate" for r in res.rows)
        same = None if full is None else (
            best["layout"] == full.best_row["layout"]
            and best["step_seconds"] == full.best_row["step_seconds"])
        target = "< 60 s, best = exhaustive best" if size == "pod" else "best = exhaustive best"
        ok = same if size != "pod" else (same is not False and took < 60)
        rows.append({
            "name": f"wb.search {name} on {hw}, batch {batch} x {seq}: default search "
                    f"(top_k 3, workers 2)",
            "value": round(took, 1), "unit": "s", "target": target, "ok": ok,
            "notes": (f"{len(res.rows)} candidates, {compiled} compiled; best "
                      f"{best['layout']} {best['step_seconds'] * 1e3:.4g} ms ({best['source']})"
                      + ("" if full is None else
                         f"; exhaustive ({sum(r['source'] != 'estimate' for r in full.rows)} "
                         f"compiled, {t_full:.0f} s): best {full.best_row['layout']} "
                         f"{full.best_row['step_seconds'] * 1e3:.4g} ms: "
                         f"{'same' if same else 'DIFFERENT'}")
                      + f"; load average {load0} at start, {load1} after the default search")})
    return rows
