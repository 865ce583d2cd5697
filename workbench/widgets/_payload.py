"""JSON payloads of the mesh, layout and device widgets: pure functions, no front end."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from workbench._sharding.layouts import Layout
from workbench._sharding.mesh import MeshInfo, mesh_info

__all__ = ["devices_payload", "layout_payload", "mesh_payload", "mesh_summary"]


def mesh_summary(info: MeshInfo) -> dict[str, Any]:
    """What every view needs to name devices: axes, ids and hosts in mesh (row-major) order."""
    procs = None if info.process_index is None else np.asarray(info.process_index).reshape(-1)
    return {
        "axis_names": list(info.axis_names),
        "axis_sizes": [int(s) for s in info.axis_sizes],
        "size": info.size,
        "device_ids": np.asarray(info.device_ids).reshape(-1).tolist(),
        "process_index": None if procs is None else procs.tolist(),
        "n_hosts": info.n_hosts,
        "device_kind": info.device_kind,
        "memory_per_device": info.memory_per_device,
    }


def mesh_payload(mesh: Any) -> dict[str, Any]:
    """The mesh widget's payload for a ``jax.sharding.Mesh``, ``AbstractMesh`` or ``MeshInfo``.

    Devices are listed in mesh order: the device at flat position ``i`` has mesh
    coordinate ``np.unravel_index(i, axis_sizes)``.
    """
    info = mesh_info(mesh)
    coords = chips = cores = None
    if info.coords is not None:
        flat = np.asarray(info.coords).reshape(info.size, -1)
        coords = flat.tolist()
        chips, cores = _chips_and_cores(flat, np.asarray(info.device_ids).reshape(-1))
    return {
        "kind": "mesh",
        **mesh_summary(info),
        "platform": info.platform,
        "hardware": info.hardware,
        "abstract": info.is_abstract,
        "peak_flops": info.peak_flops,
        "peak_source": info.peak_source,
        "coords": coords,
        "chips": chips,
        "cores": cores,
    }


def _chips_and_cores(coords: np.ndarray, ids: np.ndarray) -> tuple[list[int], list[int] | None]:
    """Per device (mesh order): the index of its chip (devices with the same physical chip
    coordinates: TPU v2/v3 and TPU7x chips hold 2 TensorCores, each a JAX device) and its core
    on that chip (by device id), or None for cores when every chip holds one device."""
    _, first, chip = np.unique(coords, axis=0, return_index=True, return_inverse=True)
    chip = np.argsort(np.argsort(first))[chip.reshape(-1)]   # chips numbered in mesh order
    order = np.lexsort((ids, chip))                  # devices grouped by chip, then by id
    core = np.empty(len(chip), np.int64)
    starts = np.r_[0, np.flatnonzero(np.diff(chip[order])) + 1]
    core[order] = np.arange(len(chip)) - np.repeat(starts, np.diff(np.r_[starts, len(chip)]))
    return chip.tolist(), (core.tolist() if core.max(initial=0) > 0 else None)


def layout_blocks(lay: Layout) -> list[dict[str, Any]]:
    """One entry per distinct block: its index ranges, bytes and the mesh positions holding it.

    Positions are flat indices into the mesh (``lay.device_ids[pos]`` is the device);
    blocks come in row-major block order, so equal to ``lay.replica_groups`` in order.
    """
    group = np.asarray(lay.replica_group_index).reshape(-1)          # (n,) block of each device
    order = np.argsort(group, kind="stable")                         # positions grouped by block
    bounds = np.flatnonzero(np.diff(group[order])) + 1
    members = np.split(order, bounds)                                # one array per block
    firsts = np.array([m[0] for m in members], dtype=np.int64)
    starts = lay.starts[firsts].tolist()
    stops = lay.stops[firsts].tolist()
    nbytes = np.asarray(lay.block_bytes)[firsts].tolist()
    return [{"start": a, "stop": b, "bytes": n, "positions": m.tolist()}
            for a, b, n, m in zip(starts, stops, nbytes, members)]


def layout_payload(lay: Layout) -> dict[str, Any]:
    """The layout widget's payload: tensor facts, mesh, and every distinct block."""
    return {
        "kind": "layout",
        "name": lay.name,
        "shape": list(lay.shape),
        "dtype": lay.dtype.name,
        "itemsize": int(lay.dtype.itemsize),
        "spec": [list(axes) for axes in lay.spec],
        "logical_axes": None if lay.logical_axes is None else list(lay.logical_axes),
        "partitions": [int(k) for k in lay.partitions],
        "shard_shape": [int(s) for s in lay.shard_shape],
        "replication": int(lay.replication),
        "num_shards": int(lay.num_shards),
        "total_bytes": int(lay.total_bytes),
        "padded_bytes_per_device": int(lay.padded_bytes_per_device),
        "padding_waste": int(lay.padding_waste),
        "mesh": mesh_summary(lay.mesh),
        "blocks": layout_blocks(lay),
    }


def devices_payload(devices: Sequence[Any]) -> dict[str, Any]:
    """The devices widget's payload from ``wb.devices()`` (or a list of JAX devices)."""
    from workbench.hardware import DeviceInfo, peak_flops

    infos = [d if isinstance(d, DeviceInfo) else DeviceInfo.from_device(d) for d in devices]
    rows = [dataclasses.asdict(d) for d in infos]
    for row in rows:
        if row["coords"] is not None:
            row["coords"] = list(row["coords"])
    kinds = sorted({d.kind for d in infos})
    peak, source = peak_flops(kinds[0]) if len(kinds) == 1 else (None, "mixed device kinds")
    return {
        "kind": "devices",
        "rows": rows,
        "summary": {
            "count": len(infos),
            "kinds": kinds,
            "processes": len({d.process_index for d in infos}),
            "peak_flops": peak,
            "peak_source": source,
        },
    }
