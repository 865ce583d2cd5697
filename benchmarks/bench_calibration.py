"""Calibration: the analytic memory model against the compilers, predicted step time against
measured step time on this machine's simulated CPU devices.

(a) Memory: for each preset x strategy x mesh (x remat) the plan is compiled (XLA:CPU on
    the 8 simulated devices, data=4 x model=2; the TPU compiler for an abstract v5p-16
    slice, data=4 x model=2, in a second process while the CPU compiles run) and the
    analytic estimate (``plan.report.memory_estimate``, ``analytic.temp_breakdown``) is compared
    with ``compiled.memory_analysis()``: the row's value is analytic total / compiled
    total, target 0.90-1.10. Params, optimizer and batch are argument shards of the same
    layouts (exact by construction); gradients are their shards; "activations" is temp
    minus gradients in both; the notes split the analytic temp into its terms and say
    what the rest is.
(b) Step time: the CPU hardware entry (``workbench.hardware.cpu_spec``: matmul peak,
    memory bandwidth, in-process all-reduce bandwidth, TCP loopback bandwidth) is measured
    first, then each case's real train step (``plan.train_step()`` on ``plan.init_state()``)
    is timed in windows interleaved across the cases, in one process with 8 devices and
    in 2 processes x 4 devices joined by ``jax.distributed`` with gloo over 127.0.0.1. The
    value is ``plan.predicted.step_seconds`` / the median window, target 0.75-1.25.

What cannot be checked here: TPU and GPU step times (nothing runs on them; their
predictions rest on the hardware table and the overlap assumption in
docs/predictions.md), GPU memory (no GPU compiler here: the accelerator coefficients are
the TPU compiler's), TPU memory of models too large to compile in a benchmark.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

MIB = 2**20
ROOT = Path(__file__).resolve().parent.parent
MEMORY_TARGET = (0.90, 1.10)
STEP_TARGET = (0.75, 1.25)

#: (preset, rules, remat, batch, seq, overrides) compiled by XLA:CPU on data=4 x model=2.
CPU_MEMORY: tuple[tuple[Any, ...], ...] = tuple(
    [("tiny", r, "none", 8, 128, {}) for r in ("dp", "fsdp", "tp", "fsdp_tp")]
    + [("small", r, "none", 8, 256, {}) for r in ("dp", "fsdp", "tp", "fsdp_tp")]
    + [("small", "fsdp", "dots", 8, 256, {}), ("small", "fsdp", "full", 8, 256, {}),
       ("small", "tp", "full", 8, 256, {}), ("small", "dp", "none", 8, 256,
                                             {"tie_embeddings": False})])
#: The same for the TPU compiler (preset, mesh axes after the overrides), in bfloat16 (the
#: TPU's compute dtype); each compile takes about a minute here (the 70b one with scanned
#: layers: notebook 08's layout), and the plan cache serves them again.
TPU_MEMORY: tuple[tuple[Any, ...], ...] = (
    ("small", "fsdp", "none", 32, 1024, {"dtype": "bfloat16"}),
    ("small", "tp", "none", 32, 1024, {"dtype": "bfloat16"}),
    ("small", "fsdp_tp", "dots", 32, 1024, {"dtype": "bfloat16"}),
    ("small", "dp", "none", 8, 128, {"dtype": "bfloat16"}),
    ("1b", "fsdp", "full", 32, 2048, {"scan_layers": False, "mesh": ("v5p-16", {"data": 8})}),
    ("70b", "fsdp", "full", 256, 4096, {"vocab_size": 32000, "scan_layers": True,
                                       "mesh": ("v5p-128", {"data": -1})}),
    ("tiny", "fsdp_tp", "none", 32, 128, {"dtype": "bfloat16"}),
)
TPU_SLICE = ("v5p-16", {"data": 4, "model": 2})
#: (preset, rules, batch, seq, steps per window) timed on the CPU devices.
STEPS_1x8: tuple[tuple[Any, ...], ...] = (
    ("tiny", "fsdp", 16, 128, 10), ("tiny", "dp", 64, 128, 4),
    ("tiny", "fsdp_tp", 32, 128, 6), ("small", "fsdp", 8, 64, 1))
STEPS_2x4: tuple[tuple[Any, ...], ...] = (("tiny", "fsdp", 16, 128, 6), ("tiny", "dp", 64, 128, 3))
WINDOWS = 3


# -- (a) memory ------------------------------------------------------------------------------

def _cfg(preset: str, remat: str, overrides: dict[str, Any]) -> Any:
    from workbench.models import GPTConfig

    over = {k: v for k, v in overrides.items() if k != "mesh"}
    return GPTConfig.preset(preset).replace(remat=remat, **over)


def _mb(x: float | None) -> str:
    return "—" if x is None else f"{x / MIB:,.0f}" if x >= 10 * MIB else f"{x / MIB:.2f}"


def _case_name(case: Sequence[Any]) -> str:
    preset, rules, remat, batch, seq, over = case
    extra = "".join(f", {k}={v}" for k, v in over.items() if k not in ("dtype", "mesh"))
    dtype = over.get("dtype")
    where = ""
    if "mesh" in over:
        name, axes = over["mesh"]
        where = f" on {name} " + " x ".join(f"{k}={v}" for k, v in axes.items())
    return (f"{preset}{' ' + dtype if dtype else ''} {rules}"
            f"{'' if remat == 'none' else f' remat={remat}'}, batch {batch} x {seq}{extra}"
            f"{where}")


_REST = {
    "cpu": "XLA:CPU's transposed copies of weights and activations and small buffers",
    "tpu": "tile padding, copies of optimizer state the update fuses with, fragmentation",
}


def memory_row(plan: Any, case: Sequence[Any], compiler: str) -> dict[str, Any]:
    """One calibration row: analytic / compiled total of a compiled plan, with every
    category and the analytic temp's terms in the notes."""
    from workbench.perf import _analytic as analytic

    preset, rules, remat, batch, seq, over = case
    m, e = plan.memory, plan.report.memory_estimate
    t = analytic.temp_breakdown(plan.cfg, batch, seq, plan.rules, plan.mesh)
    ratio = e["total"] / m["total"]
    lo, hi = MEMORY_TARGET
    toy = compiler == "tpu" and preset == "tiny"
    exact = all(m[k] == e[k] for k in ("params", "optimizer", "batch"))
    terms = [("saved activations", t["saved"]), ("logits", t["logits"]),
             ("transient", t["transient"] if t["transient"] > t["logits"] else 0),
             ("FSDP gathers", t["gathered"]), ("embedding grads", t["embedding_grads"]),
             ("scratch", t["scratch"])]
    if t["phase"] == "forward":
        split = " + ".join(f"{k} {_mb(v)}" for k, v in terms if v)
        temp_text = f"forward-end peak = {split}"
    else:
        temp_text = (f"gradient-reduction peak {_mb(t['reduction_peak'])} (forward-end "
                     f"{_mb(t['forward_peak'])})")
    rest = m["temp"] - e["temp"]
    notes = (f"compiled {_mb(m['total'])} MiB (temp {_mb(m['temp'])}), analytic "
             f"{_mb(e['total'])}; params {_mb(e['params'])}, optimizer {_mb(e['optimizer'])}, "
             f"batch {_mb(e['batch'])}: {'exact (same layouts)' if exact else 'DIFFER'}; "
             f"gradients {_mb(e['gradients'])} (shards); activations (temp - gradients) "
             f"{_mb(m['activations'])} vs {_mb(e['activations'])}; temp x"
             f"{e['temp'] / m['temp']:.3f}: {temp_text}; the rest {rest / MIB:+,.1f} MiB "
             f"({_REST[compiler]})")
    if toy:
        notes = ("no target: a toy model on a TPU (d_model 64, head_dim 16) is laid out in "
                 "(8, 128) tiles and the estimate's 48 MiB scratch is ~5 MiB here; " + notes)
    elif compiler == "tpu" and remat != "none":
        notes += ("; with remat the estimate is what the step needs at least: where HBM is "
                  "to spare the TPU compiler recomputes several layers ahead and keeps them")
    return {"name": f"memory, {compiler.upper()} compiler: {_case_name(case)}",
            "value": round(ratio, 3), "unit": "analytic/compiled",
            "target": "" if toy else f"{lo:.2f}-{hi:.2f}",
            "ok": None if toy else bool(lo <= ratio <= hi), "notes": notes,
            "table": "memory", "compiler": compiler, "mesh": plan.mesh.describe(),
            "compiled": {k: m.get(k) for k in ("params", "optimizer", "batch", "gradients",
                                                "activations", "temp", "total")},
            "analytic": {k: e.get(k) for k in ("params", "optimizer", "batch", "gradients",
                                                "activations", "temp", "total")},
            "terms": {k: v for k, v in t.items()}}


def hbm_row(plan: Any, case: Sequence[Any]) -> dict[str, Any]:
    """Analytic HBM traffic (``analytic.hbm_bytes`` with the model) / the compiler's
    ``bytes accessed``; the value the roofline divides by the HBM bandwidth."""
    from workbench.perf import _analytic as analytic

    preset, rules, remat, batch, seq, over = case
    p_lay = {k[len("params."):]: v for k, v in plan.layouts.items() if k.startswith("params.")}
    new = analytic.hbm_bytes(plan.report.memory_estimate, p_lay, plan.rules, plan.mesh,
                             cfg=plan.cfg, batch=batch, seq=seq)
    compiled = plan.report.cost["bytes accessed"]
    lo, hi = STEP_TARGET
    return {"name": f"HBM bytes per step, TPU compiler: {_case_name(case)}",
            "value": round(new / compiled, 3), "unit": "analytic/compiled",
            "target": f"{lo}-{hi}", "ok": bool(lo <= new / compiled <= hi), "table": "hbm",
            "notes": (f"compiled {compiled / 1e9:.1f} GB (the TPU compiler's cost analysis), "
                      f"analytic {new / 1e9:.1f} GB; without the model (the formula before "
                      f"calibration: 3 x weights + 2 x activations + update) "
                      f"{plan.report.hbm_bytes_estimate / 1e9:.1f} GB "
                      f"(x{plan.report.hbm_bytes_estimate / compiled:.2f})")}


def memory_rows(cases: Sequence[Sequence[Any]], mesh: Any, compiler: str) -> list[dict]:
    """Compile each case on ``mesh`` (or the abstract slice its overrides name as
    ``"mesh": (preset, axes)``) and return its calibration row (and, for the TPU
    compiler, an HBM-traffic row beside it)."""
    import workbench as wb

    rows = []
    for case in cases:
        preset, rules, remat, batch, seq, over = case
        where = mesh if "mesh" not in over else wb.abstract_mesh(over["mesh"][0],
                                                                  **over["mesh"][1])
        plan = wb.plan(_cfg(preset, remat, over), mesh=where, rules=rules, batch=batch,
                       seq=seq, progress=False)
        if plan.compiled is None:
            raise RuntimeError(f"{_case_name(case)} was not compiled: {plan.source_reason}")
        rows.append(memory_row(plan, case, compiler))
        # scanned layers: the compiler's cost analysis counts the loop body once
        if compiler == "tpu" and preset != "tiny" and "bytes accessed" in plan.report.cost \
                and not getattr(plan.cfg, "scan_layers", False):
            rows.append(hbm_row(plan, case))
    return rows


def _tpu_rows(cases: Sequence[Sequence[Any]]) -> list[dict]:
    import workbench as wb

    preset, axes = TPU_SLICE
    return memory_rows(cases, wb.abstract_mesh(preset, **axes), "tpu")


def _start_tpu(cases: Sequence[Sequence[Any]]) -> subprocess.Popen:
    """The TPU compiles in their own process (they overlap the CPU compiles)."""
    return subprocess.Popen([sys.executable, "-m", "benchmarks.bench_calibration", "--tpu",
                             json.dumps([list(c) for c in cases])], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(8))


def _env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    return env


# -- (b) step time ---------------------------------------------------------------------------

def hardware_row(refresh: bool = True) -> dict[str, Any]:
    """The CPU hardware entry, measured now (``refresh``) and cached for the predictions."""
    from workbench import hardware as hw

    peak = hw.measured_cpu_peak(refresh=refresh)
    mem = hw.measured_cpu_memory_bandwidth(refresh=refresh)
    psum = hw.measured_cpu_collective_bandwidth(refresh=refresh)
    tcp = hw.measured_loopback_bandwidth(refresh=refresh)
    return {"name": "CPU hardware entry, measured at start", "value": round(peak / 1e9, 1),
            "unit": "GFLOP/s", "target": "", "ok": None, "table": "hardware",
            "peak_flops": peak, "memory_bandwidth": mem, "collective_bandwidth": psum,
            "loopback_bandwidth": tcp,
            "notes": (f"float32 1024^3 matmul {peak / 1e9:.1f} GFLOP/s per host; numpy copy "
                      f"{mem / 1e9:.1f} GB/s; psum over the 8 in-process devices "
                      f"{(psum or 0) / 1e9:.2f} GB/s per device (ring formula); one TCP "
                      f"stream over 127.0.0.1 {tcp / 1e9:.2f} GB/s. Shared by the 8 devices "
                      "in the predictions (workbench.hardware.cpu_spec)")}


def _batch(plan: Any, vocab: int, batch: int, seq: int) -> dict[str, Any]:
    import jax
    import numpy as np

    toks = np.random.default_rng(0).integers(0, vocab, (batch, seq), dtype=np.int32)
    return {k: jax.make_array_from_callback(toks.shape, plan.batch_shardings[k],
                                            lambda idx: toks[idx]) for k in ("inputs", "targets")}


def collective_latency(mesh: Any, repeats: int = 20) -> float:
    """Seconds of one all-reduce of 8 floats per device over every device of ``mesh``
    (best of ``repeats``): the fixed cost of a collective, which the bandwidth-only ring
    formulas of ``predict.py`` leave out (across gloo processes it is not in the model)."""
    from workbench.hardware import psum_seconds

    return psum_seconds(mesh, 8, repeats)


def measure_steps(cases: Sequence[Sequence[Any]], *, windows: int = WINDOWS) -> list[dict]:
    """Plan, initialise and time each case's train step on a data=4 x model=2 mesh of the
    devices at hand (all processes), in windows interleaved across the cases.

    Returns one dict per case: ``seconds`` (per step, each window), the prediction and its
    breakdown. Every process runs the same steps (collectives need them all).
    """
    import jax

    import workbench as wb
    from workbench.models import GPTConfig

    mesh = wb.make_mesh(data=4, model=2)
    live = []
    for preset, rules, batch, seq, steps in cases:
        cfg = GPTConfig.preset(preset)
        plan = wb.plan(cfg, mesh=mesh, rules=rules, batch=batch, seq=seq, progress=False)
        state, data, step = plan.init_state(0), _batch(plan, cfg.vocab_size, batch, seq), \
            plan.train_step()
        for _ in range(2):
            state, metrics = step(state, data)
            jax.block_until_ready(metrics)
        live.append({"case": (preset, rules, batch, seq, steps), "plan": plan, "state": state,
                     "data": data, "step": step, "seconds": []})
    for _ in range(windows):
        for c in live:
            n = c["case"][4]
            t0 = time.perf_counter()
            for _ in range(n):
                c["state"], metrics = c["step"](c["state"], c["data"])
            jax.block_until_ready(metrics)
            c["seconds"].append((time.perf_counter() - t0) / n)
    latency = collective_latency(mesh)
    out = []
    for c in live:
        p = c["plan"].predicted
        b = p.breakdown
        out.append({"case": list(c["case"]), "seconds": c["seconds"],
                    "predicted": p.step_seconds, "bound": p.bound,
                    "compute": b["compute"], "memory": b["memory"],
                    "communication": b["communication"], "cost": c["plan"].report.cost,
                    "hosts": c["plan"].mesh.n_hosts, "latency": latency,
                    "collectives": sum(x.count for x in c["plan"].collectives),
                    "operands": sum(x.count * max(1, len(x.shapes))
                                    for x in c["plan"].collectives)})
    return out


def step_row(result: dict[str, Any], setup: str) -> dict[str, Any]:
    """One step-time row: predicted / measured (median window), with the breakdown."""
    preset, rules, batch, seq, _ = result["case"]
    measured = statistics.median(result["seconds"])
    ratio = result["predicted"] / measured
    serial = result["compute"] + result["memory"] + result["communication"]
    # a collective's fixed cost: XLA:CPU's in-process rendezvous once per instruction;
    # gloo runs one TCP collective per operand of a tuple instruction
    what = "operands" if result["hosts"] > 1 else "collectives"
    fixed = result[what] * result["latency"]
    lo, hi = STEP_TARGET
    ms = lambda s: f"{s * 1e3:,.1f}"
    return {"name": f"step time, {setup}: {preset} {rules}, batch {batch} x {seq}",
            "value": round(ratio, 3), "unit": "predicted/measured", "target": f"{lo}-{hi}",
            "ok": bool(lo <= ratio <= hi), "table": "step", "setup": setup,
            "measured_s": measured, "predicted_s": result["predicted"],
            "windows_s": result["seconds"],
            "notes": (f"measured {ms(measured)} ms (windows "
                      f"{', '.join(ms(s) for s in result['seconds'])}); predicted "
                      f"{ms(result['predicted'])} ms, {result['bound']}-bound: compute "
                      f"{ms(result['compute'])}, memory {ms(result['memory'])}, communication "
                      f"{ms(result['communication'])}; compute + memory + communication "
                      f"(no overlap) x{serial / measured:.2f}; + {result[what]} collective "
                      f"{'operands' if what == 'operands' else 'instructions'} x "
                      f"{result['latency'] * 1e3:.2f} ms measured latency "
                      f"x{(serial + fixed) / measured:.2f}")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gloo_steps(cases: Sequence[Sequence[Any]], timeout: float = 400) -> list[dict]:
    """``measure_steps`` in 2 processes x 4 CPU devices joined over gloo on 127.0.0.1."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.bench_calibration",
                               "--worker", str(port), str(i), json.dumps(cases)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(4)) for i in range(2)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"gloo worker failed ({p.returncode}): {err[-2000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def _worker(port: int, pid: int, cases: list[list[Any]]) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid)
    results = measure_steps([tuple(c) for c in cases])
    if pid == 0:
        print(json.dumps(results, default=float))
    sys.stdout.flush()
    os._exit(0)  # skip jax.distributed's shutdown barrier: process 1 may be gone already


# -- the benchmark ---------------------------------------------------------------------------

def run() -> list[dict[str, Any]]:
    """Both calibration tables: memory rows (CPU then TPU compiler), then the CPU hardware
    entry and the step-time rows (1 x 8, then 2 x 4 over gloo)."""
    import workbench as wb

    tpu = _start_tpu(TPU_MEMORY)
    rows = memory_rows(CPU_MEMORY, wb.make_mesh(data=4, model=2), "cpu")
    out, err = tpu.communicate(timeout=900)
    if tpu.returncode != 0:
        raise RuntimeError(f"TPU compiles failed: {err[-2000:]}")
    rows += json.loads(out.strip().splitlines()[-1])
    order = {"memory": 0, "hbm": 1}
    rows.sort(key=lambda r: order[r["table"]])   # stable: CPU, then TPU memory; then HBM
    rows.append(hardware_row(refresh=True))
    rows += [step_row(r, "1 process x 8 devices") for r in measure_steps(STEPS_1x8)]
    rows += [step_row(r, "2 processes x 4 devices, gloo")
             for r in gloo_steps([list(c) for c in STEPS_2x4])]
    return rows


if __name__ == "__main__":  # pragma: no cover
    if sys.argv[1:2] == ["--tpu"]:
        print(json.dumps(_tpu_rows([tuple(c) for c in json.loads(sys.argv[2])]), default=float))
    elif sys.argv[1:2] == ["--worker"]:
        _worker(int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))
    else:
        for row in run():
            print(row)
