"""The plan's report is data and prediction is a function (issue 60 item 4): the report's
prediction is made once, when the plan is made, and stored; reading the report reads no
calibration and warns about nothing; ``perf.predict_plan(report, spec)`` predicts again
for whatever spec the caller resolves; ``perf.predict`` takes a ``StepCost`` and a spec.
References: the report written and read back, the prediction of the original report,
the calibration passed by hand."""
from __future__ import annotations

import dataclasses
import json
import math
import warnings

import pytest

import workbench as wb
from workbench.hardware import Calibration, effective_spec, hardware_spec
from workbench.perf import StepCost, predict, predict_plan
from workbench.perf._band import Band
from workbench.perf._prediction import Prediction
from workbench.planning import PlanReport
from workbench.planning._report import with_prediction
from workbench._sharding.mesh import mesh_info

TINY = wb.models.GPTConfig.preset("tiny")
#: a calibration of the v5p that halves its FLOP/s and quarters its HBM bandwidth
CAL = dict(compute_factor=0.5, memory_factor=0.25, matmul_flops=1e12, hbm_bandwidth=1e10,
           collectives={}, overlap=0.5,
           provenance=[{"directory": "/profiles/1", "date": "2026-12-07"}])


@pytest.fixture
def calibration_dir(monkeypatch, tmp_path):
    """A calibration folder of this test's own, empty."""
    monkeypatch.setenv("WORKBENCH_CALIBRATION", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def compiled_report():
    """A plan compiled for the 8 CPU devices: the compiler's numbers and collectives."""
    return wb.plan(TINY, mesh=wb.make_mesh(data=4, model=2), batch=8, seq=32,
                   progress=False).report


def _v5p_plan():
    """A formula plan of an abstract v5p-8 slice (nothing compiled: cheap)."""
    return wb.plan(TINY, mesh=wb.abstract_mesh("v5p-8", data=4), batch=8, seq=64,
                   compile=False, progress=False)


def _json(report: PlanReport) -> dict:
    return json.loads(json.dumps(report.to_json()))


def _read_back(report: PlanReport) -> PlanReport:
    return PlanReport.from_json(_json(report))


def test_a_compiled_report_read_back_is_equal_and_predicts_the_same(compiled_report):
    back = _read_back(compiled_report)
    assert _json(back) == _json(compiled_report)          # every field, as data
    assert back.predicted == compiled_report.predicted    # the stored prediction, whole
    assert back.predicted.breakdown["collectives"]        # ... with its timed collectives
    assert back.to_dict() == compiled_report.to_dict()   # the summary's numbers
    # the reference: the original report's prediction, for the same specs
    mesh = compiled_report.mesh
    for spec in (effective_spec(mesh, calibration=False),
                 effective_spec(mesh, hardware="TPU v5p"),
                 effective_spec(mesh, hardware="H100",
                                calibration=Calibration(device_kind="H100", **CAL))):
        assert predict_plan(back, spec) == predict_plan(compiled_report, spec), spec.name


def test_an_estimated_report_read_back_is_equal_and_predicts_the_same(calibration_dir):
    report = _v5p_plan().report
    back = _read_back(report)
    assert _json(back) == _json(report) and back.predicted == report.predicted
    spec = effective_spec(report.mesh, calibration=Calibration(device_kind="TPU v5p", **CAL))
    assert predict_plan(back, spec) == predict_plan(report, spec)
    assert predict_plan(back, spec, overlap=0.0) == predict_plan(report, spec, overlap=0.0)


def test_reading_a_report_reads_no_calibration_and_warns_nothing(calibration_dir):
    plan = _v5p_plan()
    report = plan.report
    before = (report.predicted, report.summary(), report.to_dict(), _json(report))
    assert "calibration" not in report.predicted.sources
    cal = Calibration(device_kind="TPU v5p", **CAL)
    cal.save()                                            # written after the report was made
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        after = (report.predicted, report.summary(), report.to_dict(), _json(report))
        for f in dataclasses.fields(PlanReport):
            getattr(report, f.name)
        for name, attr in vars(PlanReport).items():
            if isinstance(attr, property):
                getattr(report, name)
        str(report), repr(report), plan.predicted, plan.warnings, plan.summary()
    assert after == before                                # the report's numbers unchanged
    assert [str(w.message) for w in caught] == []
    assert not any(w.kind == "implausible_prediction" for w in report.warnings)
    # the calibrated spec, resolved by the caller, changes the prediction: as by hand
    stored = predict_plan(report, effective_spec(report.mesh))
    by_hand = predict_plan(report, effective_spec(report.mesh, calibration=cal))
    assert stored == by_hand and "calibration" in stored.sources
    assert not math.isclose(stored.step_seconds, report.predicted.step_seconds, rel_tol=1e-3)
    assert plan.predict() == stored and plan.predict(calibration=False) == report.predicted


def test_the_prediction_is_made_with_the_calibration_stored_when_the_plan_is_made(
        calibration_dir):
    cal = Calibration(device_kind="TPU v5p", **CAL)
    cal.save()
    report = _v5p_plan().report
    assert report.predicted == predict_plan(report, effective_spec(report.mesh,
                                                                   calibration=cal))
    assert report.predicted.sources["calibration"] == cal.source


def test_an_implausible_prediction_adds_its_lint_to_a_new_report(calibration_dir):
    report = _v5p_plan().report
    # model FLOPs 100x the step's own: an MFU no published run reaches (perf._bounds)
    flops = dataclasses.replace(report.flops, total=100 * report.flops.total)
    bad = dataclasses.replace(report, flops=flops)
    spec = effective_spec(bad.mesh, calibration=False)
    assert predict_plan(bad, spec).implausible              # the reference
    out = with_prediction(bad, spec)
    lints = [w for w in out.warnings if w.kind == "implausible_prediction"]
    assert len(lints) == 1 and lints[0].severity == "error"
    assert out.predicted == predict_plan(bad, spec)
    assert not any(w.kind == "implausible_prediction" for w in bad.warnings)  # not changed
    assert len(with_prediction(out, spec).warnings) == len(out.warnings)     # said once


def test_a_table_without_the_numbers_leaves_no_prediction_and_says_why(calibration_dir):
    report = _v5p_plan().report
    chip = dataclasses.replace(hardware_spec("TPU v5p"), name="no-hbm", hbm_bandwidth=None)
    out = with_prediction(report, effective_spec(report.mesh, hardware=chip))
    assert out.predicted is None and "no HBM bandwidth" in out.prediction_error
    assert f"predicted: unavailable ({out.prediction_error})" in out.summary()
    back = _read_back(out)
    assert back.predicted is None and back.prediction_error == out.prediction_error


def test_a_report_written_before_predictions_were_kept_says_how_to_make_one(calibration_dir):
    report = _v5p_plan().report
    data = _json(report)
    del data["predicted"], data["prediction_error"]
    old = PlanReport.from_json(data)
    assert old.predicted is None and "perf.predict_plan" in old.prediction_error
    spec = effective_spec(report.mesh, calibration=False)
    assert predict_plan(old, spec) == predict_plan(report, spec)


def test_a_prediction_with_a_band_reads_back_equal():
    band = Band(low=0.9, high=1.2, basis="calibration", source="three profiles",
                rows=({"name": "a", "ratio": 0.9}, {"name": "b", "ratio": 1.2}))
    mesh = wb.abstract_mesh("v5p-8", data=4)
    pred = dataclasses.replace(
        predict(StepCost(flops=1e12, bytes_accessed=1e9, mesh=mesh),
                effective_spec(mesh_info(mesh), calibration=False)), band=band)
    assert Prediction.from_dict(json.loads(json.dumps(pred.to_dict()))) == pred
    with pytest.raises(ValueError, match="not a prediction's to_dict"):
        Prediction.from_dict({"step_seconds": 1.0})


def test_predict_takes_a_cost_record_and_a_spec_and_names_what_is_wrong():
    mesh = wb.abstract_mesh("v5p-8", data=4)
    info = mesh_info(mesh)
    spec = effective_spec(info, calibration=False)
    chip = hardware_spec("TPU v5p")
    p = predict(StepCost(flops=chip.peak_flops * 1e-3, bytes_accessed=0.0, mesh=mesh), spec)
    assert p.step_seconds == pytest.approx(1e-3)          # 1 ms of math at peak (hand count)
    bad_calls = [
        (TypeError, "cost=.*not a StepCost", lambda: predict({"flops": 1.0}, spec)),
        (TypeError, "spec=.*not an EffectiveSpec", lambda: predict(
            StepCost(flops=1.0, bytes_accessed=1.0, mesh=mesh), chip)),
        (ValueError, "overlap", lambda: predict(
            StepCost(flops=1.0, bytes_accessed=1.0, mesh=mesh), spec, overlap=2.0)),
        (TypeError, "overlap='half'", lambda: predict(
            StepCost(flops=1.0, bytes_accessed=1.0, mesh=mesh), spec, overlap="half")),
        (ValueError, "flops=nan", lambda: StepCost(flops=math.nan, bytes_accessed=0, mesh=mesh)),
        (ValueError, "bytes_accessed=-1", lambda: StepCost(flops=1, bytes_accessed=-1,
                                                           mesh=mesh)),
        (TypeError, "mesh=.*not a mesh", lambda: StepCost(flops=1, bytes_accessed=1,
                                                         mesh={"data": 4})),
        (TypeError, "collectives=.*give a list", lambda: StepCost(
            flops=1, bytes_accessed=1, mesh=mesh, collectives="all-gather")),
        (TypeError, "collectives holds", lambda: StepCost(
            flops=1, bytes_accessed=1, mesh=mesh, collectives=[{"kind": "all-gather"}])),
        (ValueError, "exposed_axes names 'model'", lambda: StepCost(
            flops=1, bytes_accessed=1, mesh=mesh, exposed_axes=("model",))),
        (TypeError, "tokens_per_step=2.5", lambda: StepCost(
            flops=1, bytes_accessed=1, mesh=mesh, tokens_per_step=2.5)),
        (TypeError, "sync_exposed='yes'", lambda: StepCost(
            flops=1, bytes_accessed=1, mesh=mesh, sync_exposed="yes")),
        (TypeError, "host=", lambda: StepCost(flops=1, bytes_accessed=1, mesh=mesh, host=3)),
    ]
    for kind, match, call in bad_calls:
        with pytest.raises(kind, match=match):
            call()


def test_predict_plan_names_a_plan_or_a_spec_given_for_the_other(calibration_dir):
    plan = _v5p_plan()
    spec = effective_spec(plan.mesh, calibration=False)
    with pytest.raises(TypeError, match=r"report=.* not a PlanReport \(a Plan: give "
                                        r"plan.report\)"):
        predict_plan(plan, spec)
    with pytest.raises(TypeError, match="spec='TPU v5p' is a str, not an EffectiveSpec"):
        predict_plan(plan.report, "TPU v5p")
