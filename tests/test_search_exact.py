"""wb.search's best against the exhaustive exact run (issue 48 item 3): on three small
cases compiled by the TPU compiler (a dense model, a mixture of experts, a long sequence),
the default search, which compiles only the analytic best ``top_k``, is checked against
``exact="all"``, which compiles every candidate that fits by formula: the same best
layout at the same compiled step time for the dense and the long-sequence case; for the
MoE case it is not (``MISSES``: measured, strict xfail). Candidates whose formula prediction is above the MFU ceiling are
compiled in their turn (they used to be left out of the exact pass altogether), and
``workers`` compiles run at once without changing any row.

The compiled plans are read back from tests/tpu_plans (``make tpu-plans`` writes them)."""
from __future__ import annotations

import pytest

import workbench as wb
from workbench._sharding.topology import tpu_compiler_available
from workbench.models import GPTConfig

pytestmark = [pytest.mark.tpu,
              pytest.mark.skipif(not tpu_compiler_available(),
                                 reason="the TPU compiler is not installed"),
              pytest.mark.usefixtures("wb_cache")]

TINY = GPTConfig.preset("tiny")
#: name: (model, hardware, batch, seq, search options)
CASES = {
    "dense": (TINY, "v5e-8", 16, 128, {"remat": ("none", "full")}),
    "moe": (GPTConfig.preset("moe-tiny"), "v5e-8", 16, 128,
            {"remat": ("none",), "strategies": ("fsdp", "fsdp_tp", "ep", "fsdp_ep")}),
    "long": (TINY.replace(seq_len=2048), "v5e-8", 8, 2048,
             {"remat": ("none", "full"), "strategies": ("fsdp", "fsdp_tp")}),
}


def _search(name, **extra):
    cfg, hw, batch, seq, opts = CASES[name]
    return wb.search(cfg, hw, batch=batch, seq=seq, progress=False, **opts, **extra)


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request):
    """(the default search, the exhaustive one) of one case."""
    return _search(request.param), _search(request.param, exact="all")


def _compiled(res):
    return [r for r in res.rows if r["source"] != "estimate"]


def test_every_candidate_that_fits_by_formula_is_compiled_exhaustively(pair):
    _, full = pair
    for r in full.rows:
        fits_by_formula = r["analytic_memory_per_device"] <= r["limit"]
        assert (r["source"] != "estimate") == fits_by_formula, r["layout"]
    assert all(r["exact_rank"] is not None for r in full.fitting)


#: The cases whose default best is not the exhaustive best (measured): moe-tiny's
#: candidates are within 12% of each other by formula (0.0569-0.0640 ms) while each
#: compiled step is 13-26x its formula (per-op overheads a tiny model is made of), so the
#: formula's top 3 (ep/fsdp_ep on expert=8, ep on expert=2) miss fsdp data=8, which the
#: compiler puts first (0.812 ms against 0.874 ms). Strict: a better ranking fails it.
MISSES = {"moe"}


def test_the_default_best_is_the_exhaustive_best(pair, request):
    fast, full = pair
    if request.node.callspec.params["pair"] in MISSES:
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "the formula ranks moe-tiny's candidates within 12% while their compiled "
            "steps are 13-26x the formula's: top_k=3 misses the exhaustive best")))
    assert len(_compiled(fast)) < len(_compiled(full))   # it compiled fewer
    assert fast.best_row["layout"] == full.best_row["layout"]
    assert fast.best_row["step_seconds"] == full.best_row["step_seconds"]
    assert fast.best_row["source"] == "tpu-compiler"
    # each row compiled by both is the same compiled plan
    by_id = {r["id"]: r for r in full.rows}
    for r in _compiled(fast):
        assert r["step_seconds"] == by_id[r["id"]]["step_seconds"]
        assert r["memory_per_device"] == by_id[r["id"]]["memory_per_device"]


def test_workers_compile_at_once_without_changing_a_row():
    one, two = _search("dense", workers=1), _search("dense", workers=2)
    keys = ("layout", "source", "step_seconds", "memory_per_device", "exact_rank", "rank")
    assert [[r[k] for k in keys] for r in one.rows] == [[r[k] for k in keys] for r in two.rows]


def test_bad_exact_and_workers_are_refused():
    with pytest.raises(ValueError, match="exact='some'"):
        _search("dense", exact="some")
    with pytest.raises(ValueError, match="workers must be a positive int"):
        _search("dense", workers=0)
