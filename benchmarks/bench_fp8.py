"""Which library runs fp8 matmuls on TPU: one Llama-3.1-70B MLP projection (8192 tokens x
8192 -> 28672, bfloat16 operands) forward and backward, compiled by the TPU compiler for one
tpu7x device through each candidate, and the matmuls' operand types in the optimized HLO
(``workbench._compiled.graph.dot_dtypes``) beside the compiler's own cycle estimates of the
program (``loops.compiler_cycles``, at the catalogue's clock).

Candidates: plain bfloat16 (the reference); qwix's quantized-training dot_general as
``GPTConfig(quantization="fp8")`` calls it (MaxText's ``fp8_full``: e4m3 operands, e5m2
gradients, current absmax scales per channel), the same per tensor, and with the Ironwood
recipe's fixed forward range (``fixed,-224,224``: no absmax pass); Flax's fp8 ops (linen
``fp8_ops.in_qdq``/``out_qdq``: delayed scaling, its scales and amax histories as state;
Flax NNX has no fp8 module); JAX's ``jax.nn.scaled_dot_general`` (``mxfp8`` block scales).

Nothing is timed on this machine (compile only, seconds each); ``python -m benchmarks
bench_fp8``. The reasoning is in docs/performance.md ("fp8 matmuls").
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import workbench as wb
from workbench._compiled.graph import dot_dtypes
from workbench._compiled.loops import compiler_cycles
from workbench._sharding.topology import tpu_compiler_available, tpu_mesh
from workbench.hardware import hardware_spec
from workbench.models import _fp8

T, D, F = 8192, 8192, 28672
DIMS = (((1,), (0,)), ((), ()))


def _qwix(config: Any) -> Any:
    from qwix._src.core import dot_general_qt

    return lambda x, w: dot_general_qt.dot_general_qt(x, w, DIMS, config)


def _flax(x: jax.Array, w: jax.Array, state: tuple[jax.Array, ...]) -> jax.Array:
    from flax.linen import fp8_ops

    xs, ws, gs, xh, wh, gh = state
    xq = fp8_ops.in_qdq(jnp.bfloat16, jnp.float8_e4m3fn, x, xs, xh)
    wq = fp8_ops.in_qdq(jnp.bfloat16, jnp.float8_e4m3fn, w, ws, wh)
    y = jax.lax.dot_general(xq, wq, DIMS, preferred_element_type=jnp.bfloat16)
    return fp8_ops.out_qdq(jnp.bfloat16, jnp.float8_e5m2, y, gs, gh)


def _mxfp8(x: jax.Array, w: jax.Array) -> jax.Array:
    configs = [jax.nn.get_scaled_dot_general_config("mxfp8")] * 3
    return jax.nn.scaled_dot_general(x, w, DIMS, preferred_element_type=jnp.bfloat16,
                                     configs=configs)


def candidates() -> dict[str, Any]:
    """name -> f(x, w[, state]) of the one projection."""
    _, fp8_full = _fp8._qt()
    per_tensor = dataclasses.replace(
        fp8_full, lhs_disable_channelwise_axes=True, rhs_disable_channelwise_axes=True,
        dlhs_grad_disable_channelwise_axes=True, drhs_grad_disable_channelwise_axes=True)
    fixed = dataclasses.replace(fp8_full, lhs_calibration_method="fixed,-224,224",
                                rhs_calibration_method="fixed,-224,224")
    return {"bf16 (reference)": lambda x, w: jax.lax.dot_general(x, w, DIMS),
            "qwix fp8_full (GPTConfig quantization='fp8')": _qwix(fp8_full),
            "qwix fp8_full per tensor": _qwix(per_tensor),
            "qwix fp8_full, forward range fixed at 224 (Ironwood recipe)": _qwix(fixed),
            "flax linen fp8_ops (delayed scaling)": _flax,
            "jax.nn.scaled_dot_general mxfp8": _mxfp8}


def measure(name: str, fn: Any, mesh: Mesh, clock_hz: float) -> dict[str, Any]:
    """Compile ``fn``'s forward and backward (a cotangent of the output's shape) for the
    device of ``mesh``; its matmuls by operand type and the compiler's cycles."""
    rep = NamedSharding(mesh, PartitionSpec())
    spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=rep)  # noqa: E731
    args = [spec((T, D)), spec((D, F)), spec((T, F))]
    extra = (tuple(spec(s, jnp.float32) for s in [(1,)] * 3 + [(1024,)] * 3),) \
        if fn is _flax else ()

    def step(x, w, ct, *state):
        y, back = jax.vjp(lambda a, b: fn(a, b, *state), x, w)
        return y, back(ct)

    t0 = time.perf_counter()
    try:
        text = jax.jit(step).lower(*args, *extra).compile().as_text()
    except Exception as err:  # noqa: BLE001 - a library without a TPU lowering is a result
        return {"name": name, "error": str(err).splitlines()[0][:160]}
    cycles, _ = compiler_cycles(text)
    return {"name": name, "dots": dot_dtypes(text), "ms": cycles / clock_hz * 1e3,
            "compile_s": time.perf_counter() - t0}


def run() -> list[dict[str, Any]]:
    if not tpu_compiler_available():
        return [{"name": "fp8 libraries on tpu7x", "value": None, "unit": "", "target": "",
                 "ok": None, "notes": "the TPU compiler (libtpu) is not installed"}]
    full = tpu_mesh(wb.abstract_mesh("tpu7x-8", data=-1))
    mesh = Mesh(full.devices.flat[:1].reshape(1), ("d",))
    chip = hardware_spec(full.devices.flat[0].device_kind)
    ideal = {"bf16": 6 * T * D * F / chip.peak_flops * 1e3,
             "fp8": 6 * T * D * F / chip.fp8_flops * 1e3}
    results = [measure(n, f, mesh, chip.clock_hz) for n, f in candidates().items()]
    base = results[0]["ms"]
    rows = []
    for r in results:
        if "error" in r:
            rows.append({"name": f"fp8 library: {r['name']}", "value": None, "unit": "ms",
                         "target": "f8 matmuls in the TPU HLO", "ok": False,
                         "notes": f"no TPU program: {r['error']}"})
            continue
        f8 = sum(n for k, n in r["dots"].items() if k[0].startswith("f8") and k[1].startswith("f8"))
        kinds = ", ".join(f"{n} {a} x {b}" for (a, b), n in sorted(r["dots"].items()))
        rows.append({
            "name": f"fp8 library: {r['name']}", "value": round(r["ms"], 3), "unit": "ms",
            "target": "f8 matmuls in the TPU HLO" if r is not results[0] else "",
            "ok": (f8 == 3) if r is not results[0] else None,
            "notes": f"tpu7x, one device, 70B MLP up-projection {T}x{D}x{F} forward + backward "
                     f"(3 matmuls): {kinds}; the TPU compiler's cycle estimates "
                     f"{r['ms']:.3f} ms ({base / r['ms']:.2f}x the bf16 program); at peak "
                     f"{ideal['bf16']:.3f} ms bf16, {ideal['fp8']:.3f} ms fp8; compiled in "
                     f"{r['compile_s']:.0f} s"})
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
