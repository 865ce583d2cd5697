"""wb.search: every row checked against wb.plan of the same layout built directly; the best
against each rules preset; the Pareto front by brute force; rank changes against the
compiled plans; bad input; the advice when nothing fits; the widget payload and view."""
from __future__ import annotations

import json
import pathlib
import shutil
import subprocess

import pytest

import workbench as wb
from workbench._sharding.layouts import format_bytes
from workbench.models import GPTConfig
from workbench._sharding.topology import tpu_compiler_available

TINY = GPTConfig.preset("tiny")
HW, BATCH, SEQ = "v5e-8", 16, 128
PRESETS = ("dp", "fsdp", "tp", "fsdp_tp")


def direct(row, *, hardware=HW, batch=BATCH, compile=False, memory_limit=None):
    """The row's layout planned directly with wb.plan (one micro-batch of it)."""
    mesh = wb.abstract_mesh(hardware, **row["mesh"]) if isinstance(hardware, str) \
        else wb.make_mesh(row["mesh"], devices=list(hardware.devices.flat))
    return wb.plan(TINY.replace(remat=row["remat"]), mesh=mesh, rules=row["rules"],
                   batch=batch // row["microbatches"], seq=SEQ, compile=compile,
                   memory_limit=memory_limit, progress=False)


@pytest.fixture(scope="module")
def res():
    return wb.search(TINY, HW, batch=BATCH, seq=SEQ, microbatches=(1, 2), exact=False,
                     progress=False)


@pytest.fixture(scope="module")
def tight(res):
    """The same search with a device limit that about half the candidates exceed."""
    mems = sorted(r["memory_per_device"] for r in res.rows)
    limit = mems[len(mems) // 2]
    return wb.search(TINY, HW, batch=BATCH, seq=SEQ, microbatches=(1, 2), exact=False,
                     memory_limit=limit, progress=False), limit


def test_best_is_no_slower_than_each_rules_preset(res):
    best = res.best_row
    assert best["rank"] == 1 and best["fits"]
    assert best["step_seconds"] == res.best.predicted.step_seconds * best["microbatches"]
    compared = 0
    for preset in PRESETS:
        model = 1 if preset in ("dp", "fsdp") else 2
        mesh = wb.abstract_mesh(HW, data=-1, model=model)
        for remat in ("none", "dots", "full"):
            ref = wb.plan(TINY.replace(remat=remat), mesh=mesh, rules=preset, batch=BATCH,
                          seq=SEQ, compile=False, progress=False)
            if ref.fits:
                compared += 1
                assert best["step_seconds"] <= ref.predicted.step_seconds, (preset, remat)
    assert compared == 12


def test_rows_are_the_plans_of_their_layouts(res):
    assert {r["rules"] for r in res.rows} == set(PRESETS)
    assert {r["microbatches"] for r in res.rows} == {1, 2}
    for r in res.rows:
        p = direct(r)
        acc = p.memory["gradients"] if r["microbatches"] > 1 else 0
        assert r["memory_per_device"] == p.memory["total"] + acc
        assert r["step_seconds"] == pytest.approx(
            p.predicted.step_seconds * r["microbatches"], rel=1e-12)
        assert r["tokens_per_s"] == pytest.approx(BATCH * SEQ / r["step_seconds"])
        assert r["source"] == "estimate" and r["exact_rank"] is None
    # tiny has 2 kv heads: model=4 and model=8 cannot split them, and say so
    assert res.skipped and all("does not divide" in s["reason"] for s in res.skipped)
    assert {s["mesh"]["model"] for s in res.skipped} == {4, 8}


def test_what_does_not_fit_is_dropped(tight):
    result, limit = tight
    fitting, over = result.fitting, [r for r in result.rows if r["rank"] is None]
    assert fitting and over
    for r in result.rows:
        p = direct(r, memory_limit=limit)
        acc = p.memory["gradients"] if r["microbatches"] > 1 else 0
        fits = p.memory["total"] + acc <= limit
        assert r["fits"] == fits and r["limit"] == limit
        if r["microbatches"] == 1:
            assert fits == p.fits
        assert r["over_by"] == max(0, p.memory["total"] + acc - limit)
        assert (r["rank"] is not None) == fits
        assert (r["id"] in result.plans) == fits
    steps = [r["step_seconds"] for r in fitting]
    assert steps == sorted(steps)
    assert [r["rank"] for r in fitting] == list(range(1, len(fitting) + 1))
    assert result.rows[:len(fitting)] == fitting


@pytest.mark.parametrize("which", ["res", "tight"])
def test_pareto_is_exactly_the_non_dominated_rows(which, request):
    result = request.getfixturevalue(which)
    result = result[0] if isinstance(result, tuple) else result
    ok = [r for r in result.rows if r["fits"] is not False]

    def dominated(r):
        return any(s["memory_per_device"] <= r["memory_per_device"]
                   and s["step_seconds"] <= r["step_seconds"]
                   and (s["memory_per_device"], s["step_seconds"])
                   != (r["memory_per_device"], r["step_seconds"]) for s in ok)

    want = {r["id"] for r in ok if not dominated(r)}
    assert {r["id"] for r in result.pareto} == want
    assert result.best_row["id"] in want  # the fastest is never dominated


@pytest.mark.tpu
@pytest.mark.skipif(not tpu_compiler_available(), reason="the TPU compiler is not installed")
@pytest.mark.usefixtures("wb_cache")
def test_exact_pass_reranks_by_the_compiled_plans():
    result = wb.search(TINY, HW, batch=BATCH, seq=SEQ, strategies=("dp", "fsdp"),
                       remat=("none", "full"), top_k=2, progress=False)
    compiled = [r for r in result.rows if r["source"] != "estimate"]
    # top_k=2 (both fsdp by formula), then dp's best by formula with each remat policy: a
    # strategy and remat policy not compiled yet could win, whatever its formula says (and
    # does: dp is first compiled); 4 = the cap (2 x top_k), and every candidate
    assert sorted(r["analytic_rank"] for r in compiled) == [1, 2, 3, 4]
    assert {r["rules"] for r in compiled} == {"dp", "fsdp"}
    for r in compiled:
        ref = direct(r, compile=None)  # the same program: the compile cache answers
        assert ref.source == r["source"] == "tpu-compiler"
        assert r["step_seconds"] == ref.predicted.step_seconds
        assert r["memory_per_device"] == ref.memory["total"]
    by_exact = sorted(compiled, key=lambda r: r["exact_rank"])
    assert [r["exact_rank"] for r in by_exact] == [1, 2, 3, 4]
    steps = [r["step_seconds"] for r in by_exact]
    assert steps == sorted(steps)
    assert result.rows[:4] == by_exact and result.best.compiled is not None
    want = [(r["id"], r["analytic_rank"], r["exact_rank"]) for r in
            sorted(compiled, key=lambda r: r["analytic_rank"])
            if r["exact_rank"] != r["analytic_rank"]]
    assert [(c["id"], c["analytic_rank"], c["exact_rank"]) for c in result.rank_changes] == want
    for c in result.rank_changes:
        row = next(r for r in compiled if r["id"] == c["id"])
        assert c["step_seconds"] == row["step_seconds"]
        assert c["analytic_step_seconds"] == row["analytic_step_seconds"]


def test_real_devices_compile_with_xla():
    mesh = wb.make_mesh(data=8)
    result = wb.search(TINY, mesh, batch=BATCH, seq=SEQ, strategies=("dp", "fsdp"),
                       remat=("none",), top_k=1, memory_limit=2 ** 30, progress=False)
    top = result.rows[0]
    assert top["source"] == "cpu-compiler" and top["exact_rank"] == 1
    ref = direct(top, hardware=mesh, compile=True)
    assert top["step_seconds"] == ref.predicted.step_seconds
    assert result.best.compiled is not None and result.devices == 8


def test_hardware_without_a_compiler_stays_analytic():
    result = wb.search(TINY, "8xH100", batch=BATCH, seq=SEQ, strategies=("dp",),
                       remat=("none",), top_k=1, progress=False)
    assert result.rank_changes == [] and all(r["source"] == "estimate" for r in result.rows)
    assert any("nothing compiled" in n for n in result.notes)


def test_nothing_fits_says_by_how_much_and_what_would():
    base = wb.search(TINY, HW, batch=BATCH, seq=SEQ, remat=("none",), exact=False,
                     progress=False)
    closest = min(base.rows, key=lambda r: r["memory_per_device"])
    full = direct(dict(closest, remat="full"))
    assert full.memory["total"] < closest["memory_per_device"]
    limit = (full.memory["total"] + closest["memory_per_device"]) // 2
    result = wb.search(TINY, HW, batch=BATCH, seq=SEQ, remat=("none",), exact=False,
                       memory_limit=limit, progress=False)
    assert result.fitting == [] and result.pareto == []
    advice = result.advice
    assert "Nothing fits" in advice and closest["layout"] in advice
    assert format_bytes(closest["memory_per_device"] - limit) in advice
    assert f"remat='full' (not searched): {format_bytes(full.memory['total'])}" in advice
    bigger = wb.plan(TINY, mesh=wb.abstract_mesh("v5e-16", data=-1, model=1),
                     rules=closest["rules"], batch=BATCH, seq=SEQ, compile=False,
                     memory_limit=limit, progress=False)
    if bigger.fits:
        assert f"hardware='v5e-16' (16 devices): {format_bytes(bigger.memory['total'])}" \
            in advice
    with pytest.raises(ValueError, match="Nothing fits"):
        result.best
    assert "Nothing fits" in str(result) and "Nothing fits" in repr(result)


@pytest.mark.parametrize("kwargs, match", [
    ({"hardware": "v9z-12"}, r"unknown hardware preset 'v9z-12'.*v5p-256"),
    ({"microbatches": (3,)}, r"batch 16 is not divisible by microbatches=3.*\[1, 2, 4, 8, 16\]"),
    ({"batch": 6}, r"no candidate can be planned.*6 sequences per step do not divide"),
    ({"top_k": -1}, r"top_k must be an int >= 0"),
    ({"strategies": ()}, r"strategies=\(\): give a non-empty list"),
    ({"strategies": ("zero3",)}, r"unknown strategy 'zero3'"),
    ({"remat": ("some",)}, r"unknown remat policy 'some'"),
    ({"mesh_shapes": [(3, 3)]}, r"mesh shape \(3, 3\) does not cover the 8 devices"),
    ({"overlap": 2.0}, r"overlap must be in \[0, 1\]"),
])
def test_bad_input_raises_clear_errors(kwargs, match):
    args = {"hardware": HW, "batch": BATCH, "seq": SEQ, "exact": False, "progress": False}
    with pytest.raises(ValueError, match=match):
        wb.search(TINY, **(args | kwargs))


def test_a_model_that_is_not_a_model_is_refused():
    with pytest.raises(TypeError, match="GPTConfig or a model factory"):
        wb.search("tiny", HW, batch=BATCH)


def test_explicit_mesh_shapes(res):
    result = wb.search(TINY, HW, batch=BATCH, seq=SEQ, mesh_shapes=[{"data": -1, "model": 2}],
                       strategies=("dp", "tp"), remat=("none",), exact=False, progress=False)
    assert [(r["rules"], r["mesh"]) for r in sorted(result.rows, key=lambda r: r["id"])] == [
        ("dp", {"data": 4, "model": 2}), ("tp", {"data": 4, "model": 2})]


def test_text_and_payload(res):
    from workbench.widgets._search_view import search_figure, search_payload

    text = str(res)
    assert all(r["layout"] in text for r in res.rows) and repr(res).startswith("<SearchResult")
    payload = search_payload(res)
    assert json.loads(json.dumps(payload, allow_nan=False)) == payload
    assert [r["best"] for r in payload["rows"]].count(True) == 1
    assert {r["id"] for r in payload["rows"] if r["pareto"]} == {r["id"] for r in res.pareto}
    fig = search_figure(res)
    hover = " ".join(t for tr in fig.data for t in (tr.hovertext or ()))
    assert all(r["layout"] in hover for r in res.rows)
    xs = sorted(x for tr in fig.data if tr.mode == "markers" and tr.name != "best"
                for x in tr.x)
    mib = 1024 ** 2  # tiny's memory is plotted in MiB
    assert xs == pytest.approx(sorted(r["memory_per_device"] / mib for r in res.rows))
    # 16 GiB is far off the chart: all of it is shaded as fitting, and says why
    assert any("16 GiB is off the chart" in (a.text or "") for a in fig.layout.annotations)
    assert json.loads(json.dumps(res.to_dict(), allow_nan=False))["rows"]


def test_figure_marks_the_fitting_region(tight):
    from workbench.widgets._search_view import search_figure

    result, limit = tight
    fig = search_figure(result)
    mib = 1024 ** 2
    rects = [s for s in fig.layout.shapes if s.type == "rect"]
    assert len(rects) == 1 and rects[0].x0 == 0 and rects[0].x1 == pytest.approx(limit / mib)
    fits = {tr.name: list(tr.x) for tr in fig.data if tr.mode == "markers" and tr.name != "best"}
    inside = sorted(v for name, xs in fits.items() if "does not fit" not in name for v in xs)
    outside = sorted(v for name, xs in fits.items() if "does not fit" in name for v in xs)
    assert max(inside) <= limit / mib < min(outside)
    assert len(inside) == len(result.fitting)


NODE = shutil.which("node")


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_widget_renders_every_row_and_filters(res, tmp_path):
    from workbench.widgets import _assets
    from workbench.widgets._search_view import search_payload

    here = pathlib.Path(__file__).parent / "widgets_js"
    (tmp_path / "search.mjs").write_text(_assets.esm("search"))
    (tmp_path / "state.json").write_text(json.dumps({"payload": search_payload(res)}))
    (tmp_path / "actions.json").write_text(json.dumps([
        {"op": "change", "label": "show", "value": "pareto"}]))

    def run(*extra):
        out = subprocess.run([NODE, str(here / "render.mjs"), str(tmp_path / "search.mjs"),
                              str(tmp_path / "state.json"), *extra], capture_output=True,
                             text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    shown = run()
    assert [r[2] for r in shown["rows"]] == [r["layout"] for r in res.rows]
    assert shown["rows"][0][1] == "★ best" and shown["handlers_left"] == 0
    pareto = run(str(tmp_path / "actions.json"))
    assert sorted(r[2] for r in pareto["rows"]) == sorted(r["layout"] for r in res.pareto)


def test_rows_are_typed_and_read_as_dicts(res):
    """Each row is a ``SearchRow`` with the ``ROW_KEYS``; it reads (and is filled) as a dict,
    so tables, the widget and JSON take it; the options the search ran with are one typed
    ``SearchOptions`` whose checks are wb.search's."""
    from workbench._search.search import SearchOptions, SearchRow
    from workbench._search.result import ROW_KEYS

    for r in res.rows:
        assert isinstance(r, SearchRow) and set(r) == set(ROW_KEYS) and len(r) == len(ROW_KEYS)
        assert r["step_seconds"] == r.step_seconds and dict(r) == r.to_dict()
    json.dumps(res.to_dict())
    row = res.rows[0]
    with pytest.raises(KeyError, match="not a search row key"):
        row["colour"] = "blue"
    with pytest.raises(ValueError, match="top_k must be an int >= 0"):
        SearchOptions(top_k=-1).check(BATCH, gpt=True)
    with pytest.raises(ValueError, match="not divisible by microbatches=3"):
        SearchOptions(microbatches=(3,)).check(BATCH, gpt=True)
    SearchOptions().check(BATCH, gpt=True)
