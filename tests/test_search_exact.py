"""wb.search's best against the exhaustive exact run (issue 48 item 3): on three small
cases compiled by the TPU compiler (a dense model, a mixture of experts, a long sequence),
the default search, which compiles the analytic best ``top_k`` and then the candidates that
could still beat them (``ranking.next_batch``), is checked against ``exact="all"``, which
compiles every candidate that fits by formula: the same best layout at the same compiled
step time, in fewer compiles. Candidates whose formula prediction is above the MFU ceiling
are compiled in their turn (they used to be left out of the exact pass altogether), and
``workers`` compiles run at once without changing any row. The stopping rule itself is
checked without a compiler, on tables of formula and compiled steps (moe-tiny's on v5e-8,
the 7B's on v5p-128 at 4096 and at 32768 tokens, measured) against the exhaustive pass
over the same table.

The compiled plans are read back from tests/tpu_plans (``make tpu-plans`` writes them)."""
from __future__ import annotations

import inspect
import types

import pytest

import workbench as wb
from _tpu import tpu
from workbench._search.passes import Search
from workbench._search.space import SearchOptions
from workbench.models import GPTConfig
from workbench.planning._options import PlanOptions

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


@pytest.fixture(scope="module")
def searches():
    """``_search``, run once per module for each case and arguments: the default search of
    "dense" is both ``pair``'s and the workers test's 2-worker run."""
    done = {}

    def search(name, **extra):
        key = (name, tuple(sorted(extra.items())))
        if key not in done:
            done[key] = _search(name, **extra)
        return done[key]

    return search


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, searches):
    """(the default search, the exhaustive one, the case's name) of one case."""
    return searches(request.param), searches(request.param, exact="all"), request.param


def _compiled(res):
    return [r for r in res.rows if r["source"] != "estimate"]


@tpu
def test_every_candidate_that_fits_by_formula_is_compiled_exhaustively(pair):
    _, full, _ = pair
    for r in full.rows:
        fits_by_formula = r["analytic_memory_per_device"] <= r["limit"]
        assert (r["source"] != "estimate") == fits_by_formula, r["layout"]
    assert all(r["exact_rank"] is not None for r in full.fitting)


#: case: (compiles of the default search, why it stopped), by the rule: dense's 8 candidates
#: are each its own strategy and remat policy, so after the top 3 each could win until the
#: cap (2 x top_k = 6); moe's ep/fsdp_ep/ep top 3 leave fsdp and fsdp_tp to compile, and
#: then no candidate could win; long's 4 are each its own strategy and remat policy
STOPS = {"dense": (6, "the cap (2 x top_k); analytic ranks"),
         "moe": (5, "stopped: no remaining candidate could beat {at}"),
         "long": (4, "every candidate that fits by formula")}


@tpu
def test_the_default_best_is_the_exhaustive_best(pair):
    fast, full, name = pair
    assert fast.best_row["layout"] == full.best_row["layout"]
    assert fast.best_row["step_seconds"] == full.best_row["step_seconds"]
    assert fast.best_row["source"] == "tpu-compiler"
    # how many it compiled, and why it stopped
    n, why = STOPS[name]
    (stop,) = [note for note in fast.notes if note.startswith("exact pass:")]
    at = f"{full.best_row['step_seconds'] * 1e3:.4g} ms"
    assert len(_compiled(fast)) == n <= len(_compiled(full)), stop
    assert stop.startswith(f"exact pass: {n} compiled") and why.format(at=at) in stop, stop
    # each row compiled by both is the same compiled plan
    by_id = {r["id"]: r for r in full.rows}
    for r in _compiled(fast):
        assert r["step_seconds"] == by_id[r["id"]]["step_seconds"]
        assert r["memory_per_device"] == by_id[r["id"]]["memory_per_device"]


@tpu
def test_workers_compile_at_once_without_changing_a_row(searches):
    # wb.search compiles 2 at once by default: the 2-worker run is the default search
    assert inspect.signature(wb.search).parameters["workers"].default == 2
    one, two = _search("dense", workers=1), searches("dense")
    keys = ("layout", "source", "step_seconds", "memory_per_device", "exact_rank", "rank")
    assert [[r[k] for k in keys] for r in one.rows] == [[r[k] for k in keys] for r in two.rows]


@tpu
def test_bad_exact_and_workers_are_refused():
    with pytest.raises(ValueError, match="exact='some'"):
        _search("dense", exact="some")
    with pytest.raises(ValueError, match="workers must be a positive int"):
        _search("dense", workers=0)


# -- the stopping rule, without a compiler -------------------------------------------------

#: moe-tiny on v5e-8 (the "moe" case above), measured: (layout, formula ms, compiled ms) in
#: the formula's order. The compiled/formula ratios are 14.0-25.6x; the ep and fsdp_ep
#: layouts first by formula show 15.4-15.9x, fsdp (analytic rank 4) 14.0x: the best.
MOE_TINY = [("ep data=1 expert=8", 0.0569, 0.9014), ("fsdp_ep data=1 expert=8", 0.05691, 0.9014),
            ("ep data=4 expert=2", 0.05692, 0.8737), ("fsdp data=8 model=1", 0.0578, 0.8117),
            ("fsdp_tp data=4 model=2", 0.0599, 1.5332), ("fsdp_ep data=2 expert=4", 0.0600, 0.9116),
            ("ep data=2 expert=4", 0.0627, 0.9121), ("fsdp_ep data=4 expert=2", 0.0640, 0.8590)]


#: the 7B on v5p-128, batch 128 x 4096 (BENCHMARKS.md bench_search, exact='all', 25
#: compiles): (layout, formula ms, compiled ms or None where the compiler refused the step
#: as out of memory) in the formula's order; the two fsdp rows first by formula are above
#: the MFU ceiling (not ranked by formula, compiled in their place). The compiled/formula
#: ratio depends on remat: fsdp_tp data=32 model=2 1.30x with none, 1.16x with dots (rank
#: 5): the best. Of the 25, those the compiled memory says do not fit are left out.
DENSE_7B = [
    ("fsdp data=64 model=1 remat=none", 804.53, 1685.77),
    ("fsdp data=64 model=1 remat=dots", 826.09, 1570.91),
    ("fsdp_tp data=32 model=2 remat=none", 998.40, 1296.35),
    ("tp data=32 model=2 remat=none", 998.40, None),
    ("fsdp data=64 model=1 remat=full", 1005.75, 1641.41),
    ("tp data=32 model=2 remat=dots", 1019.96, 1734.67),
    ("fsdp_tp data=32 model=2 remat=dots", 1019.96, 1187.09),
    ("tp data=16 model=4 remat=none", 1095.34, None),
    ("fsdp_tp data=16 model=4 remat=none", 1095.34, None),
    ("tp data=16 model=4 remat=dots", 1116.90, 1858.91),
    ("fsdp_tp data=16 model=4 remat=dots", 1116.90, 1477.81),
    ("tp data=32 model=2 remat=full", 1199.62, 1899.71),
    ("fsdp_tp data=32 model=2 remat=full", 1199.62, 1394.51),
    ("tp data=8 model=8 remat=none", 1256.90, None),
    ("fsdp_tp data=8 model=8 remat=none", 1256.90, None),
    ("tp data=8 model=8 remat=dots", 1278.46, 2352.26),
    ("fsdp_tp data=8 model=8 remat=dots", 1278.46, 2189.91),
    ("tp data=16 model=4 remat=full", 1296.56, 2069.54),
    ("fsdp_tp data=16 model=4 remat=full", 1296.56, 1686.48),
    ("tp data=8 model=8 remat=full", 1458.12, 2606.54),
    ("fsdp_tp data=8 model=8 remat=full", 1458.12, 2452.02),
    ("tp data=4 model=16 remat=full", 1732.76, 3731.83),
    ("fsdp_tp data=4 model=16 remat=full", 1732.76, 3949.91),
]


#: the 7B at 32768 tokens on v5p-128, batch 16 (BENCHMARKS.md bench_search, exact='all',
#: 16 compiles), as DENSE_7B; a 4th item False: compiled, but its compiled memory does not
#: fit. Every remat=none step is refused; fsdp_tp data=16 model=4 remat=dots is the best
#: (analytic rank 4).
LONG_7B = [
    ("tp data=16 model=4 remat=none", 1698.99, None),
    ("fsdp_tp data=16 model=4 remat=none", 1698.99, None),
    ("tp data=16 model=4 remat=dots", 1854.70, 3227.29),
    ("fsdp_tp data=16 model=4 remat=dots", 1854.70, 2510.84),
    ("tp data=8 model=8 remat=none", 1860.55, None),
    ("fsdp_tp data=8 model=8 remat=none", 1860.55, None),
    ("tp data=8 model=8 remat=dots", 2016.26, 4028.40),
    ("fsdp_tp data=8 model=8 remat=dots", 2016.26, 3733.95),
    ("tp data=16 model=4 remat=full", 2034.36, 3311.41),
    ("fsdp_tp data=16 model=4 remat=full", 2034.36, 2653.11),
    ("fsdp_tp data=8 model=8 remat=full", 2195.91, 3826.84),
    ("tp data=8 model=8 remat=full", 2195.91, 4074.65),
    ("fsdp_tp data=4 model=16 remat=dots", 2290.90, 6167.63, False),
    ("tp data=4 model=16 remat=dots", 2290.90, 6068.42, False),
    ("tp data=4 model=16 remat=full", 2470.56, 5763.23),
    ("fsdp_tp data=4 model=16 remat=full", 2470.56, 6155.19),
]


class _Table(Search):
    """A search whose "compiler" reads each candidate's compiled step from a table (None:
    the compiler refuses the step as out of memory)."""

    def compile(self, c, turn):
        refused = c.compiled is None
        return types.SimpleNamespace(memory={"compiler_required_temp": 3} if refused else {},
                                     source="tpu-compiler", source_reason="refused",
                                     step=c.compiled, fits=c.fits)

    def measure(self, p, microbatches, batch=None):
        if p.step is None:
            return {"memory_per_device": 3, "limit": 2, "accumulator": 0, "fits": False,
                    "over_by": 1, "step_seconds": None, "mfu": None, "tokens_per_s": None,
                    "bound": None, "no_overlap_seconds": None, "source": p.source,
                    "problem": None, "implausible": False}
        return {"memory_per_device": 1 if p.fits else 3, "limit": 2, "accumulator": 0,
                "fits": p.fits,
                "over_by": 0, "step_seconds": p.step, "mfu": None, "tokens_per_s": None,
                "bound": None, "no_overlap_seconds": p.step, "source": p.source,
                "problem": None, "implausible": False}


def _rows(table):
    """Search rows of ``table`` ((layout, formula ms, compiled ms[, fits]) in the formula's
    order), not compiled yet."""
    return [{"id": i, "layout": lay, "rules": lay.split()[0], "mesh": {}, "microbatches": 1,
             "remat": lay.partition("remat=")[2] or "none",
             "fits": True, "step_seconds": f / 1e3, "no_overlap_seconds": f / 1e3,
             "memory_per_device": 1, "analytic_rank": i, "analytic_step_seconds": f / 1e3,
             "exact_rank": None, "note": "", "source": "estimate", "implausible": False}
            for i, (lay, f, *_) in enumerate(table, 1)]


def _cands(table):
    return [types.SimpleNamespace(id=i, compiled=None if row[2] is None else row[2] / 1e3,
                                  fits=row[3] if len(row) > 3 else True)
            for i, row in enumerate(table, 1)]


def _table_search(*, exact, workers):
    return _Table(cfg=None, hw=None, batch=16, seq=128, plan_opts=PlanOptions(),
                  opts=SearchOptions(exact=exact, workers=workers, progress=False),
                  say=lambda *a, **k: None)


def _exact_pass(table, *, top_k=3, workers=2, exact=True):
    """exact_pass over ``table`` ((layout, formula ms, compiled ms[, fits]) in the formula's
    order): (the best row, how many compiled, the "exact pass:" note)."""
    rows = _rows(table)
    notes = []
    _table_search(exact=exact, workers=workers).exact_pass(rows, {}, _cands(table), top_k, notes)
    compiled = [r for r in rows if r["source"] != "estimate"]
    (note,) = [n for n in notes if n.startswith("exact pass:")]
    fitting = [r for r in compiled if r["fits"]]
    if not fitting:
        raise ValueError(note)
    return min(fitting, key=lambda r: r["step_seconds"]), len(compiled), note


@pytest.mark.parametrize("workers", [1, 2])
def test_the_rule_finds_the_exhaustive_best_of_moe_tiny(workers):
    full, n_full, note_full = _exact_pass(MOE_TINY, exact="all", workers=workers)
    assert n_full == len(MOE_TINY) and "exact='all'" in note_full
    best, n, note = _exact_pass(MOE_TINY, workers=workers)
    # top 3 (ep, fsdp_ep, ep), then the best by formula of fsdp and fsdp_tp (strategies
    # not compiled yet); fsdp_ep data=4 expert=2 (rank 8): 0.0640 x 14.0 > 0.8117 ms
    assert (best["layout"], best["step_seconds"]) == (full["layout"], full["step_seconds"])
    assert n == 5, note
    assert note == ("exact pass: 5 compiled; stopped: no remaining candidate could beat "
                    "0.8117 ms even at the most favourable compiled/formula ratio seen "
                    "(14.0x), and every strategy and remat policy left has a compiled row")


def test_a_smaller_ratio_seen_later_reopens_a_skipped_candidate():
    # after a1, a2 (10x), a3 cannot win (1.1 x 10 > 10 ms); b1 (a strategy not compiled
    # yet) shows 7.5x, so a3 could (1.1 x 7.5 < 9 ms): compiled, it is the best
    table = [("a 1", 1.0, 10.0), ("a 2", 1.05, 10.6), ("a 3", 1.1, 8.5), ("b 1", 1.2, 9.0)]
    full, _, _ = _exact_pass(table, exact="all", top_k=2, workers=1)
    best, n, note = _exact_pass(table, top_k=2, workers=1)
    assert best["layout"] == full["layout"] == "a 3" and n == 4
    assert note == "exact pass: 4 compiled: every candidate that fits by formula"


def test_the_cap_names_what_could_still_win():
    table = [("a 1", 1.0, 10.0), ("b 1", 1.1, 9.5), ("c 1", 1.2, 9.0), ("a 2", 1.3, 11.0)]
    full, _, _ = _exact_pass(table, exact="all", top_k=1, workers=1)
    best, n, note = _exact_pass(table, top_k=1, workers=1)
    assert n == 2 and best["layout"] == "b 1" != full["layout"]   # the cap: 2 x top_k
    assert note == ("exact pass: 2 compiled, the cap (2 x top_k); analytic rank 3 could "
                    "still beat 9.5 ms (a strategy or remat policy not compiled yet, or below "
                    "it at the most favourable compiled/formula ratio seen, 8.6x): raise top_k "
                    "to compile them (exact='all' compiles every candidate)")
    best, n, _ = _exact_pass(table, top_k=2, workers=1)
    assert (n, best["layout"]) == (3, full["layout"])


@pytest.mark.parametrize("workers", [1, 2])
def test_the_rule_finds_the_exhaustive_best_of_the_7b(workers):
    full, n_full, _ = _exact_pass(DENSE_7B, exact="all", workers=workers)
    assert n_full == len(DENSE_7B) and full["layout"] == "fsdp_tp data=32 model=2 remat=dots"
    best, n, note = _exact_pass(DENSE_7B, workers=workers)
    # top 3 that fit (fsdp none and dots, fsdp_tp none; tp none refused), then the best by
    # formula of each (strategy, remat) not compiled yet: fsdp full, tp dots, fsdp_tp dots.
    # The cap names table positions 8, 12, 13 (analytic ranks 6, 10, 11: the formula does
    # not rank the two fsdp rows above the MFU ceiling)
    assert (best["layout"], best["step_seconds"]) == (full["layout"], full["step_seconds"])
    assert n == 7, note
    assert note.startswith("exact pass: 7 compiled (1 refused as out of memory), the cap "
                           "(2 x top_k); analytic ranks 8, 12, 13 could still beat 1187 ms"), note


def test_refused_steps_do_not_count_against_the_cap():
    # a 1 and a 2 are refused (None): the first that fits comes after; two refusals, then
    # two compiles that fit, make 2 x top_k = 2 that count
    table = [("a 1", 1.0, None), ("a 2", 1.1, None), ("b 1", 1.3, 9.0), ("c 1", 1.4, 8.0),
             ("d 1", 1.5, 7.0)]
    best, n, note = _exact_pass(table, top_k=1, workers=1)
    assert (n, best["layout"]) == (4, "c 1"), note
    assert note.startswith("exact pass: 4 compiled (2 refused as out of memory), the cap"), note


@pytest.mark.parametrize("workers", [1, 2])
def test_the_rule_finds_the_exhaustive_best_of_the_7b_at_32k_tokens(workers):
    full, n_full, _ = _exact_pass(LONG_7B, exact="all", workers=workers)
    assert n_full == len(LONG_7B) and full["layout"] == "fsdp_tp data=16 model=4 remat=dots"
    best, n, note = _exact_pass(LONG_7B, workers=workers)
    # down the formula's order until 3 fit (4 refused on the way), then tp and fsdp_tp
    # remat=full (remat policies not compiled yet); then nothing could beat 2,511 ms
    assert (best["layout"], best["step_seconds"]) == (full["layout"], full["step_seconds"])
    assert n == 9, note
    assert note == ("exact pass: 9 compiled (4 refused as out of memory); stopped: no "
                    "remaining candidate could beat 2511 ms even at the most favourable "
                    "compiled/formula ratio seen (1.3x), and every strategy and remat policy "
                    "left has a compiled row")


def test_refusals_beyond_2_top_k_count_against_the_cap():
    # every step refused: 2 x top_k (2) refusals are free, the next 2 count; then the cap
    table = [(f"a {i}", 1.0 + i / 10, None) for i in range(1, 9)]
    with pytest.raises(ValueError):   # nothing fits: no best
        _exact_pass(table, top_k=1, workers=1)
    rows = _rows(table)
    search = _table_search(exact=True, workers=1)
    notes = []
    search.exact_pass(rows, {}, _cands(table), 1, notes)
    assert sum(r["source"] != "estimate" for r in rows) == 4
    (note,) = notes
    assert note == ("exact pass: 4 compiled (4 refused as out of memory), the cap (2 x top_k), "
                    "and the compiler says none fits: analytic ranks 5, 6, 7, 8 not compiled: "
                    "raise top_k to compile them (exact='all' compiles every candidate)")
