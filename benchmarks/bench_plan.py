"""Plans: a compiled plan of "tiny" on 8 simulated devices, an analytic plan of "70b" on a pod.

The compiled plan's time includes abstract init, layouts, lowering, XLA compilation,
HLO parsing and lints (what ``wb.plan`` costs in a notebook); the first plan of the
process also pays JAX start-up, so the median of three plans is reported beside it.
The analytic plan is on an abstract v5p-1024 (512 chips, data=128 x model=4): no
devices, no compilation; its time is layouts of ~2,200 tensors over 512 devices.
"""
from __future__ import annotations

import statistics
import time
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
    big = GPTConfig.preset("70b")
    wb.plan(GPTConfig.preset("tiny"), mesh=pod, rules="fsdp_tp", batch=512, seq=128)  # warm
    t70, p70 = _timed(lambda: wb.plan(big, mesh=pod, rules="fsdp_tp", batch=512, seq=8192))
    return [
        {"name": "compiled plan of tiny on 8 devices (first in process)", "value": round(first, 2),
         "unit": "s", "target": "< 20 s", "ok": first < 20,
         "notes": (f"fsdp_tp on data=4 x model=2, batch 8 x 128; compile "
                   f"{plans[0].compile_seconds:.1f} s, {len(plans[0].collectives)} collective "
                   f"kinds, {len(plans[0].layouts)} tensors")},
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


if __name__ == "__main__":  # pragma: no cover
    for row in run():
        print(row)
