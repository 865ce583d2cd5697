"""Layouts of every tensor of a pytree on one mesh: paths, logical axes, shared geometry and
bytes per device. The plan and the tree widget both read their tensors' layouts from here."""
from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from workbench._sharding.layouts import Layout, layout
from workbench._sharding.mesh import MeshInfo, abstract_mesh, mesh_info

__all__ = ["TreeLayouts", "bytes_per_device", "path_str", "tree_layouts"]


_META_KEYS = ("out_sharding", "sharding_names", "sharding")   # where NNX keeps axes/shardings


def path_str(path: tuple[Any, ...]) -> str:
    """``(DictKey('blocks'), SequenceKey(0), GetAttrKey('q'))`` or ``('blocks', 0, 'q')`` ->
    ``'blocks.0.q'`` (JAX's ``keystr``): the one spelling of tensor paths in plans, lints
    and widgets."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator=".")


def _variable_type() -> type | None:
    if "flax" not in sys.modules:
        return None  # nothing from flax can be in a tree if flax was never imported
    from flax import nnx

    return nnx.Variable


def _flatten(tree: Any, *, specs: bool = False) -> list[tuple[str, Any, Any]]:
    """``[(path, value, metadata)]``; NNX Variables are unwrapped, their sharding metadata
    (logical axes, a PartitionSpec or a NamedSharding) kept; PartitionSpecs are leaves, and
    in a tree of ``specs`` None too (no spec)."""
    var = _variable_type()
    if var is not None:
        from flax import nnx

        if isinstance(tree, nnx.Module):
            tree = nnx.state(tree)
    is_leaf = lambda x: (specs and x is None) or isinstance(x, PartitionSpec) or (
        var is not None and isinstance(x, var))
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
        meta = None
        if var is not None and isinstance(leaf, var):
            md = leaf.get_metadata()
            meta = next((md[k] for k in _META_KEYS if md.get(k) is not None), None)
            leaf = leaf.get_value()
        out.append((path_str(path) or "<root>", leaf, meta))
    return out


def _is_logical(meta: Any) -> bool:
    return isinstance(meta, tuple) and not isinstance(meta, PartitionSpec) and all(
        a is None or isinstance(a, str) for a in meta)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeLayouts:
    """The layouts of every array leaf of a pytree on one mesh (see :func:`tree_layouts`).

    Attributes:
      mesh: the mesh drawn on.
      layouts: ``{path: Layout}`` in tree order, each named after its path and carrying its
        logical axes; leaves of equal (shape, dtype, spec) share one geometry (its arrays).
      notes: ``{path: why}`` for leaves not laid out by a spec or NamedSharding of their own
        (``"no rule for 'x': replicated"``, ``"no sharding given: drawn replicated"``, or the
        sharding's type name when it is not a NamedSharding).
      skipped: paths of leaves that are not arrays (or are PRNG keys: no byte size).
    """

    mesh: MeshInfo
    layouts: dict[str, Layout]
    notes: dict[str, str]
    skipped: tuple[str, ...]

    @property
    def distinct(self) -> int:
        """How many distinct geometries the tensors share."""
        return len({id(lay.starts) for lay in self.layouts.values()})

    def __getitem__(self, path: str) -> Layout:
        """The ``Layout`` of the tensor at ``path``."""
        try:
            return self.layouts[path]
        except KeyError:
            raise KeyError(f"no tensor {path!r} in this tree; paths look like "
                           f"{list(self.layouts)[:3]}") from None

    def bytes_per_device(self, prefix: str = "") -> np.ndarray:
        """``(n_devices,)`` bytes of the tensors whose path starts with ``prefix``, per
        device of ``self.mesh`` in mesh order."""
        return bytes_per_device([v for k, v in self.layouts.items() if k.startswith(prefix)],
                                self.mesh)


def bytes_per_device(layouts: Sequence[Layout], mesh: MeshInfo) -> np.ndarray:
    """``(n_devices,)`` bytes the ``layouts`` place on each device of ``mesh`` (mesh order);
    blocks on devices outside ``mesh`` are not counted."""
    ids = np.asarray(mesh.device_ids).reshape(-1)
    lookup = np.full(int(ids.max()) + 1, -1, dtype=np.int64)     # device id -> mesh position
    lookup[ids] = np.arange(ids.size)
    total = np.zeros(ids.size, dtype=np.int64)
    shared: dict[int, tuple[Layout, int]] = {}                     # one sum per geometry
    for lay in layouts:
        first, count = shared.get(id(lay.starts), (lay, 0))
        shared[id(lay.starts)] = (first, count + 1)
    for lay, count in shared.values():
        dev = np.asarray(lay.device_ids)
        pos = np.full(dev.shape, -1, dtype=np.int64)
        known = dev < lookup.size
        pos[known] = lookup[dev[known]]                             # -1: not on this mesh
        keep = pos >= 0
        np.add.at(total, pos[keep], count * np.asarray(lay.block_bytes)[keep])
    return total


def tree_layouts(tree: Any, mesh: Any = None, *, rules: Any = None, specs: Any = None,
                 logical: Mapping[str, tuple[str | None, ...] | None] | None = None
                 ) -> TreeLayouts:
    """Every array leaf's ``Layout``: pytrees of arrays / ShapeDtypeStructs, ``nnx.Module`` s.

    A leaf's layout comes from, first to last: its entry in ``specs``; a PartitionSpec in
    its NNX metadata; its own NamedSharding (on ``mesh`` when that is the same mesh); its
    logical axes (``logical[path]``, else NNX metadata) mapped by ``rules``; its other
    sharding (single device); else replicated. Tensors of equal (shape, dtype, spec) share
    one geometry: 70B on 2048 devices has ~700 tensors but a handful of layouts.

    Args:
      tree: the pytree (an ``nnx.Module`` is read as ``nnx.state(module)``).
      mesh: the mesh (default: that of the first NamedSharding leaf, else one device).
      rules: ``wb.Rules`` (or a dict) for leaves with logical axes but no sharding.
      specs: a pytree of ``PartitionSpec`` matching ``tree``.
      logical: ``{path: logical axes}`` for leaves whose axes are not in NNX metadata.

    Example::

        tl = tree_layouts(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))), mesh, rules=rules)
        tl.layouts["blocks.0.attn.q"].logical_axes   # ('embed', 'heads', 'head_dim')
    """
    if rules is not None and not hasattr(rules, "spec"):
        from workbench._sharding.rules import Rules

        rules = Rules(**dict(rules))
    leaves = _flatten(tree)
    spec_of = {p: v for p, v, _ in _flatten(specs, specs=True)} if specs is not None else {}
    logical = dict(logical or {})
    info = None if mesh is None else mesh_info(mesh)
    info = info or next((mesh_info(s.mesh) for _, v, m in leaves
                         if isinstance(s := _sharding(v, m), NamedSharding)), None)
    info = info or abstract_mesh(devices=1)
    cache: dict[Any, Layout] = {}
    out: dict[str, Layout] = {}
    notes: dict[str, str] = {}
    skipped = []
    for path, value, meta in leaves:
        if not (hasattr(value, "shape") and hasattr(value, "dtype")) or \
                jax.dtypes.issubdtype(value.dtype, jax.dtypes.extended):
            skipped.append(path)
            continue
        axes = logical.get(path, tuple(meta) if _is_logical(meta) else None)
        spec, sharding, note = _choose(path, value, meta, spec_of.get(path), axes, rules, info)
        shape, dtype = tuple(int(s) for s in value.shape), np.dtype(value.dtype)
        key = (shape, dtype.str, sharding if spec is None else tuple(spec))
        if key not in cache:
            cache[key] = layout(shape, spec, info, dtype=dtype, name=path) if spec is not None \
                else layout(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding), name=path)
        lay = copy.copy(cache[key])
        lay.name, lay.logical_axes = path, axes
        out[path] = lay
        if note:
            notes[path] = note
    return TreeLayouts(mesh=info, layouts=out, notes=notes, skipped=tuple(skipped))


def _sharding(value: Any, meta: Any) -> Any:
    return meta if isinstance(meta, NamedSharding) else getattr(value, "sharding", None)


def _choose(path: str, value: Any, meta: Any, spec: Any, axes: Any, rules: Any,
            mesh: MeshInfo) -> tuple[Any, Any, str | None]:
    """``(spec, sharding, note)`` of one leaf: a spec on ``mesh``, or (spec None) a sharding
    to lay out as it is."""
    if spec is None and isinstance(meta, PartitionSpec):
        spec = meta
    if spec is not None:
        return spec, None, None
    sharding = _sharding(value, meta)
    if isinstance(sharding, NamedSharding):
        same = sharding.mesh in (mesh.jax_mesh, mesh.abstract)
        return (sharding.spec, None, None) if same else (None, sharding, None)
    if axes is not None and rules is not None:
        unmapped = rules.unmapped(axes)
        note = f"no rule for {', '.join(map(repr, unmapped))}: replicated" if unmapped else None
        return rules.spec(axes, tensor=path, strict=False), None, note
    if sharding is not None:
        return None, sharding, type(sharding).__name__
    hint = "; pass rules= to map its logical axes" if axes else ""
    return PartitionSpec(), None, f"no sharding given: drawn replicated{hint}"
