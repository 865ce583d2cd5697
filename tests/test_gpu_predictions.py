"""GPU predictions before the first run: the efficiencies measured on a lent H200 (matmul
fraction of peak by shape class, fused-attention FLOP/s, HBM bytes per second) are in the
catalogue with their run and date, a fresh plan of an H200 step uses them (an H100 says it
has none: "table"), and fitted on one stored case they predict the other within 15%. The
reference is the stored measurement itself: benchmarks/gpu_runs/2026-11-28-h200-e-xent
(its traces split into GEMM, attention and memory time: efficiency-inputs.json, re-read
from profiles.tgz in the slow test)."""
from __future__ import annotations

import json
import math
import pathlib
import sys

import pytest

import workbench as wb
from workbench.hardware import effective_spec, generation, hardware_spec
from workbench.hardware._efficiency import (EFFICIENCIES, Efficiency, check_efficiency,
                                            efficiency_origin, measured_efficiency)
from workbench.models import GPTConfig
from workbench.perf._efficiency import StepNumbers, efficient_local, fit_efficiency
from workbench.perf._predict_plan import step_numbers

ROOT = pathlib.Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bench_gpu_predictions import plan_of  # noqa: E402

RUN = ROOT / "benchmarks" / "gpu_runs" / "2026-11-28-h200-e-xent"
INPUTS = json.loads((RUN / "efficiency-inputs.json").read_text())
PEAK = 989e12
#: the issue's bound on a prediction of a case the efficiencies were not fitted on
HELD_OUT = 0.15


@pytest.fixture(scope="module")
def traced() -> dict[str, tuple[StepNumbers, dict]]:
    return {c["case"]: (step_numbers(plan_of(c).report, name=c["case"]), c["split"])
            for c in INPUTS["traced"]}


def _fit(cases: list) -> Efficiency:
    return fit_efficiency(cases, device_kind="H200", peak_flops=PEAK, run=str(RUN),
                          date=INPUTS["date"], jax=INPUTS["jax"])


@pytest.mark.parametrize("fitted, held", [("1b", "small"), ("small", "1b")])
def test_fitted_on_one_preset_the_other_is_predicted_within_15_percent(traced, fitted, held):
    """The held-out check the device script reports, on the stored H200 measurements: the
    efficiencies of one preset's trace predict the other preset's measured step (before:
    the datasheet roofline, 0.50 and 0.56 of the measured step)."""
    eff = _fit([traced[fitted]])
    numbers, split = traced[held]
    seconds, terms, source = efficient_local(numbers, eff, PEAK)
    assert abs(seconds / split["step"] - 1) < HELD_OUT, (seconds, split["step"])
    assert fitted in source and "measured on" in source
    # the roofline of the same numbers at the datasheet's rates is far off (what the
    # catalogue alone gave): the measured efficiencies are what brings it in
    roofline = max((numbers.matmul_flops + numbers.attention_flops) / PEAK,
                   numbers.hbm_bytes / hardware_spec("H200").hbm_bandwidth)
    assert roofline / split["step"] < 0.7
    assert sum(terms.values()) == pytest.approx(seconds)


def test_fit_divides_the_plans_numbers_by_the_measured_time(traced):
    """Hand count of what the fit stores: FLOPs over kernel time over the peak."""
    numbers, split = traced["1b"]
    eff = _fit([traced["1b"]])
    assert eff.matmul_fraction == {"medium": pytest.approx(
        numbers.matmul_flops / split["matmul"] / PEAK)}
    assert eff.attention_flops["medium"] == pytest.approx(
        numbers.attention_flops / split["attention"])
    assert eff.hbm_bandwidth == pytest.approx(numbers.hbm_bytes / split["memory"])
    # a class not measured takes the nearest one, and says so
    wide = StepNumbers(matmul_flops=1e15, attention_flops=0.0, hbm_bytes=1e12, d_model=8192)
    seconds, terms, source = efficient_local(wide, eff, PEAK)
    assert terms["matmul"] == pytest.approx(1e15 / (PEAK * eff.matmul_fraction["medium"]))
    assert "nearest measured to wide" in source


def test_the_catalogue_record_is_the_fit_of_the_stored_traces(traced):
    """The H200 record in the catalogue is what the stored traces give (4 digits)."""
    stored = measured_efficiency("H200")
    again = _fit(list(traced.values()))
    for cls, frac in again.matmul_fraction.items():
        assert stored.matmul_fraction[cls] == pytest.approx(frac, rel=1e-3)
    for cls, rate in again.attention_flops.items():
        assert stored.attention_flops[cls] == pytest.approx(rate, rel=1e-3)
    assert stored.hbm_bandwidth == pytest.approx(again.hbm_bandwidth, rel=1e-3)
    assert stored.run == str(RUN.relative_to(ROOT)) and stored.date == INPUTS["date"]


@pytest.mark.parametrize("case", INPUTS["trainer"], ids=lambda c: c["case"])
def test_a_fresh_plan_of_the_trainers_default_step_uses_the_catalogue(case, tmp_path,
                                                                      monkeypatch):
    """A fresh machine (no stored calibration) plans the Trainer's default step of the
    stored run, a configuration neither trace had (1b without remat, small scanned): its
    prediction comes from the catalogue's measured efficiencies and lands within 15% of
    what trainer.profile measured on the H200."""
    monkeypatch.setenv("WORKBENCH_CALIBRATION", str(tmp_path / "none"))
    plan = plan_of(case)
    pred = plan.predict()
    assert pred.sources["local"].startswith("measured on benchmarks/gpu_runs/")
    assert abs(pred.step_seconds / case["measured"] - 1) < HELD_OUT
    spec = effective_spec(plan.mesh)
    assert spec.efficiency is EFFICIENCIES["H200"]
    assert spec.sources()["efficiency"].startswith("measured on")


def test_an_h100_has_no_measured_run_and_says_table(tmp_path, monkeypatch):
    """No lent H100 run yet: its plans use the datasheet roofline, visibly."""
    monkeypatch.setenv("WORKBENCH_CALIBRATION", str(tmp_path / "none"))
    spec = effective_spec(wb.abstract_mesh("8xH100", data=-1))
    assert spec.efficiency is None
    assert spec.efficiency_origin.startswith("table: no measured run for H100 SXM")
    assert efficiency_origin("H100 SXM") == spec.efficiency_origin
    cfg = GPTConfig.preset("tiny", dtype="bfloat16")
    plan = wb.plan(cfg, mesh=wb.abstract_mesh("1xH100", data=-1), rules="fsdp", batch=8,
                   seq=128, progress=False)
    pred = plan.predict()
    assert pred.step_seconds == pytest.approx(pred.breakdown["roofline_local"])


def test_a_calibration_replaces_the_measured_efficiencies(tmp_path):
    cal = wb.hardware.Calibration(device_kind="H200", compute_factor=0.5, memory_factor=1.0,
                                  matmul_flops=PEAK / 2, hbm_bandwidth=4.8e12,
                                  collectives={}, overlap=None,
                                  provenance=[{"directory": str(tmp_path)}])
    spec = effective_spec(wb.abstract_mesh("1xH200", data=-1), calibration=cal)
    assert spec.efficiency is None and spec.efficiency_origin.startswith("calibrated")


def _record(**change) -> dict:
    return {**EFFICIENCIES["H200"].to_dict(), **change}


def test_a_record_round_trips_through_json():
    d = json.loads(json.dumps(EFFICIENCIES["H200"].to_dict()))
    assert Efficiency.from_dict(d) == EFFICIENCIES["H200"]


@pytest.mark.parametrize("change, names", [
    ({"matmul_fraction": {"medium": 1.3}}, "matmul_fraction['medium'] is 1.3"),
    ({"matmul_fraction": {"medium": float("nan")}}, "matmul_fraction['medium']"),
    ({"matmul_fraction": {}}, "matmul_fraction is empty"),
    ({"matmul_fraction": {"huge": 0.5}}, "shape class 'huge'"),
    ({"matmul_fraction": [0.5]}, "not an object of shape class"),
    ({"attention_flops": {"narrow": -1.0}}, "attention_flops['narrow'] is -1.0"),
    ({"attention_flops": {"narrow": True}}, "attention_flops['narrow'] is True"),
    ({"hbm_bandwidth": 0}, "hbm_bandwidth is 0"),
    ({"hbm_bandwidth": math.inf}, "hbm_bandwidth is inf"),
    ({"hbm_bandwidth": "6e12"}, "hbm_bandwidth is '6e12'"),
    ({"date": "28/11/2026"}, "date is '28/11/2026'"),
    ({"run": ""}, "run is ''"),
    ({"device_kind": None}, "device_kind is None"),
    ({"fitted_on": []}, "fitted_on is []"),
    ({"fitted_on": "1b"}, "fitted_on is '1b'"),
    ({"extra": 1}, "['extra'] unknown"),
    ({"residuals": [{"name": "1b", "ratio": -1}]}, "residuals[0].ratio is -1"),
    ({"residuals": [{"ratio": 1.0}]}, "residuals is [{'ratio': 1.0}]"),
])
def test_a_malformed_record_is_refused_naming_the_field(change, names):
    with pytest.raises(ValueError, match="efficiency record") as e:
        Efficiency.from_dict(_record(**change))
    assert names in str(e.value)


@pytest.mark.parametrize("bad, names", [
    (None, "is a NoneType, not an object"), ([], "is a list"),
    ({"device_kind": "H200"}, "missing"),
])
def test_a_record_that_is_no_object_or_lacks_fields_is_refused(bad, names):
    with pytest.raises(ValueError, match=names):
        check_efficiency(bad)


def test_fit_refuses_no_case_and_a_case_with_no_measured_time(traced):
    with pytest.raises(ValueError, match="no case"):
        _fit([])
    numbers, split = traced["small"]
    with pytest.raises(ValueError, match="measured memory=0"):
        _fit([(numbers, {**split, "memory": 0})])


@pytest.mark.parametrize("name", ["B200", "GB200", "H100", "H200"])
def test_every_blackwell_and_hopper_figure_has_its_source(name):
    """B200 / GB200 (and the Hoppers): bf16 and fp8 peaks, HBM size and bandwidth, NVLink,
    each with a source naming where it was read."""
    gen = generation(name)
    spec = gen.spec
    assert spec.peak_flops > 0 and spec.memory_bytes > 0 and spec.source
    for field in ("hbm_bandwidth", "nvlink_bandwidth", "fp8_flops"):
        assert getattr(spec, field) > 0, field
        assert spec.source_of(field) != "unknown", field
    # dense fp8 doubles dense bf16 on both (Hopper: 1979 = 2 x 989.5, rounded)
    assert spec.fp8_flops == pytest.approx(2 * spec.peak_flops, rel=1e-3)
    assert hardware_spec(gen.device_kind) is spec


def test_a_gb200_is_not_taken_for_a_b200():
    assert hardware_spec("NVIDIA GB200").name == "GB200"
    assert hardware_spec("NVIDIA B200").name == "B200"
    assert "GB200" not in EFFICIENCIES and efficiency_origin("GB200").startswith("table")


@pytest.mark.slow
def test_the_stored_inputs_are_the_traces_split_again():
    """efficiency-inputs.json is what benchmarks.gpu_vs_torch.trace_split reads from the
    run's profiles.tgz (the H200's CUPTI traces, read with the profiler's own reader)."""
    from benchmarks.gpu_vs_torch import trace_split

    for case in INPUTS["traced"]:
        again = trace_split(RUN, case["case"], case["variant"])
        assert again == pytest.approx(case["split"], rel=1e-9)
        assert again["matmul"] + again["attention"] + again["memory"] + again["rest"] == \
            pytest.approx(again["step"], rel=1e-6)


def test_the_bench_rows_are_the_held_out_predictions(traced):
    """bench_gpu_predictions' rows (BENCHMARKS.md) hold the predictions checked above."""
    from benchmarks.bench_gpu_predictions import run

    rows = {r["name"]: r for r in run()}
    held = {n: r for n, r in rows.items() if "held out" in n}
    assert len(held) == 2 and all(r["ok"] and r["target"] == "0.85-1.15" for r in held.values())
    numbers, split = traced["small"]
    seconds, _, _ = efficient_local(numbers, _fit([traced["1b"]]), PEAK)
    (small,) = [r for n, r in held.items() if n.startswith("predicted step, 1 x H200: small")]
    assert small["value"] == pytest.approx(seconds / split["step"])
    before = [r for n, r in rows.items() if "datasheet roofline" in n]
    assert len(before) == 2 and all(r["value"] < 0.6 for r in before)


def test_the_catalogue_residuals_are_the_checks_and_give_the_band(traced, tmp_path,
                                                                  monkeypatch):
    """The record's residuals are the measured / predicted steps of the checks above
    (3 digits), and an H200 plan's error band spans them."""
    monkeypatch.setenv("WORKBENCH_CALIBRATION", str(tmp_path / "none"))
    stored = {r["name"]: r["ratio"] for r in EFFICIENCIES["H200"].residuals}
    for fitted, held, name in (("small", "1b", "1b 8x2048 remat=minimal, fitted on small "
                                "alone"), ("1b", "small", "small 32x1024 unscanned, fitted "
                                           "on 1b alone")):
        numbers, split = traced[held]
        seconds, _, _ = efficient_local(numbers, _fit([traced[fitted]]), PEAK)
        assert stored[name] == pytest.approx(split["step"] / seconds, abs=1e-3)
    ratios = []
    for case in INPUTS["trainer"]:
        pred = plan_of(case).predict()
        ratios.append(case["measured"] / pred.step_seconds)
        assert pred.band.basis == "measured efficiencies"
        # the band spans the stored ratios (4 digits) of these very steps
        assert pred.band.low - 1e-3 <= ratios[-1] <= pred.band.high + 1e-3
    assert sorted(ratios) == pytest.approx(sorted(
        v for k, v in stored.items() if "Trainer default" in k), abs=1e-3)
    assert pred.band.low == pytest.approx(min(stored.values()))
    assert "checked step" in pred.band.summary()
