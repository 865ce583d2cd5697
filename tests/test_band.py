"""How sure a prediction is (workbench/perf/_band.py): the error band from a calibration's
residuals (checked against the calibrated predictions themselves and a hand computation),
from the reference rows of an uncalibrated TPU generation (checked against BENCHMARKS.md's
rows), or none and why; stored with the calibration (old files still load); shown by the
plan's text, the plan widget and the lab's run records."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import shutil
import subprocess
import warnings

import pytest

import workbench as wb
from workbench.hardware import Calibration, CalibrationWarning, effective_spec, load_calibration
from workbench.perf._band import REFERENCE_ROWS, reference_rows
from workbench.perf._residuals import calibrated_step
from workbench._runs import clean_prediction
from _tpu import tpu

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = wb.models.GPTConfig.preset("tiny")


@pytest.fixture(scope="module")
def plans():
    mesh = wb.make_mesh(data=4, model=2)
    return {rules: wb.plan(TINY, mesh=mesh, rules=rules, batch=8, seq=32, progress=False)
            for rules in ("dp", "fsdp_tp")}


def _table(plan):
    return effective_spec(plan.mesh, calibration=False).table


def _calibration(plan, *, residuals=None, overlap=0.4):
    """A calibration of the plan's device kind by hand: slower compute and memory, a
    measured overlap, and fitted factors for the collectives the plan runs."""
    kinds = {t.kind for t in plan.predict(calibration=False).breakdown["collectives"]}
    table = _table(plan)
    return Calibration(
        device_kind=table.name, compute_factor=0.5, memory_factor=0.8,
        matmul_flops=table.peak_flops * 0.5, hbm_bandwidth=table.hbm_bandwidth * 0.8,
        collectives={k: {"latency": 2e-5, "scale": 1.5, "bandwidth": 1e9} for k in kinds},
        overlap=overlap, provenance=[{"directory": "by hand"}], residuals=residuals)


# -- calibration residuals ------------------------------------------------------------------

@pytest.mark.parametrize("rules", ["dp", "fsdp_tp"])
def test_calibrated_step_from_the_terms_is_the_calibrated_prediction(plans, rules):
    """The replay calibrate() uses for its residuals gives the step plan.predict gives with
    the same calibration (fsdp_tp: tensor-parallel collectives never hidden)."""
    plan = plans[rules]
    cal = _calibration(plan)
    uncal = plan.predict(calibration=False).to_dict()
    want = plan.predict(calibration=cal).step_seconds
    assert calibrated_step(uncal, cal, _table(plan)) == pytest.approx(want, rel=1e-9)
    if rules == "fsdp_tp":
        assert any(c["exposed"] for c in uncal["breakdown"]["collectives"])


def test_band_from_a_calibration_is_its_residuals_by_hand(plans):
    plan = plans["fsdp_tp"]
    res = [{"directory": "a", "plan_name": "dp", "mesh": {"data": 8}, "measured": 0.12,
            "predicted": 0.10},
           {"directory": "b", "plan_name": "fsdp", "mesh": {"data": 8}, "measured": 0.095,
            "predicted": 0.10},
           {"directory": "c", "plan_name": "tp", "mesh": {"data": 8}, "measured": 0.2,
            "predicted": 0.19}]
    pred = plan.predict(calibration=_calibration(plan, residuals=res))
    band = pred.band
    ratios = [0.12 / 0.10, 0.095 / 0.10, 0.2 / 0.19]
    assert band.basis == "calibration" and band.known
    assert band.low == pytest.approx(min(ratios)) and band.high == pytest.approx(max(ratios))
    assert band.seconds(pred.step_seconds) == pytest.approx(
        (pred.step_seconds * 0.95, pred.step_seconds * 1.2))
    # rates divide by the factors: the fastest step is the highest MFU
    assert band.rate(pred.mfu) == pytest.approx((pred.mfu / 1.2, pred.mfu / 0.95))
    assert "from 3 calibration layouts" in band.summary()
    d = pred.to_dict()["band"]
    assert (d["low"], d["high"], d["basis"]) == (band.low, band.high, "calibration")
    # all residuals on one side: the band still holds the prediction itself
    one = plan.predict(calibration=_calibration(plan, residuals=res[:1])).band
    assert (one.low, one.high) == pytest.approx((1.0, 1.2))
    assert "one layout" in one.source


def test_calibrate_stores_residuals_of_each_layout(plans, tmp_path):
    """wb.calibrate from two layouts: each residual's predicted step is what the stored
    calibration predicts for that plan, its measured step the profile's own."""
    reports = [wb.profile_step(plans[r], steps=2, warmup=1, directory=tmp_path / r)
               for r in ("dp", "fsdp_tp")]
    cal = wb.calibrate(reports, save=False)
    assert [r["plan_name"] for r in cal.residuals] == [rep.plan_name for rep in reports]
    for res, rep, rules in zip(cal.residuals, reports, ("dp", "fsdp_tp")):
        assert res["measured"] == pytest.approx(rep.own_step_seconds)
        assert res["predicted"] == pytest.approx(
            plans[rules].predict(calibration=cal).step_seconds, rel=1e-9)
    band = plans["dp"].predict(calibration=cal).band
    ratios = [r["measured"] / r["predicted"] for r in cal.residuals]
    assert (band.low, band.high) == pytest.approx((min(1, *ratios), max(1, *ratios)))
    # stored and read back with them
    assert Calibration.from_dict(json.loads(json.dumps(cal.to_dict()))) == cal


def test_an_old_calibration_file_loads_and_says_the_band_is_unknown(plans, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setenv("WORKBENCH_CALIBRATION", str(tmp_path))
    plan = plans["dp"]
    old = _calibration(plan).to_dict()
    del old["residuals"]                      # written before residuals were kept
    cal = _calibration(plan)
    path = cal.save()
    path.write_text(json.dumps(old))
    loaded = load_calibration(cal.device_kind)
    assert loaded is not None and loaded.residuals is None
    band = plan.predict(calibration=loaded).band
    assert not band.known and band.low is None and band.basis == "none"
    assert "calibrate again" in band.source
    assert "band: none (" in wb.plan(TINY, mesh=plan.mesh, rules="dp", batch=8, seq=32,
                                     compile=False, progress=False).report.summary()


@pytest.mark.parametrize("bad", [{"measured": 0.1}, [{"measured": -1, "predicted": 1}],
                                 [{"measured": float("nan"), "predicted": 1}],
                                 [{"measured": 1, "predicted": "1"}], ["x"]])
def test_bad_residuals_are_named_and_the_file_ignored(plans, tmp_path, monkeypatch, bad):
    monkeypatch.setenv("WORKBENCH_CALIBRATION", str(tmp_path))
    cal = _calibration(plans["dp"])
    path = cal.save()
    path.write_text(json.dumps(cal.to_dict() | {"residuals": bad}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_calibration(cal.device_kind) is None
    assert any(issubclass(w.category, CalibrationWarning) and "residuals" in str(w.message)
               for w in caught)


# -- reference rows -------------------------------------------------------------------------

def _benchmarks_rows() -> dict[str, tuple[float, float]]:
    """BENCHMARKS.md's bench_reference rows: name -> (predicted, published tokens/s/chip)."""
    rows = {}
    for line in (REPO / "BENCHMARKS.md").read_text().splitlines():
        m = re.match(r"\| bench_reference \| reference: (.+?) predicted MFU", line)
        if m:
            t = re.search(r"([\d,.]+) tokens/s/chip \(published ([\d,.]+)\)", line)
            rows[m.group(1)] = tuple(float(x.replace(",", "")) for x in t.groups())
    return rows


def test_stored_reference_rows_match_benchmarks_md():
    """reference_rows.json is what bench_reference measured: the same rows as BENCHMARKS.md,
    the same tokens/s (as rounded there), and each ratio predicted / published."""
    from benchmarks.bench_reference import REFERENCES

    table = _benchmarks_rows()
    stored = {r["name"]: r for r in reference_rows()}
    assert set(stored) == set(table) == {r.name for r in REFERENCES}
    for ref in REFERENCES:
        row, (predicted, published) = stored[ref.name], table[ref.name]
        assert round(row["predicted_tokens_per_s_per_chip"]) == predicted, ref.name
        assert row["published_tokens_per_s_per_chip"] == published == ref.tokens_per_chip
        assert row["ratio"] == pytest.approx(
            row["predicted_tokens_per_s_per_chip"] / published, abs=1e-4)
        assert row["source"] == ref.source
        assert row["hardware"] == wb.hardware.generation(ref.hardware).spec.name




@pytest.fixture(scope="module")
def v5p_plan():
    return wb.plan(TINY, mesh=wb.abstract_mesh("v5p-8", data=4), rules="fsdp", batch=8,
                   seq=64, progress=False)


@tpu
def test_uncalibrated_tpu_band_is_the_reference_rows_min_max(v5p_plan):
    assert v5p_plan.source == "tpu-compiler"
    ratios = [r["ratio"] for r in json.loads(REFERENCE_ROWS.read_text())["rows"]
              if r["hardware"] == "TPU v5p"]
    assert ratios
    band = v5p_plan.predict(calibration=False).band
    assert band.basis == "reference rows"
    assert (band.low, band.high) == pytest.approx((min(1, *ratios), max(1, *ratios)))
    assert "Llama-2-70B v5p-512" in band.source
    line = v5p_plan.report.summary()
    lo, hi = band.seconds(v5p_plan.predicted.step_seconds)
    assert f"band: {lo * 1e3:.4g}-{hi * 1e3:.4g} ms/step" in line and "reference row" in line


@tpu
def test_no_band_without_a_basis(v5p_plan):
    # a TPU plan timed by formulas, not by the compiler's cycles as the reference rows were
    est = wb.plan(TINY, mesh=wb.abstract_mesh("v5p-8", data=4), rules="fsdp", batch=8,
                  seq=64, compile=False, progress=False).predicted.band
    assert not est.known and "timed by the compiler's cycle" in est.source
    # a generation without reference rows
    v5e = wb.plan(TINY, mesh=wb.abstract_mesh("v5e-4", data=4), rules="fsdp", batch=8,
                  seq=64, compile=False, progress=False).predicted.band
    assert not v5e.known and "no reference rows for TPU v5e" in v5e.source
    # predicted for another chip than the mesh's (no compiler cycles): no band either
    other = v5p_plan.predict(hardware="TPU v5p").band
    assert not other.known


def test_uncalibrated_cpu_has_no_band(plans):
    band = plans["dp"].predict(calibration=False).band
    assert not band.known and "no measured basis" in band.source
    assert "\n  no band: uncalibrated CPU" in str(plans["dp"].predict(calibration=False))
    text = str(plans["dp"].predict(calibration=_calibration(
        plans["dp"], residuals=[{"measured": 1.1, "predicted": 1.0}])))
    assert "\n  band " in text and "per step, from 1 calibration layout" in text


# -- display ------------------------------------------------------------------------------

def test_run_records_keep_the_band(plans):
    pred = plans["fsdp_tp"].predict(calibration=_calibration(
        plans["fsdp_tp"], residuals=[{"measured": 1.1, "predicted": 1.0}])).to_dict()
    kept = clean_prediction(pred)["band"]
    assert kept["low"] == 1.0 and kept["high"] == pytest.approx(1.1)
    assert kept["summary"].startswith("from 1 calibration layout")
    for bad in ({"low": 2.0, "high": 1.0}, {"low": float("nan"), "high": 1.0},
                {"low": True, "high": 2.0}):
        assert clean_prediction(pred | {"band": bad})["band"]["low"] is None
    assert "band" not in clean_prediction(pred | {"band": "wide"})


def test_plan_widget_draws_the_band(plans, tmp_path):
    from workbench.widgets import _assets
    from workbench.widgets._plan_view import plan_payload

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    plan = plans["fsdp_tp"]
    res = [{"measured": 0.09, "predicted": 0.1}, {"measured": 0.125, "predicted": 0.1}]
    pred = plan.predict(calibration=_calibration(plan, residuals=res))

    def draw(predicted):
        payload = plan_payload(plan) | {"predicted": predicted}
        (tmp_path / "plan.mjs").write_text(_assets.esm("plan"))
        (tmp_path / "state.json").write_text(json.dumps({"payload": payload}))
        out = subprocess.run([node, str(REPO / "tests" / "widgets_js" / "render.mjs"),
                              str(tmp_path / "plan.mjs"), str(tmp_path / "state.json")],
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    rep = draw(pred.to_dict())
    assert rep["classes"]["wb-pred-band"] == 1
    mfu_lo, mfu_hi = pred.mfu / 1.25, pred.mfu / 0.9
    assert f"MFU {mfu_lo * 100:.1f}–{mfu_hi * 100:.1f}%" in rep["text"]
    assert "from 2 calibration layouts, measured/predicted 0.90-1.25x" in rep["text"]
    none = draw(plan.predict(calibration=False).to_dict())
    assert none["classes"]["wb-pred-noband"] == 1 and "no band: uncalibrated" in none["text"]
    older = draw({k: v for k, v in pred.to_dict().items() if k != "band"})
    assert "wb-pred-band" not in older["classes"]
