"""Layouts: pure geometry of (shape, dtype, sharding) -> per-device blocks, replicas, bytes."""
from __future__ import annotations

import difflib
import functools
import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from workbench._display import Displayable
from workbench._validate import check_int
from workbench._sharding.mesh import MeshInfo, mesh_info

__all__ = ["Layout", "layout", "normalize_spec", "format_bytes"]

Spec = tuple[tuple[str, ...], ...]


def format_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def normalize_spec(spec: Any, rank: int, mesh: MeshInfo, name: str = "tensor") -> Spec:
    """Validate a PartitionSpec against a tensor rank and a mesh; one tuple of axes per dim.

    Raises:
      TypeError: the spec is a bare string (``"data"``: write ``P("data")``) or holds
        something that is not an axis name.
      ValueError: naming the tensor, the axis and the fix for a spec longer than the
        rank, an unknown mesh axis, or a mesh axis used twice.
    """
    if isinstance(spec, str):
        raise TypeError(
            f"spec={spec!r} for {name!r} is a bare string, which would be read one character "
            f"per dim (P{tuple(spec)!r}); a spec has one entry per tensor dim: write "
            f"P({spec!r}) or ({spec!r},) to split dim 0 over {spec!r}")
    if spec is not None and not isinstance(spec, (PartitionSpec, tuple, list)):
        raise TypeError(f"spec={spec!r} for {name!r} must be a PartitionSpec or a tuple with one "
                        "entry per tensor dim (None, a mesh axis name, or a tuple of them)")
    entries = tuple(spec) if spec is not None else ()
    if len(entries) > rank:
        raise ValueError(
            f"spec {PartitionSpec(*entries)} has {len(entries)} entries but {name!r} has rank "
            f"{rank}; a PartitionSpec matches tensor dims, not mesh dims: give at most {rank} "
            "entries (None for a dim that is not split)")
    out: list[tuple[str, ...]] = []
    used: dict[str, int] = {}
    for dim, entry in enumerate(entries + (None,) * (rank - len(entries))):
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            out.append(())
            continue
        if not isinstance(entry, (str, tuple, list)):
            raise TypeError(
                f"entry {entry!r} (dim {dim}) in the spec of {name!r} must be None, a mesh "
                f"axis name or a tuple of them; the mesh axes are {mesh.axis_names}")
        axes = (entry,) if isinstance(entry, str) else tuple(entry)
        for ax in axes:
            if ax not in mesh.axis_names:
                close = difflib.get_close_matches(str(ax), mesh.axis_names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"unknown mesh axis {ax!r} in the spec of {name!r} (dim {dim}); the mesh "
                    f"axes are {mesh.axis_names}{hint}")
            if ax in used:
                raise ValueError(
                    f"mesh axis {ax!r} shards both dim {used[ax]} and dim {dim} of {name!r}; a "
                    "mesh axis may split at most one dim of a tensor: use another axis or None")
            used[ax] = dim
        out.append(axes)
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _mesh_coords(axis_sizes: tuple[int, ...]) -> np.ndarray:
    """(n_devices, n_axes) coordinates of each mesh position, row-major."""
    return np.indices(axis_sizes).reshape(len(axis_sizes), -1).T.copy()


@functools.lru_cache(maxsize=4096)
def _block_index(axis_names: tuple[str, ...], axis_sizes: tuple[int, ...],
                 spec: Spec) -> np.ndarray:
    """(n_devices, rank) block each device holds along each dim; independent of the shape.

    Along a dim split over axes (a, b), the block index is ``coord_a * size_b + coord_b``:
    the first axis is major, as in JAX.
    """
    coords = _mesh_coords(axis_sizes)
    pos = {a: i for i, a in enumerate(axis_names)}
    block = np.zeros((coords.shape[0], len(spec)), dtype=np.int64)
    for d, axes in enumerate(spec):
        for ax in axes:
            block[:, d] = block[:, d] * axis_sizes[pos[ax]] + coords[:, pos[ax]]
    block.flags.writeable = False
    return block


class Layout(Displayable):
    """Where each block of one tensor lives on a mesh.

    Build it with ``wb.layout``. Arrays are per device, rows in ``device_ids`` order
    (the mesh's row-major order), so thousands of devices stay fast.

    Attributes:
      name, shape, dtype, spec, mesh: what was laid out (``spec``: one tuple of mesh
        axes per dim).
      device_ids: ``(n,)`` device ids in mesh order.
      starts, stops: ``(n, rank)`` index ranges each device holds (stop clipped).
      block_index: ``(n, rank)`` which block along each dim each device holds.
      shard_shape: the block shape XLA allocates (ceil division; edge blocks padded).
      partitions: number of blocks along each dim.
    """

    def __init__(self, *, shape: Sequence[int], dtype: Any, spec: Spec, mesh: MeshInfo,
                 name: str = "tensor", logical_axes: tuple[str | None, ...] | None = None):
        self.name = name
        self.shape = tuple(int(s) for s in shape)
        self.dtype = jax.numpy.dtype(dtype)
        self.spec = spec
        self.mesh = mesh
        self.logical_axes = logical_axes
        sizes = mesh.shape
        self.partitions = tuple(math.prod(sizes[a] for a in axes) for axes in spec)
        self.shard_shape = tuple(-(-n // k) for n, k in zip(self.shape, self.partitions))
        self.block_index = _block_index(mesh.axis_names, mesh.axis_sizes, spec)
        block = self.block_index
        chunk = np.asarray(self.shard_shape, dtype=np.int64)
        dims = np.asarray(self.shape, dtype=np.int64)
        self.starts = np.minimum(block * chunk, dims)
        self.stops = np.minimum(self.starts + chunk, dims)
        self.device_ids = np.asarray(mesh.device_ids).reshape(-1)

    # -- accessors ------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def n_devices(self) -> int:
        return int(self.device_ids.size)

    @functools.cached_property
    def indices(self) -> dict[int, tuple[tuple[int, int], ...]]:
        """Device id -> one ``(start, stop)`` per dim."""
        starts, stops = self.starts.tolist(), self.stops.tolist()
        return {int(dev): tuple(zip(a, b)) for dev, a, b in
                zip(self.device_ids.tolist(), starts, stops)}

    @functools.cached_property
    def block_bytes(self) -> np.ndarray:
        """``(n,)`` bytes of the data each device holds (edge blocks may be smaller)."""
        return np.prod(self.stops - self.starts, axis=1, dtype=np.int64) * self.dtype.itemsize

    @functools.cached_property
    def bytes_per_device(self) -> dict[int, int]:
        """Device id -> bytes of the data it holds."""
        return dict(zip(self.device_ids.tolist(), self.block_bytes.tolist()))

    @property
    def padded_bytes_per_device(self) -> int:
        """Bytes XLA allocates on each device (edge blocks padded to ``shard_shape``)."""
        return int(math.prod(self.shard_shape)) * self.dtype.itemsize

    @property
    def padding_waste(self) -> int:
        """Bytes allocated but holding no data, summed over devices."""
        return self.padded_bytes_per_device * self.n_devices - int(self.block_bytes.sum())

    @property
    def total_bytes(self) -> int:
        return int(math.prod(self.shape)) * self.dtype.itemsize

    @functools.cached_property
    def replica_group_index(self) -> np.ndarray:
        """``(n,)`` the replica group of each device: the row-major id of its block."""
        if self.rank == 0:
            return np.zeros(self.n_devices, np.int64)
        _, inverse = np.unique(self.block_index, axis=0, return_inverse=True)
        return inverse.reshape(-1)

    @property
    def num_shards(self) -> int:
        """Distinct blocks (``prod(partitions)``)."""
        return int(math.prod(self.partitions))

    @property
    def replication(self) -> int:
        """How many devices hold each block."""
        return self.n_devices // self.num_shards

    @functools.cached_property
    def replica_groups(self) -> list[tuple[int, ...]]:
        """Tuples of device ids holding identical copies, one per distinct block."""
        inverse = self.replica_group_index
        order = np.argsort(inverse, kind="stable")
        ids = self.device_ids[order].tolist()
        r = self.replication
        return [tuple(ids[i:i + r]) for i in range(0, len(ids), r)]

    @property
    def partition_spec(self) -> PartitionSpec:
        return PartitionSpec(*(a[0] if len(a) == 1 else (a or None) for a in self.spec))

    @property
    def sharding(self) -> NamedSharding:
        """The ``NamedSharding`` (only for a real mesh)."""
        if self.mesh.jax_mesh is None:
            raise ValueError(f"{self.name!r} is laid out on an abstract mesh; it has no devices")
        return NamedSharding(self.mesh.jax_mesh, self.partition_spec)

    @property
    def uneven_dims(self) -> tuple[int, ...]:
        return tuple(d for d, (n, k) in enumerate(zip(self.shape, self.partitions)) if n % k)

    # -- text -------------------------------------------------------------------------

    def summary(self) -> str:
        dt = self.dtype.name
        head = (f"{self.name}: {dt}{list(self.shape)} {self.partition_spec} on "
                f"{self.mesh.describe()}")
        per = format_bytes(self.padded_bytes_per_device)
        line = (f"block {self.shard_shape} = {per} per device; {self.num_shards} distinct "
                f"block(s), replication x{self.replication}; total {format_bytes(self.total_bytes)}")
        lines = [head, line]
        if self.uneven_dims:
            lines.append(f"uneven dims {self.uneven_dims}: XLA pads edge blocks, wasting "
                         f"{format_bytes(self.padding_waste)} over all devices")
        return "\n".join(lines)

    def __str__(self) -> str:
        lines = [self.summary()]
        groups = self.replica_groups
        shown = groups[:16]
        for g in shown:
            i = int(np.nonzero(self.device_ids == g[0])[0][0])
            rng = ", ".join(f"{a}:{b}" for a, b in zip(self.starts[i], self.stops[i]))
            devs = ",".join(map(str, g)) if len(g) <= 8 else f"{g[0]},...,{g[-1]} ({len(g)})"
            lines.append(f"  [{rng}]".ljust(6 + 10 * self.rank)
                         + f"{format_bytes(int(self.block_bytes[i])):>10}  devices {devs}")
        if len(groups) > len(shown):
            lines.append(f"  ... {len(groups) - len(shown)} more blocks")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Layout {self.summary().splitlines()[0]}>"


def _from_sharding(shape: tuple[int, ...], dtype: Any, sharding: Any, name: str) -> Layout:
    if isinstance(sharding, NamedSharding):
        info = mesh_info(sharding.mesh)
        spec = normalize_spec(sharding.spec, len(shape), info, name)
        return Layout(shape=shape, dtype=dtype, spec=spec, mesh=info, name=name)
    # Any other sharding (single device, GSPMD): a one-axis "devices" mesh, ranges from JAX.
    index_map = sharding.devices_indices_map(shape)
    devs = list(index_map)
    mesh = jax.sharding.Mesh(np.array(devs), ("devices",))
    info = mesh_info(mesh)
    lay = Layout(shape=shape, dtype=dtype, spec=((),) * len(shape), mesh=info, name=name)
    starts = [[s.start or 0 for s in index_map[d]] for d in devs]
    stops = [[n if s.stop is None else s.stop for s, n in zip(index_map[d], shape)] for d in devs]
    lay.starts = np.asarray(starts, np.int64).reshape(len(devs), len(shape))
    lay.stops = np.asarray(stops, np.int64).reshape(len(devs), len(shape))
    lay.block_index = lay.starts.copy()
    lay.shard_shape = tuple(int(x) for x in (lay.stops - lay.starts).max(axis=0)) if shape else ()
    lay.partitions = tuple(len(np.unique(lay.starts[:, d])) for d in range(len(shape)))
    return lay


def layout(
    x: Any,
    spec: Any = None,
    mesh: Any = None,
    *,
    dtype: Any = "float32",
    name: str | None = None,
    logical_axes: tuple[str | None, ...] | None = None,
) -> Layout:
    """How a tensor is split across a mesh: per-device index ranges, bytes and replicas.

    Args:
      x: a shape tuple of ints >= 0 (``64.7`` or ``"64"`` is an error, never rounded),
        or a ``jax.Array`` / ``jax.ShapeDtypeStruct`` carrying a sharding (then
        ``spec`` and ``mesh`` are taken from it).
      spec: a ``PartitionSpec`` or tuple: one entry per tensor dim (None, an axis
        name, or a tuple of axis names, major first). Not a bare string: ``"data"``
        would mean one dim per letter; write ``P("data")`` or ``("data",)``.
      mesh: a ``jax.sharding.Mesh``, ``AbstractMesh``, or ``wb.abstract_mesh(...)``.
      dtype: element type, for bytes.
      name: the tensor's name, used in messages.

    Example::

        lay = wb.layout((64, 2048, 12288), ("data", None, "model"), mesh, dtype="bfloat16")
        lay.indices[0]            # ((0, 16), (0, 2048), (0, 6144))
    """
    if not isinstance(x, (tuple, list)):
        if not hasattr(x, "shape"):
            raise TypeError(f"wb.layout: x={x!r} is a {type(x).__name__}; x must be a shape "
                            "tuple such as (64, 2048), or an array / jax.ShapeDtypeStruct")
        shape = tuple(getattr(x, "shape", ()))
        sharding = getattr(x, "sharding", None)
        arr_dtype = getattr(x, "dtype", dtype)
        nm = name or "array"
        if spec is None and mesh is None:
            if sharding is None:
                raise ValueError(f"{nm!r} has no sharding; pass spec= and mesh=, or device_put "
                                 "it with a NamedSharding first")
            return _from_sharding(shape, arr_dtype, sharding, nm)
        x, dtype = shape, arr_dtype
    nm = name or "tensor"
    try:
        jax.numpy.dtype(dtype)
    except (TypeError, ValueError) as e:
        raise TypeError(f"wb.layout: dtype={dtype!r} is not a data type ({e}); use e.g. "
                        "'float32' or 'bfloat16'") from None
    shape = tuple(check_int(s, f"shape[{i}]", minimum=0, where=f"wb.layout of {nm!r}: ")
                  for i, s in enumerate(x))
    if mesh is None:
        raise ValueError(f"wb.layout({shape}, {spec}) needs a mesh: pass mesh=wb.make_mesh(...)")
    info = mesh_info(mesh)
    norm = normalize_spec(spec, len(shape), info, nm)
    return Layout(shape=shape, dtype=dtype, spec=norm, mesh=info, name=nm,
                  logical_axes=logical_axes)
