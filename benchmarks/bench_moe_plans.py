"""Grouped mixture-of-experts on a pod: the TPU compiler's plans of dropless MoE steps with
the experts as megablox's Pallas grouped matmul (``moe_kernel="megablox"``, the default on
TPU), as ``jax.lax.ragged_dot`` (whose weight gradient the TPU compiler expands over every
expert) and as dense buffers (every expert a slot for every token: E/k times the routed
rows), beside the ``capacity_factor=1.25`` plan at the same batch: the compiler's FLOPs and
temporary (activation) memory per chip.

- ``moe-small`` (16 experts, top-2, a shared expert) on v5p-32, fsdp, 8192 tokens per chip.
- Mixtral-8x7B's layer shapes: 2 scanned layers, fsdp on v5p-64, remat "full", splash
  attention, 4096-token sequences, 8192 tokens per chip; and the whole model (32 layers)
  at 16384.
- MaxText's published dropless Mixtral-8x7B on v5p-128 (tpu-recipes
  training/v5p/Mixtral-8X7B-Maxtext/scripts/run_mixtral-8x7b.sh: per_device_batch_size=36,
  max_target_length=4096, weight_dtype=bfloat16, MaxText's default megablox dropless
  experts and full remat; 251.94 TFLOP/s per chip in MaxText's Run_Mixtral.md), with the
  loss in 4 slices: does it fit per chip?

Compiled with libtpu on this CPU (minutes per plan); nothing is timed, so the rows do not
depend on how loaded the machine is. ``python -m benchmarks bench_moe_plans``.
"""
from __future__ import annotations

import contextlib
import json
import math
from typing import Any

#: The cases of one comparison: GPTConfig changes on top of the base config.
CASES: dict[str, dict[str, Any]] = {
    "grouped megablox": {"capacity_factor": None, "moe_matmul": "grouped",
                         "moe_kernel": "megablox"},
    "grouped ragged_dot": {"capacity_factor": None, "moe_matmul": "grouped",
                           "moe_kernel": "ragged_dot"},
    "dense dropless": {"capacity_factor": None, "moe_matmul": "dense"},
    "capacity 1.25": {"capacity_factor": 1.25, "moe_matmul": "dense"},
}

#: MaxText's published dropless Mixtral-8x7B step on v5p-128 (module docstring).
PUBLISHED = {"slice": "v5p-128", "per_device_batch": 36, "seq": 4096}


def _plans(base: Any, slice_name: str, tokens_per_chip: int, seq: int,
           cases: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """``base`` under each of ``cases`` (:data:`CASES`), fsdp over ``slice_name``: per case
    the plan's ``source``, ``temp`` bytes per chip (and the formula's ``estimate``),
    ``total`` and ``limit`` bytes, ``fits``, the compiler's ``flops`` per chip and
    ``model_flops``."""
    import workbench as wb

    mesh = wb.abstract_mesh(slice_name, data=-1)
    batch = tokens_per_chip * math.prod(mesh.shape.values()) // seq
    out = {}
    for name in cases:
        p = wb.plan(base.replace(**CASES[name]), mesh=mesh, rules="fsdp", batch=batch,
                    seq=seq, progress=False)
        out[name] = {"source": p.source, "temp": p.memory["temp"],
                     "estimate": p.report.memory_estimate["temp"], "total": p.memory["total"],
                     "limit": p.memory.get("limit"), "fits": p.fits,
                     # the compiler's own count: the plans scan the same layers, whose
                     # body it counts once (compiled_flops_per_device is None for loops),
                     # so the counts compare with each other, not with model FLOPs
                     "flops": p.report.cost.get("flops"), "batch": batch,
                     "model_flops": p.model_flops}
    return out


def mixtral_plans(n_layers: int | None = None, tokens_per_chip: int = 16384,
                  cases: tuple[str, ...] = tuple(CASES)) -> dict[str, dict[str, Any]]:
    """TPU plans of Mixtral-8x7B (fsdp on v5p-64, remat full, splash attention,
    4096-token sequences) under ``cases`` (:func:`_plans`' keys per case).

    Args:
        n_layers: fewer layers than the preset's 32 (a test's shorter compile), or None.
        tokens_per_chip: tokens of one step per chip.
        cases: names in :data:`CASES`.
    """
    from workbench.models import GPTConfig

    base = GPTConfig.preset("mixtral-8x7b", attention="splash", remat="full")
    if n_layers is not None:
        base = base.replace(n_layers=n_layers)
    return _plans(base, "v5p-64", tokens_per_chip, 4096, cases)


def moe_small_plans(tokens_per_chip: int = 8192, cases: tuple[str, ...] = tuple(CASES)
                    ) -> dict[str, dict[str, Any]]:
    """TPU plans of ``moe-small`` (fsdp on v5p-32, its 1024-token sequences) under
    ``cases`` (:func:`_plans`' keys per case)."""
    from workbench.models import GPTConfig

    return _plans(GPTConfig.preset("moe-small"), "v5p-32", tokens_per_chip, 1024, cases)


#: The published step's loss in this many slices of the sequence (``GPTConfig.loss_chunks``,
#: MaxText's ``num_vocab_tiling``; the recipe leaves it at 1): whole, XLA keeps the
#: (B, T, V) logits through the layers' backward pass (docs/performance.md).
PUBLISHED_LOSS_CHUNKS = 4


def published_mixtral_plan() -> dict[str, Any]:
    """MaxText's published dropless Mixtral-8x7B step (:data:`PUBLISHED`) planned with
    megablox experts, bfloat16 weights, remat full, splash attention and the loss in
    :data:`PUBLISHED_LOSS_CHUNKS` slices."""
    from workbench.models import GPTConfig

    base = GPTConfig.preset("mixtral-8x7b", attention="splash", remat="full",
                            param_dtype="bfloat16", loss_chunks=PUBLISHED_LOSS_CHUNKS)
    tokens = PUBLISHED["per_device_batch"] * PUBLISHED["seq"]
    return _plans(base, PUBLISHED["slice"], tokens, PUBLISHED["seq"],
                  ("grouped megablox",))["grouped megablox"]


#: One expert projection of Mixtral-8x7B at 8192 tokens per chip, top-2: routed rows,
#: in and out features, experts.
PROJECTION = {"rows": 16384, "d_in": 4096, "d_out": 14336, "experts": 8}


def _kernels() -> dict[str, Any]:
    """The grouped matmuls to compare: (rows (M, K), weights (E, K, N), sizes) -> (M, N)."""
    import jax
    import jax.numpy as jnp
    from workbench.models import _moe_grouped

    out = {"megablox": lambda x, w, s: _moe_grouped._megablox(x, w, s, interpret=False),
           "ragged_dot": lambda x, w, s: jax.lax.ragged_dot(x, w, s)}
    try:   # needs jax >= 0.11.1
        import tokamax
    except ImportError:
        return out

    out["tokamax mosaic_tpu"] = lambda x, w, s: tokamax.ragged_dot(
        x, w, s, preferred_element_type=jnp.bfloat16, implementation="mosaic_tpu")
    return out


def _cross_compile() -> Any:
    """tokamax's permission to lower its TPU kernels on a host without a TPU (its device
    check), for the whole trace: its backward pass is traced under ``jax.grad``."""
    try:
        import tokamax
    except ImportError:
        return contextlib.nullcontext()
    return tokamax.config.cross_compile(True)


def kernel_plans() -> dict[str, dict[str, Any]]:
    """:data:`PROJECTION` forward and backward (input and weight gradients) under each
    grouped matmul of :func:`_kernels`, compiled by the TPU compiler for one v5p chip:
    per kernel its compiled ``flops``, ``temp`` bytes and the routed FLOPs
    (``3 * 2 * M * K * N``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from workbench._sharding.topology import tpu_devices

    dev = tpu_devices("v5p-8")
    mesh = Mesh(np.array(dev[:1]), ("chip",))
    m, k, n, e = (PROJECTION[x] for x in ("rows", "d_in", "d_out", "experts"))
    one = NamedSharding(mesh, P())
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=one),
            jax.ShapeDtypeStruct((e, k, n), jnp.bfloat16, sharding=one),
            jax.ShapeDtypeStruct((e,), jnp.int32, sharding=one))
    out = {}
    for name, mm in _kernels().items():
        loss = lambda x, w, s, mm=mm: jnp.sum(jnp.sin(mm(x, w, s).astype(jnp.float32)))
        step = jax.shard_map(jax.grad(loss, (0, 1)), mesh=mesh, in_specs=(P(),) * 3,
                             out_specs=(P(), P()), check_vma=False)   # megablox: moe.py
        with _cross_compile():
            c = jax.jit(step).lower(*args).compile()
        out[name] = {"flops": c.cost_analysis()["flops"], "routed": 3 * 2 * m * k * n,
                     "temp": c.memory_analysis().temp_size_in_bytes}
    return out


def _kernel_rows() -> list[dict[str, Any]]:
    import jax
    from importlib.metadata import version

    plans = kernel_plans()
    where = f"jax {jax.__version__}, libtpu {version('libtpu')}"
    rows = []
    for name, r in plans.items():
        rows.append({
            "name": f"moe: one mixtral expert projection fwd+bwd, TPU-compiled FLOPs / "
                    f"routed, {name}",
            "value": round(r["flops"] / r["routed"], 3), "unit": "x", "target": "", "ok": None,
            "notes": f"v5p chip, {where}: {r['flops'] / 1e12:.2f} TFLOP (routed "
                     f"{r['routed'] / 1e12:.2f}), temp {_gib(r['temp'])}; "
                     f"{PROJECTION['rows']} rows x {PROJECTION['d_in']} -> "
                     f"{PROJECTION['d_out']}, {PROJECTION['experts']} experts, bfloat16"})
    return rows


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def _rows(model: str, where: str, plans: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One FLOPs row and one temp row per case, each against capacity 1.25's and dense
    dropless's."""
    cap, dense = plans["capacity 1.25"], plans["dense dropless"]
    rows = []
    for name, r in plans.items():
        grouped = name == "grouped megablox"
        flops = r["flops"] / cap["flops"] if r["flops"] and cap["flops"] else float("nan")
        rows.append({
            "name": f"moe: {model} plan FLOPs per chip / capacity 1.25's, {name}, {where}",
            "value": round(flops, 3), "unit": "x",
            "target": "<= 1" if grouped else "",
            "ok": flops <= 1 if grouped else None,
            "notes": f"{r['source']}: {(r['flops'] or 0) / 1e12:.3f} TFLOP per chip "
                     f"(capacity 1.25: {(cap['flops'] or 0) / 1e12:.3f}, dense dropless: "
                     f"{(dense['flops'] or 0) / 1e12:.3f}); batch {r['batch']}"})
        rows.append({
            "name": f"moe: {model} plan temp per chip, {name}, {where}",
            "value": round(r["temp"] / 2**30, 3), "unit": "GiB",
            "target": "< dense dropless's" if grouped else "",
            "ok": r["temp"] < dense["temp"] if grouped else None,
            "notes": f"{r['source']}: {_gib(r['temp'])} temp (formula {_gib(r['estimate'])}); "
                     f"capacity 1.25: {_gib(cap['temp'])}, dense dropless: "
                     f"{_gib(dense['temp'])}; batch {r['batch']}"})
    return rows


def _published_row() -> dict[str, Any]:
    r = published_mixtral_plan()
    limit = r["limit"] or float("nan")
    return {
        "name": "moe: mixtral-8x7b at MaxText's published dropless batch (v5p-128, 36 x "
                "4096 per chip), megablox, memory per chip / HBM",
        "value": round(r["total"] / limit, 3), "unit": "x", "target": "<= 1",
        "ok": r["fits"],
        "notes": f"{r['source']}: {_gib(r['total'])} of {_gib(limit)} "
                 f"({_gib(r['temp'])} temp); fsdp, remat full, splash attention, bfloat16 "
                 f"weights (weight_dtype=bfloat16), loss_chunks={PUBLISHED_LOSS_CHUNKS}, "
                 f"experts in 6 token slices (moe.expert_chunks); tpu-recipes "
                 f"training/v5p/Mixtral-8X7B-Maxtext; batch {r['batch']}"}


def run() -> list[dict[str, Any]]:
    """The grouped-MoE plan rows."""
    return (_kernel_rows()
            + _rows("moe-small", "v5p-32 fsdp, 8192 tokens/chip", moe_small_plans())
            + _rows("mixtral-8x7b 2 layers", "v5p-64 fsdp, 8192 tokens/chip",
                    mixtral_plans(n_layers=2, tokens_per_chip=8192))
            + _rows("mixtral-8x7b", "v5p-64 fsdp, 16384 tokens/chip", mixtral_plans())
            + [_published_row()])


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
