"""Pytree payload: one summary row per tensor and memory per device, from the core's
``workbench._sharding.pytrees.tree_layouts`` (this module only turns them into JSON and text)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from workbench._sharding.layouts import format_bytes
from workbench._sharding.pytrees import TreeLayouts, tree_layouts
from workbench.widgets._payload import mesh_summary

__all__ = ["spec_text", "tree_payload", "tree_text"]


def spec_text(spec: tuple[tuple[str, ...], ...]) -> str:
    """``(('data',), (), ('data', 'model'))`` -> ``"P('data', None, ('data', 'model'))"``."""
    parts = ["None" if not a else repr(a[0]) if len(a) == 1 else repr(a) for a in spec]
    return f"P({', '.join(parts)})"


def _layouts(tree: Any, **kwargs: Any) -> TreeLayouts:
    return tree if isinstance(tree, TreeLayouts) else tree_layouts(tree, **kwargs)


def _spec_column(tl: TreeLayouts, path: str) -> str:
    note = tl.notes.get(path)
    return spec_text(tl.layouts[path].spec) if note is None or "replicated" in note else note


def tree_payload(tree: Any, *, mesh: Any = None, rules: Any = None, specs: Any = None,
                 title: str | None = None) -> dict[str, Any]:
    """The tree widget's payload: rows, mesh, memory per device, totals; pure, no front end.

    Args:
      tree: a pytree or ``nnx.Module`` (laid out by ``tree_layouts(tree, mesh, rules=,
        specs=)``), or a ``TreeLayouts`` already made.
      title: the table's title (default: the tree's type).
    """
    tl = _layouts(tree, mesh=mesh, rules=rules, specs=specs)
    rows = []
    for path, lay in tl.layouts.items():
        rows.append({
            "path": path, "shape": list(lay.shape), "dtype": lay.dtype.name,
            "spec": _spec_column(tl, path),
            "logical": None if lay.logical_axes is None else list(lay.logical_axes),
            "bytes": int(lay.block_bytes.max()) if lay.n_devices else 0,
            "replication": int(lay.replication), "total": int(lay.total_bytes),
            "shard": list(lay.shard_shape), "note": tl.notes.get(path),
        })
    memory = tl.bytes_per_device()
    peak = int(memory.max()) if memory.size else 0
    ids = np.asarray(tl.mesh.device_ids).reshape(-1)
    default = "pytree" if isinstance(tree, (dict, TreeLayouts)) else type(tree).__name__
    return {
        "kind": "tree",
        "title": title or default,
        "mesh": mesh_summary(tl.mesh),
        "rows": rows,
        "memory": memory.tolist(),
        "skipped": list(tl.skipped),
        "totals": {
            "tensors": len(rows),
            "params": int(sum(math.prod(lay.shape) for lay in tl.layouts.values())),
            "bytes": int(sum(r["total"] for r in rows)),
            "max_device_bytes": peak,
            "max_devices": ids[memory == peak].tolist()[:8] if memory.size else [],
            "max_count": int((memory == peak).sum()),
        },
    }


def tree_text(tree: Any, limit: int = 40, **kwargs: Any) -> str:
    """The tree's layout table as text (for terminals and ``repr``); ``tree`` as in
    :func:`tree_payload`."""
    tl = _layouts(tree, **kwargs)
    head = ("path", "shape", "dtype", "spec", "bytes/device", "replicas")
    rows = [head]
    for path, lay in list(tl.layouts.items())[:limit]:
        rows.append((path, str(lay.shape), lay.dtype.name, _spec_column(tl, path),
                     format_bytes(int(lay.block_bytes.max())), f"x{lay.replication}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if len(tl.layouts) > limit:
        lines.append(f"... {len(tl.layouts) - limit} more tensors")
    mem = tl.bytes_per_device()
    lines.append(f"{len(tl.layouts)} tensors on {tl.mesh.describe()}; max "
                 f"{format_bytes(int(mem.max()) if mem.size else 0)} of parameters per device")
    return "\n".join(lines)
