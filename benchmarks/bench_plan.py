"""Plans: a compiled plan of "tiny" on 8 simulated devices, an analytic plan of "70b" on a pod,
TPU-compiled plans of "1b" and "7b" for pod slices (the TPU compiler on this CPU machine), the
compile caches, and what installing libtpu costs a CPU process that never plans for a TPU.

The compiled plan's time includes abstract init, layouts, lowering, XLA compilation,
HLO parsing and lints (what ``wb.plan`` costs in a notebook); the first plan of the
process also pays JAX start-up, so the median of three plans is reported beside it.
The analytic plan is on an abstract v5p-1024 (512 chips, data=128 x model=4): no
devices, no compilation; its time is layouts of ~2,200 tensors over 512 devices.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run() -> list[dict[str, Any]]:
    """Benchmark rows for the compiled tiny plan and the analytic 70b plan."""
    import workbench as wb
    from workbench.models import GPTConfig

    mesh = wb.make_mesh(data=4, model=2)
    tiny = GPTConfig.preset("tiny")
    times, plans = [], []
    for rules in ("fsdp_tp", "fsdp", "tp"):
        t, p = _timed(lambda r=rules: wb.plan(tiny, mesh=mesh, rules=r, batch=8, seq=128))
        times.append(t)
        plans.append(p)
    first = times[0]
    pod = wb.abstract_mesh("v5p-1024", data=-1, model=4)
    big = GPTConfig.preset("70b", scan_layers=False)   # unrolled, as this row has measured
    wb.plan(GPTConfig.preset("tiny"), mesh=pod, rules="fsdp_tp", batch=512, seq=128)  # warm
    t70, p70 = _timed(lambda: wb.plan(big, mesh=pod, rules="fsdp_tp", batch=512, seq=8192,
                                      compile=False))
    return tpu_rows() + import_rows() + [
        {"name": "compiled plan of tiny on 8 devices (first in process)", "value": round(first, 2),
         "unit": "s", "target": "< 20 s", "ok": first < 20,
         "notes": (f"fsdp_tp on data=4 x model=2, batch 8 x 128; compile "
                   f"{plans[0].report.compile_seconds:.1f} s, "
                   f"{len(plans[0].collectives)} collective kinds, {len(plans[0].layouts)} tensors")},
        {"name": "compiled plan of tiny on 8 devices (median of fsdp_tp/fsdp/tp)",
         "value": round(statistics.median(times), 2), "unit": "s", "target": "< 20 s",
         "ok": statistics.median(times) < 20,
         "notes": "per plan: " + ", ".join(f"{p.name} {t:.1f} s" for p, t in zip(plans, times))},
        {"name": "analytic plan of 70b on abstract v5p-1024", "value": round(t70, 3), "unit": "s",
         "target": "< 2 s", "ok": t70 < 2,
         "notes": (f"data=128 x model=4 (512 devices), fsdp_tp, batch 512 x 8192; "
                   f"{len(p70.layouts)} tensors; params/device "
                   f"{p70.memory['params'] / 2**20:.0f} MiB; fits={p70.fits}")},
    ]


_PLAN = """
import json, sys, time
import workbench as wb
from workbench.models import GPTConfig
cfg, preset, model, batch, seq = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
scan = sys.argv[6] == "scan"
t = time.perf_counter()
p = wb.plan(GPTConfig.preset(cfg).replace(remat="full", scan_layers=scan), mesh=wb.abstract_mesh(preset, data=-1, model=model),
            rules="fsdp_tp", batch=batch, seq=seq, progress=False)
wall = time.perf_counter() - t
t = time.perf_counter()
again = wb.plan(GPTConfig.preset(cfg).replace(remat="full", scan_layers=scan), mesh=wb.abstract_mesh(preset, data=-1, model=model),
                rules="fsdp_tp", batch=batch, seq=seq, progress=False)
print(json.dumps({"wall": wall, "compile": p.report.compile_seconds,
                  "cached": p.report.compile_cached,
                  "again": time.perf_counter() - t, "again_cached": again.report.compile_cached,
                  "source": p.source, "total": p.memory["total"],
                  "estimate": p.report.memory_estimate["total"],
                  "fits": p.fits, "step": p.predicted.step_seconds, "mfu": p.predicted.mfu,
                  "compiler_seconds": p.predicted.compiler_seconds}))
"""


def _plan_process(args: list[str], cache: str) -> dict[str, Any]:
    import json

    env = {**os.environ, "WORKBENCH_CACHE": cache}
    out = subprocess.run([sys.executable, "-c", _PLAN, *args], env=env, capture_output=True,
                         text=True, timeout=1800, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def tpu_rows() -> list[dict[str, Any]]:
    """TPU-compiled plans in fresh processes: first (compiles), the same plan again in the
    process (memory cache), and a new process (plan cache on disk)."""
    from workbench._sharding.topology import tpu_compiler_available

    if not tpu_compiler_available():
        return [{"name": "TPU-compiled plans", "value": None, "unit": "", "target": "",
                 "ok": None, "notes": "libtpu not installed: not measured"}]
    rows = []
    cases = [("1b", "v5p-32", 4, 64, 2048, "unrolled"), ("7b", "v5p-128", 4, 64, 4096, "scan")]
    for cfg, preset, model, batch, seq, layers in cases:
        with tempfile.TemporaryDirectory() as cache:
            args = [cfg, preset, str(model), str(batch), str(seq), layers]
            first = _plan_process(args, cache)
            second = _plan_process(args, cache)
        what = (f"{cfg} on {preset} (fsdp_tp, model={model}, batch {batch} x {seq}, remat full, "
                f"{'scanned' if layers == 'scan' else 'unrolled'} layers)")
        rows += [
            {"name": f"TPU-compiled plan of {what}: first", "value": round(first["wall"], 1),
             "unit": "s", "target": "", "ok": None,
             "notes": (f"source {first['source']}; compile {first['compile']:.1f} s; "
                       f"{first['total'] / 2**30:.1f} GiB/chip compiled vs "
                       f"{first['estimate'] / 2**30:.1f} GiB analytic; predicted step "
                       f"{first['step']:.3g} s, MFU {first['mfu']:.1%}; TPU compiler's own "
                       "estimate " + (f"{first['compiler_seconds']:.3g} s"
                                      if first["compiler_seconds"] else
                                      "not used (a scanned program: one loop body)"))},
            {"name": f"TPU-compiled plan of {what}: same plan again in the process",
             "value": round(first["again"], 2), "unit": "s", "target": "instant (< 5 s)",
             "ok": first["again_cached"] and first["again"] < 5,
             "notes": "in-process compile cache (tracing and lowering are repeated)"},
            {"name": f"TPU-compiled plan of {what}: a new process (plan cache on disk)",
             "value": round(second["wall"], 2), "unit": "s", "target": "< first / 5",
             "ok": second["cached"] and second["wall"] < first["wall"] / 5,
             "notes": (f"served from $WORKBENCH_CACHE/plans; equal memory: "
                       f"{second['total'] == first['total']}")},
        ]
    rows.append(_jax_cache_row())
    return rows


_JAX_CACHE = """
import time, warnings, jax, sys
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
import workbench as wb
from workbench._sharding.topology import tpu_mesh
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
m = tpu_mesh(wb.abstract_mesh("v5e-4", data=4))
x = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
f = jax.jit(lambda a: jnp.tanh(a @ a.T) @ a, in_shardings=NamedSharding(m, P("data")))
t = time.perf_counter()
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    f.lower(x).compile()
print(time.perf_counter() - t, any("persistent compilation cache" in str(i.message) for i in w))
"""


def _jax_cache_row() -> dict[str, Any]:
    """Whether JAX's persistent compilation cache serves compile-only TPU executables."""
    with tempfile.TemporaryDirectory() as d:
        outs = [subprocess.run([sys.executable, "-c", _JAX_CACHE, d], capture_output=True,
                               text=True, timeout=600, check=True).stdout.split()
                for _ in range(2)]
        entries = len(list(Path(d).iterdir()))
    (t1, _), (t2, warned) = outs
    return {"name": "JAX persistent cache, compile-only TPU executable: 2nd process / 1st",
            "value": round(float(t2) / float(t1), 2), "unit": "x", "target": "", "ok": None,
            "notes": (f"{entries} entry written; 2nd process warned it could not read it: "
                      f"{warned == 'True'} (no TPU client to load it), so Workbench keeps its "
                      "own plan cache for TPU plans")}


_IMPORT = ("import time; t = time.perf_counter(); import workbench as wb, jax; wb.devices(); "
           "jax.devices(); print(time.perf_counter() - t)")
_BARE = "import jax; jax.devices()"


def import_rows() -> list[dict[str, Any]]:
    """``import workbench; wb.devices(); jax.devices()`` on this CPU host with libtpu
    installed vs hidden (a shadow ``libtpu`` module that fails to import), interleaved,
    5 windows; and what a process that never imports workbench's device code prints."""
    from workbench._sharding.topology import tpu_compiler_available

    if not tpu_compiler_available():
        return []
    shadow = tempfile.mkdtemp()
    Path(shadow, "libtpu.py").write_text("raise ImportError('hidden for the benchmark')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    times: dict[str, list[float]] = {"installed": [], "hidden": []}
    noise: dict[str, str] = {}
    for _ in range(5):
        for side in ("installed", "hidden"):
            e = dict(env, PYTHONPATH=shadow) if side == "hidden" else env
            out = subprocess.run([sys.executable, "-c", _IMPORT], env=e, capture_output=True,
                                 text=True, timeout=300, check=True)
            times[side].append(float(out.stdout.split()[-1]))
            noise[side] = out.stderr.strip()
    bare = subprocess.run([sys.executable, "-c", _BARE], env=env, capture_output=True,
                          text=True, timeout=300, check=True).stderr.strip()
    ratio = statistics.median(times["installed"]) / statistics.median(times["hidden"])
    return [{"name": "import workbench + wb.devices() + jax.devices() on CPU: libtpu "
                     "installed / hidden",
             "value": round(ratio, 3), "unit": "x", "target": "<= 1.05, no output",
             "ok": ratio <= 1.05 and not noise["installed"],
             "notes": (f"medians {statistics.median(times['installed']):.2f} s vs "
                       f"{statistics.median(times['hidden']):.2f} s over 5 interleaved windows; "
                       f"stderr with libtpu: {noise['installed'][:120]!r}")},
            {"name": "plain 'import jax; jax.devices()' with libtpu installed (no workbench)",
             "value": len(bare.splitlines()), "unit": "stderr lines", "target": "", "ok": None,
             "notes": ("libtpu's start-up messages, which workbench's device code (any wb "
                       "mesh, device or plan call; importing workbench.hardware) suppresses "
                       f"on hosts without TPU chips: {bare[:100]!r}")}]


if __name__ == "__main__":  # pragma: no cover
    for row in run():
        print(row)
