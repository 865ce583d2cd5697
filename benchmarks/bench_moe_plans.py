"""Grouped mixture-of-experts on a pod: the TPU compiler's plans of a dropless
``mixtral-8x7b`` (fsdp on an abstract v5p-64, remat "full", splash attention, 4096-token
sequences, 16384 tokens per chip) with ``moe_matmul="dense"`` (every expert a slot for
every token: E/k = 4x the routed rows) and ``"grouped"`` (``jax.lax.ragged_dot`` over the
routed rows), beside the ``capacity_factor=1.25`` plan at the same batch: temporary
(activation) memory per chip and the compiler's FLOPs per chip.

Compiled with libtpu on this CPU (minutes per plan); nothing is timed, so the rows do not
depend on how loaded the machine is.
"""
from __future__ import annotations

import json
import math
from typing import Any


def mixtral_plans(n_layers: int | None = None, tokens_per_chip: int = 16384
                  ) -> dict[str, dict[str, Any]]:
    """TPU plans of dropless Mixtral-8x7B, dense and grouped, and of capacity 1.25 (see the
    module docstring): per case the plan's ``source``, compiled ``temp`` bytes per chip
    and its formula estimate, and the compiler's ``flops`` per chip (None if not compiled).

    Args:
        n_layers: fewer layers than the preset's 32 (a test's shorter compile), or None.
        tokens_per_chip: tokens of one step per chip (4096-token sequences).
    """
    import workbench as wb
    from workbench.models import GPTConfig

    base = GPTConfig.preset("mixtral-8x7b", attention="splash", remat="full")
    if n_layers is not None:
        base = base.replace(n_layers=n_layers)
    cases = {"dense": base.replace(capacity_factor=None, moe_matmul="dense"),
             "grouped": base.replace(capacity_factor=None, moe_matmul="grouped"),
             "capacity 1.25": base.replace(capacity_factor=1.25, moe_matmul="dense")}
    mesh = wb.abstract_mesh("v5p-64", data=-1)
    batch = tokens_per_chip * math.prod(mesh.shape.values()) // 4096
    out = {}
    for name, cfg in cases.items():
        p = wb.plan(cfg, mesh=mesh, rules="fsdp", batch=batch, seq=4096, progress=False)
        out[name] = {"source": p.source, "temp": p.memory["temp"],
                     "estimate": p.memory_estimate["temp"],
                     # the compiler's own count: all three scan the same layers, whose
                     # body it counts once (compiled_flops_per_device is None for loops),
                     # so the counts compare with each other, not with model FLOPs
                     "flops": p.cost.get("flops"), "batch": batch,
                     "model_flops": p.model_flops}
    return out


def _mixtral_rows() -> list[dict[str, Any]]:
    plans = mixtral_plans()
    gib = lambda b: f"{b / 2**30:.1f} GiB"
    cap = plans["capacity 1.25"]
    rows = []
    for name in ("dense", "grouped", "capacity 1.25"):
        r = plans[name]
        flops = ""
        if r["flops"] and cap["flops"]:
            flops = (f"; compiled FLOPs per chip {r['flops'] / 1e12:.1f} T "
                     f"({r['flops'] / cap['flops']:.2f}x capacity 1.25's)")
        rows.append({
            "name": f"moe: mixtral-8x7b plan temp per chip, {name}"
                    + (" (dropless)" if name != "capacity 1.25" else "")
                    + ", v5p-64 fsdp, 16384 tokens/chip",
            "value": r["temp"] / 2**30, "unit": "GiB",
            "target": "<= capacity 1.25's" if name == "grouped" else "",
            "ok": r["temp"] <= cap["temp"] if name == "grouped" else None,
            "notes": f"{r['source']}: {gib(r['temp'])} temp (formula {gib(r['estimate'])}); "
                     f"capacity 1.25: {gib(cap['temp'])}{flops}; batch {r['batch']} x 4096, "
                     f"remat full, splash attention"})
    return rows


def run() -> list[dict[str, Any]]:
    """The grouped-MoE plan rows."""
    return _mixtral_rows()


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
