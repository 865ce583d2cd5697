"""Exercises on context parallelism, checked against the jaxpr of the ring attention that
the model runs (the collective permutes and the per-device shapes JAX traces)."""
from __future__ import annotations

import functools

from workbench.exercises._core import Exercise, Result, close, parse_number
from workbench.exercises._judging import equations, wrong_number

__all__ = ["ring_kv_bytes", "ring_permute_bytes"]

_MIB = 2**20


def ring_permute_bytes(*, batch: int, seq: int, n_heads: int, n_kv_heads: int,
                       head_dim: int, dtype: str, context: int) -> tuple[int, int]:
    """``(bytes, count)`` of the collective permutes one device receives in the forward
    pass of :func:`workbench.models._context.local_attention` (variant "ring"), read from
    its jaxpr traced under ``jax.shard_map`` on an abstract mesh (no devices needed)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh, AxisType
    from jax.sharding import PartitionSpec as P

    from workbench.models._context import local_attention

    mesh = AbstractMesh((context,), ("context",), axis_types=(AxisType.Auto,))
    fn = functools.partial(local_attention, variant="ring", axes="context", size=context,
                           zigzag=False)
    spec = P(None, "context")
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                           check_vma=False)
    dt = jnp.dtype(dtype)
    q = jax.ShapeDtypeStruct((batch, seq, n_heads, head_dim), dt)
    kv = jax.ShapeDtypeStruct((batch, seq, n_kv_heads, head_dim), dt)
    jaxpr = jax.make_jaxpr(mapped)(q, kv, kv)
    received = [v.aval for eqn in equations(jaxpr.jaxpr) if eqn.primitive.name == "ppermute"
                for v in eqn.invars]
    return sum(a.size * a.dtype.itemsize for a in received), len(received)


def ring_kv_bytes() -> Exercise:
    batch, seq, heads, kv_heads, hd, ctx = 1, 131072, 64, 8, 128, 8

    def judge(mib: float) -> Result:
        got, count = ring_permute_bytes(batch=batch, seq=seq, n_heads=heads,
                                        n_kv_heads=kv_heads, head_dim=hd, dtype="bfloat16",
                                        context=ctx)
        want = got / _MIB
        block = want / (ctx - 1)
        if close(mib, want):
            return Result(correct=True, explanation=(
                f"Each device holds T/n = {seq // ctx:,} positions. A K/V block is K and V of "
                f"those positions: 2 x {seq // ctx:,} x {kv_heads} kv heads x {hd} x 2 bytes "
                f"= {block:,.0f} MiB, and the ring passes the other {ctx - 1} devices' blocks "
                f"through every device: {ctx - 1} x {block:,.0f} = {want:,.0f} MiB per layer "
                f"({count} collective permutes in the traced program, K and V separately). "
                f"The device never holds more than two blocks at once; the all-gather "
                f"variant would hold all {ctx} ({ctx * block:,.0f} MiB)."))
        mistakes = [
            (block * ctx, f"that counts {ctx} blocks: a device already has its own"),
            (want / 2, "that is K or V alone; both travel"),
            (block, "that is one block; it arrives from each of the other devices in turn"),
            (want * heads / kv_heads, "that uses the 64 query heads; keys and values have "
                                      "the 8 kv heads (grouped-query attention)"),
            (want * 2, "that is float32; K and V are bfloat16 (2 bytes)"),
        ]
        return wrong_number(mib, f"{mib:,.1f} MiB", mistakes, (
            f"{mib:,.1f} MiB is not it; one K/V block (K and V of one device's positions) is "
            f"{block:,.0f} MiB."))

    return Exercise(
        name="ring_kv_bytes", title="K/V bytes a device receives in ring attention",
        notebook="11",
        prompt=("Llama-3-70B-like attention (64 query heads, 8 kv heads of head_dim 128, "
                "bfloat16) on one 131,072-token sequence split over context=8 devices with "
                "ring attention. How many MiB of keys and values does one device receive per "
                "layer in the forward pass?"),
        placeholder="e.g. 123 MiB",
        hint=("A device holds T/8 positions; the ring brings it every other device's block "
              "of K and V, one per step."),
        solution="448 MiB", parse=parse_number("MiB"), judge=judge)
