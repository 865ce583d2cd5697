"""The one effective hardware spec (``workbench.hardware.effective_spec``): catalogue ->
measured -> calibrated, each step named; ``perf.predict`` reads no calibration from disk,
and ``plan.predict()`` resolves the stored one explicitly. Reference: the same prediction
with the calibration passed by hand."""
from __future__ import annotations

import dataclasses

import pytest

import workbench as wb
from workbench.hardware import Calibration, EffectiveSpec, effective_spec, hardware_spec
from workbench._sharding.mesh import mesh_info
from workbench.perf import StepCost
from workbench.perf._predict import predict

CAL = dict(compute_factor=0.5, memory_factor=0.25, matmul_flops=1e12, hbm_bandwidth=1e10,
           collectives={"all-gather": {"latency": 1e-5, "scale": 2.0, "bandwidth": 5e9}},
           overlap=0.5, provenance=[{"directory": "/profiles/1", "date": "2026-11-28"}])


@pytest.fixture
def v5p(monkeypatch, tmp_path):
    """An abstract v5p-8 mesh, and a calibration folder of its own."""
    monkeypatch.setenv("WORKBENCH_CALIBRATION", str(tmp_path))
    return mesh_info(wb.abstract_mesh("v5p-8", data=4))


def test_catalogue_entry_alone_names_its_source(v5p):
    spec = effective_spec(v5p)
    assert spec.origin == "catalogue" and spec.calibration is None
    assert spec.calibration_origin == "none stored" and spec.for_mesh
    assert spec.spec == spec.table == hardware_spec("TPU v5p")
    assert spec.sources()["entry"] == "catalogue: TPU v5p"
    assert "TPU v5p" in str(spec)


def test_stored_calibration_is_applied_and_named(v5p):
    cal = Calibration(device_kind="TPU v5p", **CAL)
    cal.save()
    spec = effective_spec(v5p)
    assert spec.calibration == cal and spec.calibration_origin == "stored"
    assert spec.spec.peak_flops == pytest.approx(0.5 * spec.table.peak_flops)
    assert spec.spec.hbm_bandwidth == pytest.approx(0.25 * spec.table.hbm_bandwidth)
    assert spec.sources()["calibration"].startswith("stored: calibrated from profile")
    assert effective_spec(v5p, calibration=False).calibration is None
    named = effective_spec(v5p, hardware="TPU v5p")
    assert named.calibration is None and not named.for_mesh
    assert named.calibration_origin.startswith("not looked up")
    given = effective_spec(v5p, hardware="H100", calibration=cal)
    assert given.origin == "catalogue" and given.calibration_origin == "given"


def test_predict_never_reads_a_stored_calibration(v5p):
    cost = StepCost(flops=1e12, bytes_accessed=1e9, mesh=v5p)
    spec = effective_spec(v5p)
    table = predict(cost, spec)
    Calibration(device_kind="TPU v5p", **CAL).save()
    assert predict(cost, spec) == table                  # the file is not read
    stored = predict(cost, effective_spec(v5p))          # the caller asks for it
    by_hand = predict(cost, effective_spec(
        v5p, calibration=Calibration(device_kind="TPU v5p", **CAL)))
    assert stored.step_seconds == by_hand.step_seconds != table.step_seconds
    assert "calibration" in stored.sources and "calibration" not in table.sources


def test_plan_predict_resolves_the_stored_calibration(v5p):
    plan = wb.plan(wb.models.GPTConfig.preset("tiny"), mesh=wb.abstract_mesh("v5p-8", data=4),
                   batch=8, seq=64, compile=False, progress=False)
    table = plan.predict()
    cal = Calibration(device_kind="TPU v5p", **CAL)
    cal.save()
    assert plan.predict().step_seconds == plan.predict(calibration=cal).step_seconds
    assert plan.predict(calibration=False).step_seconds == table.step_seconds
    # the caller's own spec, used as it is
    mine = effective_spec(plan.mesh, calibration=cal)
    assert plan.predict(hardware=mine).step_seconds == plan.predict().step_seconds
    with pytest.raises(ValueError, match="has its calibration already"):
        plan.predict(hardware=mine, calibration=False)


def test_bad_arguments_say_what_to_pass(v5p):
    with pytest.raises(TypeError, match="not a MeshInfo"):
        effective_spec(wb.abstract_mesh("v5p-8", data=4).shape)
    with pytest.raises(ValueError, match="no hardware entry for 'abacus'"):
        effective_spec(v5p, hardware="abacus")
    with pytest.raises(TypeError, match="pass a Calibration"):
        effective_spec(v5p, calibration="yes")
    with pytest.raises(TypeError, match="spec=.* not an EffectiveSpec; give "
                                        "wb.hardware.effective_spec"):
        predict(StepCost(flops=1.0, bytes_accessed=1.0, mesh=v5p), hardware_spec("TPU v5p"))
    assert isinstance(dataclasses.replace(effective_spec(v5p)), EffectiveSpec)
