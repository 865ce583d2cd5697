"""Pipeline parallelism on 8 simulated CPU devices: measured step time against the bubble
formula across micro-batch counts (as a ratio to the step without a pipeline), and compile
time of unrolled vs scanned layers as the depth grows."""
from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

STAGES = 4
BATCH, SEQ, LAYERS = 16, 64, 8
MICROBATCHES = (1, 2, 4, 8)
DEPTHS = (4, 16)
REPEATS = 12


def _step_time(plan: Any) -> float:
    """Median wall time of the plan's compiled step (state donated and carried)."""
    step = plan.train_step()
    state = plan.init_state()
    tokens = np.random.default_rng(0).integers(0, plan.cfg.vocab_size, (BATCH, SEQ))
    batch = {k: jax.device_put(jnp.asarray(tokens, jnp.int32), plan.batch_shardings[k])
             for k in ("inputs", "targets")}
    times = []
    for _ in range(REPEATS + 2):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def run() -> list[dict[str, Any]]:
    """The benchmark rows (see the module docstring)."""
    import workbench as wb
    from workbench.models import GPTConfig

    cfg = GPTConfig.preset("tiny", n_layers=LAYERS, scan_layers=True)
    base = _step_time(wb.plan(cfg, mesh=wb.make_mesh(data=8), batch=BATCH, seq=SEQ,
                              progress=False))
    rows = []
    mesh = wb.make_mesh(stage=STAGES, data=8 // STAGES)
    shape = (f"tiny with {LAYERS} layers, batch {BATCH} x seq {SEQ}, stage={STAGES} x "
             f"data={8 // STAGES} against data=8 ({1e3 * base:.1f} ms/step)")
    for m in MICROBATCHES:
        p = wb.plan(cfg, mesh=mesh, batch=BATCH, seq=SEQ, progress=False,
                    pipeline={"microbatches": m, "schedule": "gpipe"})
        ratio = _step_time(p) / base
        bubble = p.pipeline["bubble_formula"]
        rows.append({
            "name": f"pipeline: step time / no-pipeline step, GPipe, {m} micro-batch(es)",
            "unit": "x", "value": round(ratio, 3),
            "target": f"formula 1/(1-bubble) = {1 / (1 - bubble):.3f}", "ok": None,
            "notes": f"bubble (S-1)/(M+S-1) = {bubble:.3f}; the simulated devices share the "
                     f"CPU cores, so the work of all stages adds up: each computes every one "
                     f"of the M+S-1 iterations, M useful; {shape}"})
    for n in DEPTHS:
        secs = {}
        for scanned in (False, True):
            c = GPTConfig.preset("tiny", n_layers=n, scan_layers=scanned)
            t0 = time.perf_counter()
            p = wb.plan(c, mesh=wb.make_mesh(data=8), batch=BATCH, seq=SEQ, progress=False)
            secs[scanned] = p.report.compile_seconds or time.perf_counter() - t0
        rows.append({
            "name": f"compile time: unrolled / scanned layers, {n} layers", "unit": "x",
            "value": round(secs[False] / secs[True], 2), "target": "> 1 and growing with depth",
            "ok": None,
            "notes": f"unrolled {secs[False]:.1f} s, scanned {secs[True]:.1f} s (XLA:CPU, "
                     f"tiny, fsdp over data=8, batch {BATCH} x seq {SEQ})"})
    return rows
