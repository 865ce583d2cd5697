"""Trust nothing read from disk: damaged and ill-valued calibration files, one row each.

Reference: the prediction of the same plan from the hardware table alone
(``calibration=False``) and from a clean calibration file. A damaged file (truncated,
empty, binary, list-shaped, a directory) or a well-formed one with a bad value (a factor
that is a string, 0, -1, NaN or inf; collectives a list; provenance a string; an overlap
past 1) must be ignored with exactly one ``CalibrationWarning`` naming the file, what is
wrong and the fix, the prediction equal to the table's, and never an error in a later
``wb.plan``.
"""
import dataclasses
import json
import warnings

import pytest

import workbench as wb
from workbench.hardware import cpu_spec
from workbench.hardware._calibration import (Calibration, CalibrationWarning, _file,
                                            load_calibration, remove_calibration)

CLEAN = dict(compute_factor=0.5, memory_factor=0.25, matmul_flops=1e12, hbm_bandwidth=1e10,
             collectives={"all-reduce": {"latency": 1e-5, "scale": 2.0, "bandwidth": 5e9,
                                         "instructions": 4.0}},
             overlap=0.5, provenance=[{"directory": "/profiles/3", "plan_name": "tiny",
                                       "mesh": {"data": 8}, "date": "2025-01-01T00:00"}])


@pytest.fixture(scope="module")
def plan():
    return wb.plan(wb.models.GPTConfig.preset("tiny"), mesh=wb.make_mesh(data=8),
                   rules="fsdp", batch=8, seq=32, compile=False)


@pytest.fixture
def store(tmp_path, monkeypatch, plan):
    monkeypatch.setenv("WORKBENCH_CALIBRATION", str(tmp_path / "cal"))
    kind = cpu_spec(8).name      # the device kind predictions of the CPU mesh look up
    return kind, _file(kind)


def _clean(kind, **changes):
    return {"device_kind": kind, **CLEAN, **changes}


def _write_json(value):
    return lambda path: path.write_text(json.dumps(value))   # NaN/Infinity as JSON allows


def _predict_quietly(plan):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pred = plan.predict()
        again = wb.plan(wb.models.GPTConfig.preset("tiny"), mesh=wb.make_mesh(data=8),
                        rules="fsdp", batch=8, seq=32, compile=False).predicted
    return pred, again, [w for w in caught if issubclass(w.category, CalibrationWarning)]


def test_a_clean_file_is_used(plan, store):
    kind, path = store
    Calibration.from_dict(_clean(kind)).save()
    pred, again, caught = _predict_quietly(plan)
    assert caught == []
    want = plan.predict(calibration=Calibration(device_kind=kind, **CLEAN))
    assert pred.step_seconds == again.step_seconds == want.step_seconds
    assert pred.step_seconds != plan.predict(calibration=False).step_seconds
    assert pred.sources["calibration"] == "calibrated from profile /profiles/3 (tiny, mesh " \
        "{'data': 8}, 2025-01-01T00:00)"


def _bad_value(**changes):
    return lambda kind: _write_json(_clean(kind, **changes))


ROWS = {   # what the file is -> (how to make it, what the warning says is wrong)
    "truncated": (lambda kind: lambda p: p.write_text('{"compute_factor": 0.5, "device_ki'),
                  "not valid JSON (Unterminated string starting at: line 1 column 25 "
                  "(char 24))"),
    "empty": (lambda kind: lambda p: p.write_text(""), "empty"),
    "blank": (lambda kind: lambda p: p.write_text(" \n"), "empty"),
    "binary": (lambda kind: lambda p: p.write_bytes(b"\x80\x81\x82binary\x00"),
               "not UTF-8 text (byte 0; binary?)"),
    "list-shaped": (lambda kind: _write_json([_clean(kind)]),
                    "it holds a JSON list, not an object"),
    "a directory": (lambda kind: lambda p: p.mkdir(), "Is a directory"),
    "a field missing": (lambda kind: _write_json({k: v for k, v in _clean(kind).items()
                                                  if k != "overlap"}),
                        "fields ['overlap'] are missing"),
    "compute_factor 'fast'": (_bad_value(compute_factor="fast"),
                              "compute_factor is 'fast', not a finite number > 0"),
    "compute_factor 0": (_bad_value(compute_factor=0),
                         "compute_factor is 0, not a finite number > 0"),
    "compute_factor -1": (_bad_value(compute_factor=-1),
                          "compute_factor is -1, not a finite number > 0"),
    "compute_factor NaN": (_bad_value(compute_factor=float("nan")),
                           "compute_factor is nan, not a finite number > 0"),
    "memory_factor inf": (_bad_value(memory_factor=float("inf")),
                          "memory_factor is inf, not a finite number > 0"),
    "compute_factor true": (_bad_value(compute_factor=True),
                            "compute_factor is True, not a finite number > 0"),
    "matmul_flops -1": (_bad_value(matmul_flops=-1),
                        "matmul_flops is -1, not a finite number >= 0"),
    "collectives a list": (_bad_value(collectives=[]),
                           "collectives is [], not an object of collective kind -> factors"),
    "a collective's latency -1": (
        _bad_value(collectives={"all-reduce": {"latency": -1, "scale": 1.0,
                                               "bandwidth": 1e9}}),
        "collectives['all-reduce'].latency is -1, not a finite number >= 0"),
    "a collective's scale NaN": (
        _bad_value(collectives={"all-reduce": {"latency": 0.0, "scale": float("nan"),
                                               "bandwidth": 1e9}}),
        "collectives['all-reduce'].scale is nan, not a finite number >= 0"),
    "a collective a number": (_bad_value(collectives={"all-gather": 3}),
                              "collectives['all-gather'] is 3, not an object"),
    "provenance a string": (_bad_value(provenance="profile 3"),
                            "provenance is 'profile 3', not a list of objects with a "
                            "'directory' (and a 'date' string)"),
    "provenance without a directory": (_bad_value(provenance=[{"date": "2025"}]),
                                       "provenance is [{'date': '2025'}], not a list of "
                                       "objects with a 'directory' (and a 'date' string)"),
    "overlap 1.5": (_bad_value(overlap=1.5), "overlap is 1.5, not a fraction in [0, 1]"),
    "overlap -1": (_bad_value(overlap=-1), "overlap is -1, not a finite number >= 0"),
    "device_kind a number": (_bad_value(device_kind=7),
                             "device_kind is 7, not a device kind's name"),
}


@pytest.mark.parametrize("case", list(ROWS))
def test_a_bad_file_is_ignored_with_a_warning_and_the_table_predicts(plan, store, case):
    kind, path = store
    make, why = ROWS[case]
    path.parent.mkdir(parents=True, exist_ok=True)
    make(kind)(path)
    table = plan.predict(calibration=False)
    pred, again, caught = _predict_quietly(plan)
    assert pred.step_seconds == again.step_seconds == table.step_seconds
    assert "calibration" not in pred.sources
    assert {str(w.message) for w in caught} == {
        f"calibration file {path} is ignored: {why}. Predictions for {kind!r} use the "
        f"hardware table. Calibrate again (wb.calibrate(trainer.profile())) or remove it "
        f"(wb.remove_calibration({kind!r}), or delete the file)"}
    assert len(caught) == 2                        # one per prediction, never an error


def test_remove_calibration_leaves_a_directory_alone(store):
    kind, path = store
    (path / "inside").mkdir(parents=True)
    with pytest.raises(ValueError, match="is a directory, not a calibration file"):
        remove_calibration(kind)
    assert (path / "inside").is_dir()
    with pytest.warns(CalibrationWarning, match="Is a directory"):
        assert load_calibration(kind) is None


def test_a_calibration_round_trips_its_checked_fields(store):
    kind, _ = store
    cal = Calibration(device_kind=kind, **{**CLEAN, "overlap": None})
    cal.save()
    assert load_calibration(kind) == cal
    cal = dataclasses.replace(cal, collectives={"all-reduce": {
        "latency": 0.0, "scale": 0.0, "bandwidth": float("inf"), "instructions": 2.0}})
    cal.save()                                     # scale 0: an infinite bandwidth
    assert load_calibration(kind) == cal
