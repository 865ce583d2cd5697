"""What a checkpoint records at save and checks at restore: per-array checksums, PRNG keys."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

#: The checksum recorded at save (see :func:`leaf_checksums`).
CHECKSUM_ALGORITHM = "wb-bitsum32x2-v1"


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def keys_to_data(tree: Any) -> tuple[Any, list[str]]:
    """Typed PRNG keys -> their ``uint32`` key data; also the implementations, in order."""
    impls: list[str] = []

    def convert(x: Any) -> Any:
        if _is_key(x):
            impls.append(str(jax.random.key_impl(x)))
            return jax.random.key_data(x)
        return x

    return jax.tree.map(convert, tree), impls


def abstract_key_data(x: Any) -> Any:
    """ShapeDtypeStruct of a key array -> that of its key data (sharding extended)."""
    if not _is_key(x):
        return x
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        extra = (None,) * (len(data.shape) - len(x.shape))
        spec = jax.sharding.PartitionSpec(*sharding.spec, *extra)
        sharding = jax.sharding.NamedSharding(sharding.mesh, spec)
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)


def data_to_keys(tree: Any, target: Any, impls: list[str]) -> Any:
    """Inverse of :func:`keys_to_data`: wraps key data where ``target`` has key leaves."""
    it = iter(impls)

    def convert(x: Any, t: Any) -> Any:
        return jax.random.wrap_key_data(x, impl=next(it)) if _is_key(t) else x

    return jax.tree.map(convert, tree, target)


# ----------------------------------------------------------------------------- checksums
def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_name(path: Sequence[Any]) -> str:
    """A leaf's path as Orbax names it: keys, attributes and indices joined by dots."""
    return ".".join(_key_name(k) for k in path)


def _summable(dtype: Any) -> bool:
    """Whether :func:`leaf_checksums` covers arrays of ``dtype`` (not sub-byte types)."""
    dt = jnp.dtype(dtype)
    if dt == jnp.bool_ or dt == jnp.complex64:
        return True
    try:
        bits = (jnp.iinfo(dt) if jnp.issubdtype(dt, jnp.integer) else jnp.finfo(dt)).bits
    except (TypeError, ValueError):
        return False
    return dt.itemsize in (1, 2, 4, 8) and bits == dt.itemsize * 8


def _bits(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as uint32 (narrower types widened, 64-bit ones split in two)."""
    dt = jnp.dtype(x.dtype)
    if dt == jnp.bool_:
        return x.astype(jnp.uint32)
    if jnp.issubdtype(dt, jnp.complexfloating):
        return jnp.stack([_bits(jnp.real(x)), _bits(jnp.imag(x))], axis=-1)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[dt.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _weighted_sums(x: jax.Array) -> jax.Array:
    """Two position-weighted sums (mod 2**32) of an array's bits, shape (2,) uint32.

    The weights are odd functions of the element's flat position, so a change of any one
    element always changes both sums; they are defined on global positions, so the sums
    do not depend on how the array is sharded, and integer sums are exact in any order.
    """
    b = _bits(x)
    idx = jnp.zeros(b.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(b.ndim)):
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, b.shape, d) * np.uint32(stride % 2**32)
        stride *= b.shape[d]
    w1 = (idx * np.uint32(0x9E3779B1)) << np.uint32(1) | np.uint32(1)
    w2 = ((idx + np.uint32(0x632BE5AB)) * np.uint32(0x85EBCA6B)) | np.uint32(1)
    mixed = b ^ (b >> np.uint32(16))
    # one variadic reduce: both sums in one fused pass over the array (two jnp.sum calls
    # made XLA:CPU materialise the shared bits and weights between them, ~150x slower on
    # a 256 MiB state); the same numbers, integer sums mod 2**32 in any order
    zero = jnp.zeros((), jnp.uint32)
    s1, s2 = jax.lax.reduce((b * w1, mixed * w2), (zero, zero),
                            lambda acc, x: (acc[0] + x[0], acc[1] + x[1]), tuple(range(b.ndim)))
    return jnp.stack([s1, s2])


def _checksum_arrays(arrays: list[jax.Array]) -> jax.Array:
    return jnp.stack([_weighted_sums(a) for a in arrays]) if arrays else \
        jnp.zeros((0, 2), jnp.uint32)


_CHECKSUM_FNS: dict[Any, Any] = {}


def _checksum_fn(devices: tuple[Any, ...] | None) -> Any:
    """The jitted checksum for arrays on ``devices``: its result replicated on all of them,
    so every process can read it (None: JAX's default placement)."""
    key = None if devices is None else tuple(d.id for d in devices)
    fn = _CHECKSUM_FNS.get(key)
    if fn is None:
        out = None if devices is None else jax.sharding.NamedSharding(
            jax.sharding.Mesh(np.array(devices), ("all",)), jax.sharding.PartitionSpec())
        fn = _CHECKSUM_FNS[key] = jax.jit(_checksum_arrays, out_shardings=out)
    return fn


def leaf_checksums(tree: Any) -> dict[str, list[int]]:
    """Two 32-bit checksums of every array leaf of ``tree``, by leaf name.

    Computed on the devices where the arrays live (one jitted pass over the state; a
    multi-process state is summed across processes, and every process gets the same
    numbers). Not cryptographic: it detects damage (any changed element, bytes flipped
    inside a file), not deliberate tampering. Leaves that are not arrays are skipped.

    Example::

        leaf_checksums({"w": jnp.ones((2, 2))})   # {"w": [s1, s2]}
    """
    named = [(leaf_name(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
             if isinstance(x, (jax.Array, np.ndarray)) and _summable(x.dtype)]
    groups: dict[Any, list[tuple[str, Any]]] = {}
    for name, x in named:  # one jitted call per set of devices (jit takes no mixed sets)
        where = getattr(x, "sharding", None)
        committed = isinstance(x, jax.Array) and where is not None and x.committed
        key = tuple(sorted(where.device_set, key=lambda d: d.id)) if committed else None
        groups.setdefault(key, []).append((name, x))
    out: dict[str, list[int]] = {}
    for devices, group in groups.items():
        sums = np.asarray(jax.device_get(_checksum_fn(devices)([x for _, x in group])))
        out.update({name: [int(a), int(b)] for (name, _), (a, b) in zip(group, sums, strict=True)})
    return out
