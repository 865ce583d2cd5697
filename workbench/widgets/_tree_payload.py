"""Pytree payload: one summary row per tensor, identical layouts built once, memory per device."""
from __future__ import annotations

import copy
import dataclasses
import math
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from workbench.layouts import Layout, format_bytes, layout
from workbench.mesh import MeshInfo, abstract_mesh, mesh_info
from workbench.widgets._payload import mesh_summary

__all__ = ["TreeLayouts", "tree_payload", "tree_text"]

_LOGICAL_KEYS = ("out_sharding", "sharding_names", "sharding")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of the tree: where it is, what it is, and which shared layout it has."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    logical: tuple[str | None, ...] | None
    layout: int
    spec: str
    note: str | None


def _key_str(k: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_str(path: tuple[Any, ...]) -> str:
    """``(DictKey('blocks'), SequenceKey(0), GetAttrKey('w'))`` -> ``'blocks.0.w'``."""
    return ".".join(_key_str(k) for k in path) or "<root>"


def _variable_type() -> type | None:
    if "flax" not in sys.modules:
        return None  # nothing from flax can be in the tree if flax was never imported
    from flax import nnx

    return nnx.Variable


def _flatten(tree: Any) -> list[tuple[str, Any]]:
    """``[(path, leaf)]`` with NNX Variables kept whole (their metadata holds logical axes)."""
    var = _variable_type()
    if var is not None:
        from flax import nnx

        if isinstance(tree, nnx.Module):
            tree = nnx.state(tree)
    is_leaf: Callable[[Any], bool] | None = (lambda x: isinstance(x, var)) if var else None
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(path_str(p), leaf) for p, leaf in flat]


def _unwrap(leaf: Any) -> tuple[Any, Any]:
    """(array-like value, sharding metadata or None) of a leaf, unwrapping NNX Variables."""
    var = _variable_type()
    if var is not None and isinstance(leaf, var):
        meta = leaf.get_metadata()
        value = leaf.get_value() if hasattr(leaf, "get_value") else leaf.value
        return value, next((meta[k] for k in _LOGICAL_KEYS if meta.get(k) is not None), None)
    return leaf, None


def _spec_str(spec: tuple[tuple[str, ...], ...]) -> str:
    parts = ["None" if not a else repr(a[0]) if len(a) == 1 else repr(a) for a in spec]
    return f"P({', '.join(parts)})"


class TreeLayouts:
    """The layouts of every tensor of a pytree or ``nnx.Module`` on one mesh.

    Identical (shape, dtype, sharding) leaves share one ``Layout``, so a 700-tensor
    model on 2048 devices builds a handful of layouts.

    Args:
      tree: a pytree of ``jax.Array`` / ``ShapeDtypeStruct`` / numpy arrays, or an
        ``nnx.Module`` / ``nnx.State`` (logical axes are read from Variable metadata).
      mesh: the mesh to draw on (default: the mesh of the first ``NamedSharding`` leaf).
      rules: ``wb.Rules`` (or a dict) mapping logical axes to mesh axes, for leaves
        that carry logical axes but no sharding.
      specs: a pytree of ``PartitionSpec`` matching ``tree``; wins over everything else.
    """

    def __init__(self, tree: Any, *, mesh: Any = None, rules: Any = None, specs: Any = None,
                 title: str | None = None) -> None:
        if rules is not None and not hasattr(rules, "spec"):
            from workbench.rules import Rules

            rules = Rules(**dict(rules))
        self.title = title or (type(tree).__name__ if not isinstance(tree, dict) else "pytree")
        self.rules = rules
        self._given_mesh = None if mesh is None else mesh_info(mesh)
        spec_of = dict(_flatten_specs(specs)) if specs is not None else {}
        self.layouts: list[Layout] = []
        self.counts: list[int] = []
        self._cache: dict[Any, int] = {}
        self.entries: list[Entry] = []
        self.skipped: list[str] = []
        leaves = [(p, *_unwrap(leaf)) for p, leaf in _flatten(tree)]
        self.mesh = self._given_mesh or _first_mesh(leaves) or abstract_mesh(devices=1)
        for path, value, meta in leaves:
            if not (hasattr(value, "shape") and hasattr(value, "dtype")) or _is_extended(value.dtype):
                self.skipped.append(path)  # not an array, or a PRNG key (no byte size)
                continue
            self.entries.append(self._entry(path, value, meta, spec_of.get(path)))
        self._by_path = {e.path: e for e in self.entries}

    def _entry(self, path: str, value: Any, meta: Any, spec: Any) -> Entry:
        shape = tuple(int(s) for s in value.shape)
        dtype = np.dtype(value.dtype)
        logical = tuple(meta) if isinstance(meta, tuple) and not isinstance(
            meta, PartitionSpec) and all(a is None or isinstance(a, str) for a in meta) else None
        note = None
        sharding = meta if isinstance(meta, NamedSharding) else getattr(value, "sharding", None)
        if spec is None and isinstance(meta, PartitionSpec):
            spec = meta
        planned = logical is not None and self.rules is not None
        if spec is None and sharding is not None and (
                isinstance(sharding, NamedSharding) or not planned):
            key: Any = ("sharding", shape, dtype.str, sharding)
            if not isinstance(sharding, NamedSharding):
                note = type(sharding).__name__
        else:
            if spec is None and planned:
                unmapped = self.rules.unmapped(logical)
                spec = self.rules.spec(logical, tensor=path, strict=False)
                if unmapped:
                    note = f"no rule for {', '.join(map(repr, unmapped))}: replicated"
            elif spec is None:
                spec = PartitionSpec()
                note = "no sharding given: drawn replicated" + (
                    "; pass rules= to map its logical axes" if logical else "")
            sharding = None
            key = ("spec", shape, dtype.str, tuple(spec), id(self.mesh))
        index = self._cache.get(key)
        if index is None:
            index = self._cache[key] = len(self.layouts)
            self.layouts.append(
                layout(shape, spec, self.mesh, dtype=dtype, name=path) if sharding is None
                else layout(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding), name=path))
            self.counts.append(0)
        self.counts[index] += 1
        lay = self.layouts[index]
        spec_text = _spec_str(lay.spec) if note is None or "replicated" in note else note
        return Entry(path, shape, dtype, logical, index, spec_text, note)

    def layout(self, path: str) -> Layout:
        """The ``Layout`` of the tensor at ``path`` (named after it)."""
        try:
            entry = self._by_path[path]
        except KeyError:
            raise KeyError(f"no tensor {path!r} in this tree; paths look like "
                           f"{[e.path for e in self.entries[:3]]}") from None
        lay = copy.copy(self.layouts[entry.layout])
        lay.name, lay.logical_axes = path, entry.logical
        return lay

    def memory(self) -> np.ndarray:
        """``(n_devices,)`` parameter bytes per device of ``self.mesh``, in mesh order."""
        ids = np.asarray(self.mesh.device_ids).reshape(-1)
        lookup = np.full(int(ids.max()) + 1, -1, dtype=np.int64)    # device id -> mesh position
        lookup[ids] = np.arange(ids.size)
        total = np.zeros(ids.size, dtype=np.int64)
        for lay, count in zip(self.layouts, self.counts):
            dev = np.asarray(lay.device_ids)
            pos = np.full(dev.shape, -1, dtype=np.int64)
            known = dev < lookup.size
            pos[known] = lookup[dev[known]]                          # -1: not on this mesh
            keep = pos >= 0
            np.add.at(total, pos[keep], count * np.asarray(lay.block_bytes)[keep])
        return total

    def payload(self) -> dict[str, Any]:
        """The tree widget's JSON payload: rows, mesh, memory per device, totals."""
        rows = []
        for e in self.entries:
            lay = self.layouts[e.layout]
            rows.append({
                "path": e.path, "shape": list(e.shape), "dtype": e.dtype.name, "spec": e.spec,
                "logical": None if e.logical is None else list(e.logical),
                "bytes": int(lay.block_bytes.max()) if lay.n_devices else 0,
                "replication": int(lay.replication), "total": int(lay.total_bytes),
                "shard": list(lay.shard_shape), "layout": e.layout, "note": e.note,
            })
        memory = self.memory()
        peak = int(memory.max()) if memory.size else 0
        ids = np.asarray(self.mesh.device_ids).reshape(-1)
        return {
            "kind": "tree",
            "title": self.title,
            "mesh": mesh_summary(self.mesh),
            "rows": rows,
            "memory": memory.tolist(),
            "skipped": self.skipped,
            "totals": {
                "tensors": len(rows),
                "params": int(sum(math.prod(e.shape) for e in self.entries)),
                "bytes": int(sum(r["total"] for r in rows)),
                "max_device_bytes": peak,
                "max_devices": ids[memory == peak].tolist()[:8] if memory.size else [],
                "max_count": int((memory == peak).sum()),
            },
        }

    def text(self, limit: int = 40) -> str:
        """The same table as text (for terminals and ``repr``)."""
        head = ("path", "shape", "dtype", "spec", "bytes/device", "replicas")
        rows = [head]
        for e in self.entries[:limit]:
            lay = self.layouts[e.layout]
            rows.append((e.path, str(e.shape), e.dtype.name, e.spec,
                         format_bytes(int(lay.block_bytes.max())), f"x{lay.replication}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        if len(self.entries) > limit:
            lines.append(f"... {len(self.entries) - limit} more tensors")
        mem = self.memory()
        lines.append(f"{len(self.entries)} tensors on {self.mesh.describe()}; max "
                     f"{format_bytes(int(mem.max()) if mem.size else 0)} of parameters per device")
        return "\n".join(lines)


def _is_extended(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def _flatten_specs(specs: Any) -> list[tuple[str, Any]]:
    var = _variable_type()

    def is_leaf(x: Any) -> bool:
        return x is None or isinstance(x, PartitionSpec) or (var is not None and isinstance(x, var))

    flat, _ = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_leaf)
    return [(path_str(p), _unwrap(s)[0]) for p, s in flat]


def _first_mesh(leaves: list[tuple[str, Any, Any]]) -> MeshInfo | None:
    for _, value, meta in leaves:
        sharding = meta if isinstance(meta, NamedSharding) else getattr(value, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return mesh_info(sharding.mesh)
    return None


def tree_payload(tree: Any, *, mesh: Any = None, rules: Any = None, specs: Any = None,
                 title: str | None = None) -> dict[str, Any]:
    """The tree widget's payload (see :class:`TreeLayouts`); pure, no front end."""
    return TreeLayouts(tree, mesh=mesh, rules=rules, specs=specs, title=title).payload()


def tree_text(tree: Any, **kwargs: Any) -> str:
    """The tree's layout table as text."""
    return TreeLayouts(tree, **kwargs).text()
