"""GPU steps predicted before the first run, checked against the stored H200 measurements.

From ``benchmarks/gpu_runs/2026-11-28-h200-e-xent`` (its traces split into GEMM, cuDNN
attention and memory-bound time: ``efficiency-inputs.json``) and the plans this machine
makes of the same steps on one H200 (``wb.abstract_mesh("1xH200")``, the Trainer's
optimizer): the efficiencies fitted on one preset's trace predict the other preset's
measured step (rows "held out", target within 15%), and the catalogue's record (fitted on
both traces) predicts the Trainer's default steps of that run, configurations neither trace
had; beside them the datasheet roofline the catalogue alone gave. No timing here: the
measurements are the H200's; the numbers of the plans are this workbench's.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "benchmarks" / "gpu_runs" / "2026-11-28-h200-e-xent"
INPUTS = RUN / "efficiency-inputs.json"
TARGET = (0.85, 1.15)


def plan_of(case: dict[str, Any]) -> Any:
    """The plan a fresh machine makes of a stored case's step on one H200."""
    import workbench as wb
    from workbench.models import GPTConfig
    from workbench._optimizer import AdamW

    cfg = GPTConfig.preset(case["preset"], seq_len=case["seq"], **case["model"])
    return wb.plan(cfg, mesh=wb.abstract_mesh("1xH200", data=-1), rules="fsdp",
                   batch=case["batch"], seq=case["seq"], optimizer=AdamW().build(1_000_000),
                   progress=False)


def _shape(case: dict[str, Any], what: str) -> str:
    return f"{case['preset']} {case['batch']} x {case['seq']} ({what})"


def run() -> list[dict[str, Any]]:
    from workbench.hardware import effective_spec, hardware_spec
    from workbench.perf._efficiency import efficient_local, fit_efficiency
    from workbench.perf._predict_plan import step_numbers

    inputs = json.loads(INPUTS.read_text())
    peak = hardware_spec("H200").peak_flops
    measured = {"machine": f"1 x {inputs['device']} (stored run {RUN.name}), predicted on "
                "this machine", "when": inputs["date"]}
    traced = {c["case"]: (c, step_numbers(plan_of(c).report, name=c["case"]))
              for c in inputs["traced"]}
    rows = []
    for held, (case, numbers) in traced.items():
        for fitted, (fcase, fnumbers) in traced.items():
            if fitted == held:
                continue
            eff = fit_efficiency([(fnumbers, fcase["split"])], device_kind="H200",
                                 peak_flops=peak, run=str(RUN.relative_to(ROOT)),
                                 date=inputs["date"], jax=inputs["jax"])
            seconds, terms, source = efficient_local(numbers, eff, peak)
            rows.append(_row(f"predicted step, 1 x H200: {_shape(case, case['variant'])}, held "
                             f"out: measured efficiencies fitted on {fitted} "
                             f"{fcase['variant']}", seconds, case["split"]["step"], terms,
                             source, measured, target=True))
    for case in inputs["trainer"]:
        plan = plan_of(case)
        pred = plan.predict(calibration=False)
        spec = effective_spec(plan.mesh, calibration=False)
        label = f"Trainer default, {', '.join(f'{k}={v}' for k, v in case['model'].items())}"
        rows.append(_row(f"predicted step, 1 x H200: {_shape(case, label)}, catalogue "
                         "(measured efficiencies)", pred.step_seconds, case["measured"],
                         None, spec.efficiency_origin + "; " + pred.sources["local"],
                         measured, target=True))
        roof = pred.breakdown["roofline_local"]
        rows.append(_row(f"predicted step, 1 x H200: {_shape(case, label)}, datasheet "
                         "roofline (before)", roof, case["measured"], None,
                         "max(compute, memory) at the datasheet's 989 TFLOP/s and 4.8 TB/s",
                         measured, target=False))
    return rows


def _row(name: str, predicted: float, step: float, terms: dict[str, float] | None,
         source: str, measured: dict[str, str], *, target: bool) -> dict[str, Any]:
    ratio = predicted / step
    parts = ("" if terms is None else " = " + " + ".join(
        f"{k} {v * 1e3:.1f}" for k, v in terms.items()) + " ms")
    lo, hi = TARGET
    return {"name": name, "value": ratio, "unit": "predicted/measured",
            "target": f"{lo}-{hi}" if target else "",
            "ok": (lo <= ratio <= hi) if target else None, "measured": measured,
            "notes": (f"predicted {predicted * 1e3:.1f} ms{parts}, measured {step * 1e3:.1f} ms "
                      f"(the H200's trace); {source}")}


if __name__ == "__main__":
    for r in run():
        print(f"{r['value']:.3f}  {r['name']}")
