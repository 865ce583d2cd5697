"""Meshes: named device meshes, hardware you do not have, and one description of both.

One idea, one file: a real mesh (``make_mesh``), hardware you do not have
(``abstract_mesh``), and ``MeshInfo``, the one description of both that the rest of
Workbench reads.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from workbench.hardware._accelerator import warn_if_unseen
from workbench._display import Displayable
from workbench._validate import check_int, check_str
from workbench.hardware import (HardwareSpec, _catalogue as catalogue, generation, hardware_presets,
                                hardware_spec, peak_flops, quiet_libtpu)

__all__ = ["HARDWARE_PRESETS", "MeshInfo", "abstract_mesh", "make_mesh", "mesh_info"]


def _axis_types(axis_types: Any, n: int) -> tuple[AxisType, ...]:
    if isinstance(axis_types, str):
        try:
            kind = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[axis_types.lower()]
        except KeyError:
            raise ValueError(
                f"axis_types={axis_types!r} is not known; use 'auto', 'explicit' or a tuple "
                "of jax.sharding.AxisType") from None
        return (kind,) * n
    if not isinstance(axis_types, (tuple, list)) or \
            not all(isinstance(t, AxisType) for t in axis_types):
        raise TypeError(f"axis_types={axis_types!r} is a {type(axis_types).__name__}; use 'auto', "
                        "'explicit' or a tuple of jax.sharding.AxisType, one per mesh axis")
    types = tuple(axis_types)
    if len(types) != n:
        raise ValueError(f"axis_types has {len(types)} entries but the mesh has {n} axes")
    return types


def _resolve_sizes(axes: Mapping[str, int], total: int, what: str) -> dict[str, int]:
    """Fill in one -1 axis and check the product equals ``total``."""
    if not axes:
        raise ValueError("a mesh needs at least one named axis, e.g. make_mesh(data=8)")
    sizes = dict(axes)
    for name, size in sizes.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"mesh axis name {name!r} must be a Python identifier")
        sizes[name] = check_int(size, name, allow=(-1,), where="mesh axis ",
                                fix="-1 infers one axis from the device count")
    inferred = [n for n, s in sizes.items() if s == -1]
    if len(inferred) > 1:
        raise ValueError(f"only one mesh axis may be -1, got {inferred}")
    known = math.prod(s for s in sizes.values() if s != -1)
    desc = " x ".join(f"{n}={s}" for n, s in sizes.items())
    if inferred:
        if total % known:
            raise ValueError(
                f"cannot infer {inferred[0]!r}: {total} {what} are not divisible by the other "
                f"axes' product {known} ({desc}); pick sizes whose product divides {total}")
        sizes[inferred[0]] = total // known
    elif known != total:
        raise ValueError(
            f"mesh {desc} needs {known} devices but {total} {what} are available; use sizes "
            f"whose product is {total}, or -1 for one axis to infer it")
    return {n: int(s) for n, s in sizes.items()}


def make_mesh(
    axes: Mapping[str, int] | None = None,
    /,
    *,
    devices: Sequence[Any] | None = None,
    axis_types: Any = "auto",
    dcn: Mapping[str, int] | None = None,
    **named: int,
) -> Mesh:
    """A named device mesh over real (or simulated) devices.

    Axis types default to *Auto*: GSPMD propagates shardings through every op, so a
    model annotated only on its parameters and inputs compiles as is. *Explicit* axes
    (``axis_types="explicit"``, JAX's own default since 0.7) make sharding part of
    the type and require an output sharding on every op whose result is ambiguous
    (a contraction over a sharded dim, a reshape that merges sharded dims); use them
    when you want that control.

    Args:
      axes: ordered ``{name: size}``; or pass sizes as keywords (``data=4, model=2``).
        Sizes are positive ints (not bools); one may be -1, inferred from the number
        of devices.
      devices: the devices to use, distinct ``jax.Device`` objects (default: all of
        ``jax.devices()``).
      axis_types: "auto", "explicit", or a tuple of ``jax.sharding.AxisType``.
      dcn: sizes across slices/hosts for a multi-slice (ICI x DCN) mesh, same axis
        names; the mesh size of each axis is ``ici * dcn``. Built with
        ``mesh_utils.create_hybrid_device_mesh``.

    Returns:
      A ``jax.sharding.Mesh``, usable directly with every JAX API.

    Example::

        mesh = wb.make_mesh(data=4, model=2)
        mesh = wb.make_mesh({"data": -1, "model": 2})
    """
    if axes is not None and named:
        raise ValueError("give the axes either as a dict or as keywords, not both: "
                         f"axes={axes!r} and {', '.join(f'{k}={v!r}' for k, v in named.items())}")
    if axes is not None and not isinstance(axes, Mapping):
        raise TypeError(f"axes={axes!r} is a {type(axes).__name__}; give the mesh axes as a dict "
                        "of name -> size, e.g. wb.make_mesh({'data': 4, 'model': 2}), or as "
                        "keywords, wb.make_mesh(data=4, model=2)")
    spec = dict(axes if axes is not None else named)
    if devices is None:
        quiet_libtpu()
    devs = _check_devices(devices) if devices is not None else jax.devices()
    if devices is None:
        warn_if_unseen({d.platform for d in devs}, "wb.make_mesh")
    types = _axis_types(axis_types, len(spec))
    dcn = _check_dcn(dcn, spec, "make_mesh")
    if dcn:
        return _hybrid_mesh(spec, dict(dcn), devs, types)
    sizes = _resolve_sizes(spec, len(devs), "devices")
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=types, devices=devs)


def _check_devices(devices: Any) -> list[Any]:
    """``devices`` as a list of distinct JAX devices, or an error saying what is wrong."""
    if isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__"):
        raise TypeError(f"devices={devices!r} must be a sequence of JAX devices, e.g. "
                        "jax.devices()[:4]")
    devs = list(np.asarray(devices, dtype=object).flat) if isinstance(devices, np.ndarray) \
        else list(devices)
    if not devs:
        raise ValueError("devices=[] is empty; a mesh needs at least one device: pass e.g. "
                         "jax.devices()[:4], or leave devices out to use all of jax.devices()")
    bad = [d for d in devs if not isinstance(d, jax.Device)]
    if bad:
        raise TypeError(f"devices holds {bad[0]!r} ({type(bad[0]).__name__}), not a JAX device; "
                        "pass device objects, e.g. jax.devices()[:4], not their ids")
    counts = collections.Counter(devs)
    dups = [d for d, n in counts.items() if n > 1]
    if dups:
        listed = ", ".join(f"{d} (x{counts[d]})" for d in dups[:4])
        raise ValueError(f"devices lists the same device more than once: {listed}; each mesh "
                         "position needs its own device: pass distinct devices, e.g. "
                         f"jax.devices()[:{len(devs)}]")
    return devs


def _check_dcn(dcn: Any, axes: Mapping[str, Any], where: str) -> dict[str, int]:
    """``dcn`` as ``{mesh axis: positive int}`` (empty for None), or an error that names
    the value and the fix: a dict keyed by the mesh's axes with integer sizes >= 1."""
    if dcn is None:
        return {}
    if not isinstance(dcn, Mapping):
        raise TypeError(f"{where}: dcn={dcn!r} must be a dict of mesh axis -> number of "
                        f"slices, e.g. dcn={{'data': 2}}")
    unknown = [a for a in dcn if a not in axes]
    if unknown:
        raise ValueError(f"{where}: dcn axes {unknown} are not mesh axes {list(axes)}; "
                         "name an axis of the mesh, e.g. dcn={'data': 2}")
    return {a: check_int(v, f"dcn[{a!r}]", where=f"{where}: ",
                         fix="the number of slices this axis spans") for a, v in dcn.items()}


def _hybrid_mesh(ici: dict[str, int], dcn: dict[str, int], devs: list, types: tuple) -> Mesh:
    from jax.experimental import mesh_utils

    unknown = set(dcn) - set(ici)
    if unknown:
        raise ValueError(f"dcn axes {sorted(unknown)} are not mesh axes {list(ici)}")
    dcn_sizes = [int(dcn.get(n, 1)) for n in ici]
    n_granules = math.prod(dcn_sizes)
    if len(devs) % n_granules:
        raise ValueError(f"{len(devs)} devices cannot form {n_granules} DCN granules (dcn={dcn})")
    ici_sizes = _resolve_sizes(ici, len(devs) // n_granules, "devices per slice")
    has_slices = all(hasattr(d, "slice_index") for d in devs)
    n_procs = len({d.process_index for d in devs})
    if not has_slices and n_procs < n_granules:
        raise ValueError(
            f"dcn={dcn} asks for {n_granules} slices, but these devices carry no slice_index "
            f"and come from {n_procs} process(es); a DCN axis needs devices from several "
            "slices or processes. On one host use ICI axes only, e.g. make_mesh(data=8).")
    grid = mesh_utils.create_hybrid_device_mesh(
        list(ici_sizes.values()), dcn_sizes, devs, process_is_granule=not has_slices)
    return Mesh(grid, tuple(ici_sizes), axis_types=types)


# ---------------------------------------------------------------------------
# One description of any mesh
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class MeshInfo(Displayable):
    """A mesh described for planning and display; real and abstract meshes alike.

    Attributes:
      axis_names: mesh axis names, major to minor.
      axis_sizes: size of each axis.
      device_ids: device ids laid out like the mesh (``0..size-1`` when abstract).
      device_kind: ``device_kind`` of the devices ("cpu", "TPU v5p", ...).
      platform: "cpu", "gpu" or "tpu".
      memory_per_device: bytes per device where known.
      peak_flops: dense bf16 FLOP/s per device where known.
      peak_source: where ``peak_flops`` comes from.
      process_index: owning process (host) per device, mesh-shaped, where known.
      coords: physical chip coordinates per device (mesh shape + (3,)), where known.
      hardware: the preset name for abstract meshes ("v5p-256").
      dcn_axis_sizes: for a multi-slice mesh, how many slices each axis spans (its size is
        ICI size x DCN size); None for one slice.
      jax_mesh: the real ``jax.sharding.Mesh``; None when abstract.
      abstract: the ``jax.sharding.AbstractMesh`` of the same shape.
    """

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    device_ids: np.ndarray
    device_kind: str = "unknown"
    platform: str = "unknown"
    memory_per_device: int | None = None
    peak_flops: float | None = None
    peak_source: str = "unknown"
    process_index: np.ndarray | None = None
    coords: np.ndarray | None = None
    hardware: str | None = None
    dcn_axis_sizes: tuple[int, ...] | None = None
    jax_mesh: Mesh | None = None
    abstract: AbstractMesh | None = None

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.axis_sizes))

    @property
    def size(self) -> int:
        return int(math.prod(self.axis_sizes))

    @property
    def is_abstract(self) -> bool:
        return self.jax_mesh is None

    @property
    def n_hosts(self) -> int:
        return 1 if self.process_index is None else int(np.unique(self.process_index).size)

    @property
    def num_slices(self) -> int:
        """Slices joined over DCN (1 for a single slice or host group)."""
        return int(math.prod(self.dcn_axis_sizes)) if self.dcn_axis_sizes else 1

    @property
    def ici_axis_sizes(self) -> tuple[int, ...]:
        """Size of each axis within one slice."""
        dcn = self.dcn_axis_sizes or (1,) * len(self.axis_sizes)
        return tuple(s // d for s, d in zip(self.axis_sizes, dcn))

    def axis_size(self, name: str) -> int:
        return self.shape[name]

    def describe(self) -> str:
        axes = " x ".join(f"{n}={s}" for n, s in self.shape.items())
        what = f"{self.hardware}: {self.device_kind}" if self.hardware else self.device_kind
        if self.num_slices > 1:
            what = f"{self.num_slices} slices of {what}"
        tag = "abstract " if self.is_abstract else ""
        return f"{tag}mesh {axes} ({self.size} devices, {what}, {self.n_hosts} host(s))"

    def __str__(self) -> str:
        lines = [self.describe()]
        if self.memory_per_device:
            lines.append(f"memory per device: {self.memory_per_device / 1024**3:.1f} GiB")
        if self.peak_flops:
            lines.append(f"peak per device: {self.peak_flops / 1e12:.4g} TFLOP/s ({self.peak_source})")
        if self.size <= 64:
            ids = self.device_ids.reshape(self.axis_sizes[0], -1)
            lines.append(f"device ids ({self.axis_names[0]} rows):")
            lines += ["  " + " ".join(f"{i:>3}" for i in row) for row in ids]
        return "\n".join(lines)

    __repr__ = describe


def mesh_info(m: Any) -> MeshInfo:
    """Describe a ``jax.sharding.Mesh``, an ``AbstractMesh`` or a ``MeshInfo`` uniformly."""
    if isinstance(m, MeshInfo):
        return m
    if isinstance(m, Mesh):
        return _concrete_info(m)
    if isinstance(m, AbstractMesh):
        sizes = tuple(int(s) for s in m.axis_sizes)
        return MeshInfo(axis_names=tuple(m.axis_names), axis_sizes=sizes,
                        device_ids=np.arange(math.prod(sizes)).reshape(sizes), abstract=m)
    raise TypeError(
        f"expected a mesh (wb.make_mesh, wb.abstract_mesh, jax.sharding.Mesh), got {type(m).__name__}")


@functools.lru_cache(maxsize=64)
def _concrete_info(m: Mesh) -> MeshInfo:
    devs = m.devices
    first = devs.flat[0]
    ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(devs)
    procs = np.vectorize(lambda d: d.process_index, otypes=[np.int64])(devs)
    coords = None
    if getattr(first, "coords", None) is not None:
        coords = np.array([tuple(d.coords) for d in devs.flat], dtype=np.int64)
        coords = coords.reshape(devs.shape + (coords.shape[-1],))
    spec = hardware_spec(first.device_kind)
    peak, source = peak_flops(first)
    memory = None
    try:
        stats = first.memory_stats() if first.process_index == jax.process_index() else None
        memory = int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None
    except Exception:  # noqa: BLE001 - not every platform implements memory_stats
        memory = None
    if memory is None and spec is not None:
        memory = spec.memory_bytes
    dcn = None
    if getattr(first, "slice_index", None) is not None:
        slices = np.vectorize(lambda d: d.slice_index, otypes=[np.int64])(devs)
        along = [len(np.unique(np.moveaxis(slices, i, 0)[(slice(None),) + (0,) * (devs.ndim - 1)]))
                 for i in range(devs.ndim)]
        dcn = tuple(along) if math.prod(along) > 1 else None
    return MeshInfo(
        axis_names=tuple(m.axis_names), axis_sizes=tuple(int(s) for s in devs.shape),
        device_ids=ids, device_kind=str(first.device_kind), platform=str(first.platform),
        memory_per_device=memory, peak_flops=peak, peak_source=source,
        process_index=procs, coords=coords, dcn_axis_sizes=dcn, jax_mesh=m,
        abstract=m.abstract_mesh)


# ---------------------------------------------------------------------------
# Hardware presets: plan for a pod on a laptop
# ---------------------------------------------------------------------------

def __getattr__(name: str) -> Any:
    if name == "HARDWARE_PRESETS":   # read from the catalogue now (it may have grown)
        return hardware_presets()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _preset(name: str) -> tuple[HardwareSpec, str, np.ndarray, np.ndarray]:
    """(spec, device_kind, coords (n, 3), process index (n,)) for a hardware preset of
    the catalogue (``workbench.hardware.GENERATIONS``)."""
    key = check_str(name, "hardware", where="abstract_mesh: ", example="'v5p-256' or '8xH100'"
                    ).strip()
    gen = generation(key)
    if gen is not None and key in gen.slices:
        spec = gen.spec
        topo = gen.slices[key]
        # chips in x-fastest order; TPU v2/v3 expose 2 cores (devices) per chip.
        chips = np.array([(x, y, z) for z in range(topo[2]) for y in range(topo[1])
                          for x in range(topo[0])], dtype=np.int64)
        coords = np.repeat(chips, spec.cores_per_chip, axis=0)
        n_chips = len(chips)
        # small v5e/v6e slices are single-host VMs (ct5lp/ct6e-...-8t); larger ones, like
        # every other generation, attach chips_per_host chips per host.
        per_host = n_chips if n_chips <= gen.single_host_chips else spec.chips_per_host
        host = np.arange(n_chips) // min(per_host, n_chips)
        return spec, gen.device_kind, coords, np.repeat(host, spec.cores_per_chip)
    servers = [g for g in catalogue.GENERATIONS if g.servers]
    m = re.fullmatch(r"(?:(\d+)x)?(\d+)x(.+)", key, flags=re.IGNORECASE)
    if m and gen is not None and gen.servers:
        hosts, per_host = int(m.group(1) or 1), int(m.group(2))
        if hosts < 1 or per_host < 1:
            raise ValueError(f"hardware preset {name!r} has no devices ({hosts} host(s) x "
                             f"{per_host} GPU(s)); use e.g. '8x{gen.name}' or "
                             f"'2x8x{gen.name}'")
        n = hosts * per_host
        coords = np.stack([np.arange(n) % per_host, np.arange(n) // per_host,
                           np.zeros(n, np.int64)], axis=1)
        return gen.spec, gen.device_kind, coords, np.arange(n) // per_host
    raise ValueError(
        f"unknown hardware preset {name!r}; known TPU slices: "
        f"{', '.join(p for g in catalogue.GENERATIONS for p in g.slices)}; GPU servers as "
        f"'8xH100' or '2x8xH100' ({', '.join(g.name for g in servers)})")


def abstract_mesh(hardware: str | None = None, /, *, dcn: Mapping[str, int] | None = None,
                  **axes: int) -> MeshInfo:
    """A mesh for hardware you do not have: any size, no devices needed.

    Args:
      hardware: optional preset ("v5e-16", "v4-32", "v5p-256", "8xH100", "2x8xH100").
        TPU v4/v5p names count TensorCores, two per chip, and JAX sees one device per
        chip (megacore), so "v5p-256" is 128 devices; v5e/v6e names count chips;
        it fixes the number of devices and carries device kind, memory per device,
        peak FLOP/s and, for TPU slices, physical chip coordinates and hosts.
      dcn: with a TPU preset, slices joined over the data-center network, per axis
        (``dcn={"data": 2}``: two slices of the preset; each axis size is ICI x DCN,
        as in ``make_mesh(..., dcn=...)``).
      **axes: mesh axis sizes; with a preset one may be -1.

    Example::

        mesh = wb.abstract_mesh(data=256, model=8)            # 2048 devices
        pod = wb.abstract_mesh("v5p-256", data=-1, model=4)   # 128 chips: data=32
        two = wb.abstract_mesh("v5p-256", data=-1, model=4, dcn={"data": 2})  # data=64
    """
    dcn = _check_dcn(dcn, axes or {"data": -1}, "abstract_mesh")
    if dcn and hardware is None:
        raise ValueError(f"abstract_mesh(dcn={dcn}) needs a hardware preset to join slices "
                         "of, e.g. wb.abstract_mesh('v5p-256', data=-1, dcn={'data': 2}); "
                         "without one, give the axes' full sizes")
    if hardware is None:
        if any(s == -1 for s in axes.values()):
            raise ValueError("abstract_mesh without a hardware preset cannot infer a -1 axis; "
                             "give every size, or a preset such as 'v5p-256'")
        sizes = _resolve_sizes(axes, math.prod(axes.values()) if axes else 0, "devices")
        shape = tuple(sizes.values())
        return MeshInfo(axis_names=tuple(sizes), axis_sizes=shape,
                        device_ids=np.arange(math.prod(shape)).reshape(shape),
                        abstract=_auto_abstract(shape, tuple(sizes)))
    spec, kind, coords, hosts = _preset(hardware)
    if dcn:
        return _multislice(hardware, dict(axes or {"data": -1}), dict(dcn))
    n = len(coords)
    sizes = _resolve_sizes(axes or {"data": -1}, n, f"{hardware} devices")
    shape = tuple(sizes.values())
    return MeshInfo(
        axis_names=tuple(sizes), axis_sizes=shape, device_ids=np.arange(n).reshape(shape),
        device_kind=kind, platform=spec.platform, memory_per_device=spec.memory_bytes,
        peak_flops=spec.peak_flops, peak_source=f"table: {spec.source}",
        process_index=hosts.reshape(shape), coords=coords.reshape(shape + (3,)),
        hardware=hardware, abstract=_auto_abstract(shape, tuple(sizes)))


def _auto_abstract(shape: tuple[int, ...], names: tuple[str, ...]) -> AbstractMesh:
    """An abstract mesh of Auto axes, as the train step needs (JAX 0.12's AbstractMesh
    defaults to Explicit axes; its concrete Mesh to Auto)."""
    return AbstractMesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def _multislice(hardware: str, axes: dict[str, int], dcn: dict[str, int]) -> MeshInfo:
    """Several slices of one preset; mesh index along an axis = slice index x ICI size +
    index within the slice (the order of ``mesh_utils.create_hybrid_device_mesh``)."""
    unknown = set(dcn) - set(axes)
    if unknown:
        raise ValueError(f"dcn axes {sorted(unknown)} are not mesh axes {list(axes)}")
    dcn_sizes = tuple(int(dcn.get(a, 1)) for a in axes)
    if any(d < 1 for d in dcn_sizes):
        raise ValueError(f"dcn sizes must be positive, got {dcn}")
    n_slices = math.prod(dcn_sizes)
    one = abstract_mesh(hardware, **{a: (s if s == -1 else s // d) if s == -1 or s % d == 0
                                     else s for (a, s), d in zip(axes.items(), dcn_sizes)})
    ici = one.axis_sizes
    for (a, s), d, i in zip(axes.items(), dcn_sizes, ici):
        if s != -1 and s != d * i:
            raise ValueError(f"mesh axis {a!r} (size {s}) is not its dcn size {d} times a "
                             f"size within one {hardware} slice; use {d} x (ICI size)")
    k = len(ici)
    hosts_per_slice = one.n_hosts

    def tile(block: np.ndarray, per_slice: np.ndarray) -> np.ndarray:
        # (dcn..., ici..., extra...) -> interleave (dcn0, ici0, dcn1, ici1, ...) -> mesh shape
        stacked = np.stack([block + off for off in per_slice]).reshape(
            dcn_sizes + block.shape)
        extra = block.ndim - k
        order = [x for j in range(k) for x in (j, k + j)] + [2 * k + e for e in range(extra)]
        shape = tuple(d * i for d, i in zip(dcn_sizes, ici)) + block.shape[k:]
        return stacked.transpose(order).reshape(shape)

    offsets = np.arange(n_slices)
    shape = tuple(d * i for d, i in zip(dcn_sizes, ici))
    return dataclasses.replace(
        one, axis_sizes=shape, device_ids=tile(one.device_ids, offsets * one.size),
        process_index=tile(one.process_index, offsets * hosts_per_slice),
        coords=tile(one.coords, offsets[:, None] * 0), dcn_axis_sizes=dcn_sizes,
        abstract=_auto_abstract(shape, one.axis_names))
