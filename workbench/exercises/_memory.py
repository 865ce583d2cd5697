"""Exercises on memory per device, checked with optax's real state shapes and JAX's shardings."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from workbench.exercises._core import Exercise, Result, close, parse_number

__all__ = ["adam_state_bytes"]

_MIB = 2**20


def _adam_mib(shape: tuple[int, int], spec: PartitionSpec, axes: dict[str, int]
              ) -> tuple[float, float]:
    """(MiB of Adam state per device, MiB of one moment unsharded) from optax itself."""
    mesh = AbstractMesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,))
    param = jax.ShapeDtypeStruct(shape, jnp.float32)
    state = jax.eval_shape(optax.adam(1e-4).init, param)
    per_device = 0
    for leaf in jax.tree.leaves(state):
        leaf_spec = spec if leaf.shape == shape else PartitionSpec()  # moments follow w
        block = NamedSharding(mesh, leaf_spec).shard_shape(leaf.shape)
        n = 1
        for s in block:
            n *= s
        per_device += n * leaf.dtype.itemsize
    return per_device / _MIB, shape[0] * shape[1] * 4 / _MIB


def adam_state_bytes() -> Exercise:
    shape, spec, axes = (12288, 49152), PartitionSpec(None, "model"), {"model": 8}

    def judge(mib: float) -> Result:
        want, moment = _adam_mib(shape, spec, axes)
        if close(mib, want):
            return Result(correct=True, explanation=(
                f"optax.adam keeps two float32 moments (mu, nu) shaped like w, plus a step "
                f"counter; sharded like w over model=8 that is {want:,.1f} MiB per device "
                f"(2 x 12288 x 6144 x 4 bytes). On top come the weight itself and its gradient "
                f"({want / 2:,.0f} MiB each in float32)."))
        mistakes = [
            (want / 2, "that is one moment; Adam keeps two (mu and nu), each the size of w"),
            (want * 8, "that is the unsharded size; each device holds 1/8 of each moment"),
            (want * 4, ("that is the unsharded size of one moment; Adam keeps two, each split "
                        "8 ways")),
            (want * _MIB / 1e6, "that is in MB (10^6 bytes); the question asks for MiB (2^20)"),
            (want * 2, "that counts more than the two moments (the weight or the gradient?)"),
            (want * 1.5, ("that adds the weight itself; the question asks for the optimizer "
                          "state only")),
        ]
        for value, why in mistakes:
            if close(mib, value):
                return Result(correct=False, explanation=f"{mib:,.1f} MiB: {why}.")
        return Result(correct=False, explanation=(
            f"{mib:,.1f} MiB is not it; one moment of the whole weight is {moment:,.0f} MiB "
            "in float32. Count the moments, then divide by the 8 devices."))

    return Exercise(
        name="adam_state_bytes", title="Adam state per device", notebook="04",
        prompt=("GPT-3's MLP up-projection is a (12288, 49152) float32 weight w, sharded "
                "P(None, 'model') over model=8 (8-way tensor parallelism). How many MiB of "
                "optax.adam state does each device hold for w?"),
        placeholder="e.g. 123 MiB",
        hint="Adam keeps two moments (mu, nu) in the parameter's dtype, each shaped and "
             "sharded like the parameter.",
        solution="576 MiB", parse=parse_number("MiB"), judge=judge)
