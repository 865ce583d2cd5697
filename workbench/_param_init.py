"""A model's initial parameters in one random expansion, each device drawing its own shards.

Built eagerly, a model draws every parameter with a ``jax.random.normal`` of its own, and a
jitted init holds one threefry expansion per parameter: most of a small model's start-up
was XLA compiling them (a ``tiny`` GPT: ~3 CPU s, more than its train step). The sharded
init (``workbench._step.sharded_init``) builds the model under :func:`deferred` instead:
``param()`` keeps each float32 :class:`~workbench.models._layers.Normal` parameter's PRNG
key as its value (stacked like the parameter under ``nnx.vmap``), and :func:`draw` makes
all of them in one expansion inside ``jax.shard_map``: each device computes the threefry
counters of its own shard of every parameter, hashes them in one call and turns the bits
into normals, so no device holds more than its shards. Several parameters whose shards
hold more than :data:`CHUNK` elements are drawn in several expansions (their temporaries
are a few times a chunk's size).

The values are bitwise ``stddev * jax.random.normal(key, shape)``, as the model built
eagerly draws them: JAX's threefry on its partitionable counters (each element's row-major
index, the same on every mesh) and JAX's bits-to-normal map, so a seed's initial weights
do not depend on the mesh, the rules, or on being drawn here. A parameter this cannot draw
(a sharding that does not divide it, over 2**32 elements per key, another mesh) is drawn
by ``jax.random.normal`` under the enclosing ``jit`` as before.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.extend.random import threefry2x32_p
from jax.sharding import NamedSharding, PartitionSpec

from workbench._sharding import tracing
from workbench._sharding.pytrees import path_str

__all__ = ["CHUNK", "deferred", "draw", "threefry_counts"]

#: Elements per device of one random expansion (parameters are packed up to it; a larger
#: one is drawn alone).
CHUNK = 2**24
#: One uint32 counter word: a draw's elements per key must stay below it.
COUNTER_WORD = 2**32


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Inside: ``param()`` keeps the keys of the parameters :func:`draw` can draw."""
    with tracing.scoped(defer_draws=True):
        yield


@dataclasses.dataclass(frozen=True)
class _Draw:
    """One deferred parameter: ``keys`` (batch dims + (2,) uint32), its Normal recipe and
    per-key ``shape``, and the sharding of the whole parameter (batch dims + shape)."""

    index: int
    keys: jax.Array
    init: Any
    shape: tuple[int, ...]
    sharding: Any

    @property
    def batch(self) -> int:
        return self.keys.ndim - 1

    @property
    def full_shape(self) -> tuple[int, ...]:
        return (*self.keys.shape[:-1], *self.shape)

    @property
    def spec(self) -> tuple[Any, ...]:
        spec = tuple(self.sharding.spec)
        return spec + (None,) * (len(self.full_shape) - len(spec))

    @property
    def local(self) -> tuple[int, ...]:
        return tuple(self.sharding.shard_shape(self.full_shape))


def draw(param_state: nnx.State, shardings: Any) -> dict[str, Any]:
    """``nnx.to_pure_dict(param_state)`` with every parameter built under :func:`deferred`
    drawn from its key; call it inside ``jax.jit`` with ``shardings`` (the params' tree of
    ``NamedSharding``) as the out_shardings."""
    params = nnx.to_pure_dict(param_state)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    variables = {path_str(p): v for p, v in nnx.to_flat_state(param_state)}
    values = [x for _, x in flat]
    draws = []
    for i, ((path, x), sh) in enumerate(zip(flat, treedef.flatten_up_to(shardings),
                                            strict=True)):
        recipe = variables[path_str(path)].get_metadata().get("draw")
        if recipe is not None:
            draws.append(_Draw(i, x, recipe[0], tuple(recipe[1]), sh))
    mesh = next((d.sharding.mesh for d in draws if isinstance(d.sharding, NamedSharding)),
                None)
    batched = [d for d in draws if _expandable(d, mesh)]
    for d in draws:
        if not _expandable(d, mesh):
            values[d.index] = jax_draw(d.keys, d.init, d.shape)
    if batched:
        for d, value in zip(batched, _expansion(batched, mesh), strict=True):
            values[d.index] = value
    return jax.tree.unflatten(treedef, values)


def jax_draw(keys: jax.Array, init: Any, shape: Sequence[int]) -> jax.Array:
    """``init(key, shape)`` for each key of ``keys`` (batch dims + (2,) uint32 key data),
    stacked: what the model built eagerly holds, and the fallback of :func:`draw`."""
    def one(k: jax.Array) -> jax.Array:
        return init(jax.random.wrap_key_data(k), tuple(shape), jnp.float32)
    for _ in range(keys.ndim - 1):
        one = jax.vmap(one)
    return one(keys)


def _expandable(d: _Draw, mesh: Any) -> bool:
    """Whether ``d`` can be drawn in the shard_map expansion on ``mesh``."""
    if not isinstance(d.sharding, NamedSharding) or d.sharding.mesh != mesh \
            or not isinstance(mesh, jax.sharding.Mesh):
        return False
    if math.prod(d.shape) >= COUNTER_WORD or math.prod(d.full_shape) == 0:
        return False
    for dim, entry in zip(d.full_shape, d.spec, strict=True):
        names = (entry,) if isinstance(entry, str) else entry
        if names is None:
            continue
        if not isinstance(names, tuple) or dim % math.prod(mesh.shape[n] for n in names):
            return False
    return True


def _expansion(draws: list[_Draw], mesh: jax.sharding.Mesh) -> list[jax.Array]:
    """The parameters of ``draws``, each device drawing its shards, in as few threefry
    expansions as :data:`CHUNK` allows."""
    def body(*keys: jax.Array) -> tuple[jax.Array, ...]:
        out: list[jax.Array] = [None] * len(draws)   # type: ignore[list-item]
        for chunk in _chunks([math.prod(d.local) for d in draws]):
            normals = _normals([(draws[j], keys[j]) for j in chunk])
            offset = 0
            for j in chunk:
                d, n = draws[j], math.prod(draws[j].local)
                z = normals[offset:offset + n].reshape(d.local)
                out[j] = z * np.float32(d.init.stddev)
                offset += n
        return tuple(out)

    key_specs = tuple(PartitionSpec(*d.spec[:d.batch], None) for d in draws)
    specs = tuple(PartitionSpec(*d.spec) for d in draws)
    run = jax.shard_map(body, mesh=mesh, in_specs=key_specs, out_specs=specs,
                        check_vma=False)
    return list(run(*(d.keys for d in draws)))


def _chunks(sizes: list[int]) -> list[list[int]]:
    """Consecutive indices of ``sizes`` packed into groups of at most :data:`CHUNK`
    elements (an item larger than that alone)."""
    groups: list[list[int]] = []
    total = CHUNK
    for i, n in enumerate(sizes):
        if total + n > CHUNK:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups


def _normals(part: list[tuple[_Draw, jax.Array]]) -> jax.Array:
    """Standard normals (float32, flat) of this device's shards of the draws in ``part``,
    one after the other: one threefry call on their concatenated keys and counters."""
    k1, k2, counts = [], [], []
    for d, keys in part:                      # keys: this device's, (local batch..., 2)
        local = d.local
        per = keys.reshape(*keys.shape[:-1], *([1] * len(d.shape)), 2)
        per = jnp.broadcast_to(per, (*local, 2))
        k1.append(per[..., 0].reshape(-1))
        k2.append(per[..., 1].reshape(-1))
        starts = [_start(entry, n) for entry, n in zip(d.spec[d.batch:], local[d.batch:],
                                                       strict=True)]
        c = threefry_counts(d.shape, local[d.batch:], starts)
        counts.append(jnp.broadcast_to(c, local).reshape(-1))
    lo = jnp.concatenate(counts)
    bits1, bits2 = threefry2x32_p.bind(jnp.concatenate(k1), jnp.concatenate(k2),
                                       jnp.zeros_like(lo), lo)
    return _standard_normal(bits1 ^ bits2)


def _start(entry: Any, local: int) -> jax.Array | int:
    """The first global index along one dim of this device's shard (inside shard_map)."""
    if entry is None:
        return 0
    return lax.axis_index(entry).astype(jnp.uint32) * np.uint32(local)


def threefry_counts(shape: Sequence[int], local: Sequence[int],
                    starts: Sequence[jax.Array | int]) -> jax.Array:
    """uint32 row-major indices in ``shape`` (fewer than 2**32 elements) of the block of
    size ``local`` starting at ``starts``: the low counter word JAX's partitionable
    threefry hashes for each element of ``jax.random.bits(key, shape)`` (the high word is
    0 below 2**32 elements)."""
    index = jnp.zeros(tuple(local), jnp.uint32)
    stride = 1
    for dim in reversed(range(len(shape))):
        along = lax.broadcasted_iota(jnp.uint32, tuple(local), dim) + jnp.uint32(starts[dim])
        index = index + along * np.uint32(stride)
        stride *= shape[dim]
    return index


def _standard_normal(bits: jax.Array) -> jax.Array:
    """float32 normals from uint32 bits, as ``jax.random.normal`` makes them: 23 random
    mantissa bits give a uniform in [nextafter(-1, 0), 1), and ``sqrt(2) * erfinv`` maps it
    (``jax._src.random.core._uniform`` and ``_normal_real``)."""
    one = np.array(1.0, np.float32).view(np.uint32)
    floats = lax.bitcast_convert_type(lax.shift_right_logical(bits, np.uint32(32 - 23)) | one,
                                      jnp.float32) - np.float32(1.0)
    lo, hi = np.nextafter(np.float32(-1.0), np.float32(0.0)), np.float32(1.0)
    uniform = lax.max(lo, floats * (hi - lo) + lo)
    return np.float32(np.sqrt(2)) * lax.erf_inv(uniform)
